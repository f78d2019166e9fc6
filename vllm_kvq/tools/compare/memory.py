"""Memory of each method: the model's dimensions and bytes per token from the page layout
(csrc/kvq_layout.h: codes, scales, zero-points, padding), the residual window."""
from __future__ import annotations

import json
from pathlib import Path

from vllm_kvq.tools.compare.plan import base_method
from vllm_kvq.tools.evaluate import VLLM_PEERS


def model_dims(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads", heads),
            "q_heads": heads, "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "vocab": cfg["vocab_size"], "max_position_embeddings":
            cfg.get("max_position_embeddings")}


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def memory_row(method: str, dims: dict, dtype: str, block_size: int = 128) -> dict:
    """Bytes per token per kv head (K+V, scales/zero-points/padding included), for the whole
    model, the residual window per sequence, and the ratio to a bf16 cache."""
    D, L, H = dims["head_dim"], dims["layers"], dims["kv_heads"]
    elem = DTYPE_BYTES.get(dtype, 2)
    m = base_method(method)
    if m in VLLM_PEERS:
        per_head = 2 * D * (1 if m == "vllm-fp8" else elem)
        desc = "fp8 (vLLM)" if m == "vllm-fp8" else f"{dtype} (vLLM)"
        residual = window = 0
        fields = {}
    else:
        from vllm_kvq.config import config_from_dict

        fmt = config_from_dict({"method": m}).fmt
        lay = fmt.layout(D, block_size)
        per_head = lay.token_bytes
        recent = "int8" if fmt.window_bits == 8 else "fp"
        desc = f"K {fmt.key.describe()}, V {fmt.value.describe()}" + (
            f", {fmt.residual_tokens} recent {recent}" if fmt.residual_tokens else "")
        residual = fmt.residual_bytes_per_seq(L, H, D)
        # the pool blocks holding it while the sequence runs (vllm_kvq.window_cache)
        window = fmt.window_blocks_per_seq(D, block_size) * block_size * per_head * L * H
        fields = {k: v / block_size for k, v in lay.fields().items() if v}
    return {"format": desc, "bytes_per_token_head": per_head,
            "bytes_per_token_model": per_head * L * H, "bits_per_value": per_head * 8 / (2 * D),
            "ratio_vs_bf16": 4 * D / per_head, "residual_bytes_per_seq": residual,
            "window_bytes_per_seq": window, "fields_per_token_head": fields}
