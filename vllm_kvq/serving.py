"""What the API server tells about the KV cache: Prometheus gauges and `GET /kvq/config`.

A `vllm.endpoint_plugins` entry point (setup.py: `vllm_kvq_routes`), loaded by vLLM's API
server only when `VLLM_PLUGINS` names it (`vllm-kvq serve` does). No fork, no new metrics
route: the gauges join the registry vLLM's `/metrics` already serves.

Everything comes from the front-end's own `engine_client.vllm_config`: the `kvq` section of
`--additional-config`, the model's shape, and `cache_config.num_gpu_blocks`, which the
engine core reports back during the startup handshake (v1/engine/core_client.py), before
`init_state` runs. A server that runs vLLM's own cache (no `--attention-backend CUSTOM`)
reports that cache as method `vllm:<kv-cache-dtype>`.
"""
from __future__ import annotations

import logging
from typing import Any

# under "vllm.": vLLM configures that logger tree (handlers, format); a plain one prints nothing
logger = logging.getLogger("vllm." + __name__)

ROUTE = "/kvq/config"
PLUGIN_NAME = "vllm_kvq_routes"  # the entry point's name; VLLM_PLUGINS must list it
# name -> (documentation, key in kv_summary()); one sample each, labelled by method.
GAUGES = {
    "kvq:bits_per_value": ("KV cache bits per cached K or V value, scales, zero-points "
                           "and page padding included", "bits_per_value"),
    "kvq:bytes_per_token": ("KV cache bytes per token, all layers and KV heads, K+V, "
                            "metadata included (the residual window is per sequence)",
                            "bytes_per_token"),
    "kvq:ratio_vs_bf16": ("bf16 cache bytes per token / this cache's bytes per token",
                          "ratio_vs_bf16"),
    "kvq:residual_tokens": ("recent tokens per sequence kept in full precision",
                            "residual_tokens"),
    "kvq:capacity_tokens": ("tokens the KV cache holds: num_gpu_blocks x block_size "
                            "(running sequences' windows take their blocks from it)",
                            "capacity_tokens"),
    "kvq:window_bytes_per_seq": ("KV pool bytes one running sequence's full-precision "
                                 "window takes (its window blocks, all layers)",
                                 "window_bytes_per_seq"),
}
INFO_GAUGE = "kvq:method_info"  # 1, labelled with method, key and value codecs
_registered: dict[str, Any] = {}


