"""The vLLM plugin: version pin, CUSTOM registration, CPU selection, config validated early,
unsupported attention features refused by name."""
from types import SimpleNamespace

import pytest
import torch
import vllm

from vllm_kvq import backend, plugin
from vllm_kvq.model_prep import ensure_default_model


def test_unsupported_vllm_version_is_refused_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; installed vLLM is 0\.31\.2"):
        plugin.register()


def test_register_is_idempotent_and_cpu_honours_custom():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_PATH
    path = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, None)
    assert path == plugin.BACKEND_PATH


def engine_config(kvq, **kw):
    from vllm.engine.arg_utils import EngineArgs

    kw = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 4, **kw}
    args = EngineArgs(model=str(ensure_default_model(verbose=False)), attention_backend="CUSTOM",
                      additional_config={"kvq": kvq} if kvq is not None else {}, **kw)
    return args.create_engine_config()


@pytest.mark.parametrize("kvq,kw,match", [
    ({"method": "int5_group32"}, {}, r"vllm-kvq: kvq\.method='int5_group32': bits=5 is not allowed"),
    (None, {}, r'no "kvq" configuration'),
    ({"method": "kivi2", "residual_tokens": 96}, {},
     "residual_tokens=96 must divide block_size=128"),
    ({"method": "int4_group32"}, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype=fp8 is not allowed"),
])
def test_bad_config_fails_before_any_engine_starts(kvq, kw, match):
    plugin.register()
    with pytest.raises(ValueError, match=match):
        engine_config(kvq, **kw)


def test_the_budget_is_left_to_vllm_whatever_max_num_seqs():
    """The residual window's blocks come from vLLM's own pool (vllm_kvq.window_cache):
    nothing is taken out of the budget, and no max_num_seqs is too many for it."""
    plugin.register()
    for seqs in (4, 256):
        cfg = engine_config({"method": "kivi2"}, max_num_seqs=seqs)
        assert cfg.cache_config.kv_cache_memory_bytes == 64 << 20


@pytest.mark.parametrize("feature, kw", [
    ("sinks", {"sinks": "tensor"}),
    ("alibi_slopes", {"alibi_slopes": [0.5] * 4}),
    ("kv_sharing_target_layer_name", {"kv_sharing_target_layer_name": "model.layers.0.attn"}),
])
def test_unsupported_attention_features_are_refused_by_name(feature, kw, monkeypatch):
    """Attention sinks (gpt-oss), ALiBi and cross-layer KV sharing: the layer's impl refuses
    them at construction, naming the feature (no engine needed: the refusal comes before the
    impl reads anything else of the config)."""
    if kw.get("sinks") == "tensor":
        kw = {"sinks": torch.zeros(4)}
    cfg = SimpleNamespace(additional_config={"kvq": {"method": "int4_group32"}},
                          model_config=None)
    monkeypatch.setattr(backend, "_ACTIVE", None)
    monkeypatch.setattr(backend, "get_current_vllm_config", lambda: cfg)
    with pytest.raises(NotImplementedError, match=f"does not support {feature}"):
        backend.KVQAttentionImpl(4, 64, 0.125, 1, **kw)
