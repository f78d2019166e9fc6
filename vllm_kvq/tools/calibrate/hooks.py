"""A transformers causal LM whose attention exposes the cache's K (post-RoPE) and V to a
hook: how calibration captures them (and their gradients) and how its evaluation replaces
them by their quantize-dequantize."""
from __future__ import annotations

import torch

from vllm_kvq.codebook_file import CalibrationError

_ATTN_NAME = "vllm_kvq_calibration"
_HOOK = None  # callable(layer_idx, key, value) -> (key, value), set while calibrating


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA with a hook on the cache's K (post-RoPE) and V ([B, H_kv, T, D])."""
    import torch.nn.functional as F

    if _HOOK is not None:
        key, value = _HOOK(module.layer_idx, key, value)
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    if attention_mask is not None:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1,
                                             scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def load_model(model: str):
    """A transformers causal LM in float32 whose attention calls our hook."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(_ATTN_NAME, _attention)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                             attn_implementation=_ATTN_NAME)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def model_dims(config) -> dict:
    heads = config.num_attention_heads
    return {"model_type": config.model_type,
            "architecture": (getattr(config, "architectures", None) or ["?"])[0],
            "num_layers": config.num_hidden_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


class set_hook:
    """While active, every attention layer calls fn(layer_idx, key, value) -> (key, value)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        global _HOOK
        self.prev, _HOOK = _HOOK, self.fn

    def __exit__(self, *exc):
        global _HOOK
        _HOOK = self.prev


def check_window(model, n: int) -> None:
    sw = getattr(model.config, "sliding_window", None)
    if sw and n > sw:
        raise CalibrationError(f"sequences of {n} tokens exceed the model's sliding window "
                               f"({sw}), which this calibration does not model; use --seq-len <= {sw}")