def kv_summary(vllm_config) -> dict[str, Any]:
    """The active KV configuration with its exact sizes (the JSON of `GET /kvq/config`)."""
    from vllm_kvq.plugin import uses_kvq

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    # the whole model's layers (under pipeline parallelism get_num_layers counts stage 0);
    # kv heads of one tensor-parallel rank (replicated when TP exceeds the kv-head count)
    total_layers = getattr(model, "get_total_num_hidden_layers", None)
    layers = total_layers() if total_layers else model.get_num_layers(par)
    heads = model.get_num_kv_heads(par)
    tp = getattr(par, "tensor_parallel_size", 1) or 1
    pp = getattr(par, "pipeline_parallel_size", 1) or 1
    head_dim = model.get_head_size()
    block_size = cache.block_size
    blocks = cache.num_gpu_blocks
    bf16_per_token = layers * heads * 2 * head_dim * 2
    served = model.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    out: dict[str, Any] = {
        "model": served or model.model,
        "num_layers": layers, "num_kv_heads": heads, "head_dim": head_dim,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "block_size": block_size, "num_blocks": blocks,
        "capacity_tokens": blocks * block_size if blocks is not None else None,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,  # the pool: pages + windows
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
        "kv_heads_per_rank": heads,
    }
    if uses_kvq(vllm_config):
        from vllm_kvq.config import config_from_vllm, speculative_tokens

        cfg = config_from_vllm(vllm_config)
        fmt = cfg.fmt
        per_head = fmt.bytes_per_token(head_dim, block_size)
        # A running sequence's window (16-bit whatever the model's dtype, or int8 with _w8)
        # takes whole blocks of the pool (vllm_kvq.window_cache), only while it runs.
        window_blocks = fmt.window_blocks_per_seq(head_dim, block_size,
                                                  lookback=speculative_tokens(vllm_config))
        window_per_seq = window_blocks * block_size * per_head["total"] * layers * heads
        out.update({
            "backend": "vllm_kvq", "method": fmt.name,
            "key": fmt.key.describe(), "value": fmt.value.describe(),
            "bits_per_value": fmt.bits_per_value(head_dim, block_size),
            "bytes_per_token_per_kv_head": per_head["total"],
            "bytes_per_token": per_head["total"] * layers * heads,
            "ratio_vs_bf16": fmt.ratio_vs_bf16(head_dim, block_size),
            "residual_tokens": fmt.residual_tokens,
            "residual_bytes_per_seq": fmt.residual_bytes_per_seq(layers, heads, head_dim),
            "window_bits": fmt.window_bits,
            "sink_tokens": fmt.sink,
            "window_blocks_per_seq": window_blocks,
            "window_bytes_per_seq": window_per_seq,
            # if every sequence slot ran at once; memory follows the sequences that run
            "window_bytes_at_max_num_seqs": window_per_seq
            * vllm_config.scheduler_config.max_num_seqs,
            "config": cfg.to_dict(),
        })
    else:
        dtype = cache.cache_dtype
        elem = 1 if str(dtype).startswith("fp8") else model.dtype.itemsize
        per_token = layers * heads * 2 * head_dim * elem
        out.update({
            "backend": "vllm", "method": f"vllm:{dtype}",
            "key": str(dtype), "value": str(dtype),
            "bits_per_value": 8 * elem,
            "bytes_per_token_per_kv_head": 2 * head_dim * elem,
            "bytes_per_token": per_token,
            "ratio_vs_bf16": bf16_per_token / per_token,
            "residual_tokens": 0, "residual_bytes_per_seq": 0, "window_blocks_per_seq": 0,
            "window_bytes_per_seq": 0, "window_bytes_at_max_num_seqs": 0,
            "config": None,
        })
    out["bf16_bytes_per_token"] = bf16_per_token
    return out


def publish_gauges(summary: dict[str, Any]) -> None:
    """Set the gauges in prometheus_client's registry (the one `/metrics` serves; in
    multi-process mode the values go through PROMETHEUS_MULTIPROC_DIR like vLLM's own)."""
    from prometheus_client import Gauge

    if not _registered:  # once per process: registering a name twice raises
        _registered[INFO_GAUGE] = Gauge(
            INFO_GAUGE, "Active KV cache method (value 1)", ["method", "key", "value"],
            multiprocess_mode="mostrecent")
        for name, (doc, _) in GAUGES.items():
            _registered[name] = Gauge(name, doc, ["method"], multiprocess_mode="mostrecent")
    method = summary["method"]
    _registered[INFO_GAUGE].labels(method=method, key=summary["key"],
                                   value=summary["value"]).set(1)
    for name, (_, key) in GAUGES.items():
        if summary.get(key) is not None:
            _registered[name].labels(method=method).set(summary[key])


class KVQEndpointPlugin:
    """vLLM EndpointPlugin (vllm/plugins/endpoint_plugins/interface.py)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)  # needs an engine: not on the CPU-only render server

    def __init__(self) -> None:
        self.summary: dict[str, Any] | None = None  # set by init_state, once the engine is up

    def attach_router(self, app) -> None:
        from fastapi.responses import JSONResponse

        @app.get(ROUTE, tags=["vllm-kvq"])
        async def kvq_config() -> JSONResponse:
            if self.summary is None:
                return JSONResponse({"error": "KV configuration not known yet"},
                                    status_code=503)
            return JSONResponse(self.summary)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        self.summary = summary = kv_summary(engine_client.vllm_config)
        publish_gauges(summary)
        logger.info("vllm-kvq: %s, %.4g bytes/token (x%.3g vs bf16), capacity %s tokens in "
                    "%s bytes; window %d tokens in %d blocks = %d bytes per running sequence "
                    "(%d bytes at max_num_seqs=%d); GET %s", summary["method"],
                    summary["bytes_per_token"], summary["ratio_vs_bf16"],
                    summary["capacity_tokens"], summary["kv_cache_memory_bytes"],
                    summary["residual_tokens"], summary["window_blocks_per_seq"],
                    summary["window_bytes_per_seq"], summary["window_bytes_at_max_num_seqs"],
                    summary["max_num_seqs"], ROUTE)
