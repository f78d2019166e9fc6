"""Test-only faults and measurement variants, installed by the process that runs an engine
(never by serving code).

`clobber_cache`: every cache write is followed by overwriting the layer's whole cache, so a
measurement that really reads K/V back from the pages must change (tests and `compare`
use it to show they would catch a broken cache).
`window_int8` / `window_fp8`: the residual window as if stored in 8 bits (int8 with one
scale per token and head, or fp8 e4m3 unscaled): each step's new K/V rows are rounded
before they enter the window, so attention reads, the window keeps and the quantized
chunks are made from the 8-bit values (rounding is idempotent), the question #12 asks
of an 8-bit window.
`no_soft_cap`: the backend ignores the model's logit soft-cap (what it did before it
supported one), so a test of soft-capped attention shows it would catch that.
The patch lives in this process, so the engine must run in-process too: installing it
turns vLLM's engine-core child process off.
"""
from __future__ import annotations

import os

FAULT_ENV = "VLLM_KVQ_FAULT"
FAULTS = ("clobber_cache", "window_int8", "window_fp8", "no_soft_cap")


def round_int8_rows(x):
    """[N, H, D] -> the values of int8 codes with one scale (max |x| / 127) per row."""
    s = x.float().abs().amax(-1, keepdim=True) / 127
    s = s.masked_fill(s == 0, 1.0)
    return ((x.float() / s).round().clamp(-127, 127) * s).to(x.dtype)


def round_fp8_rows(x):
    import torch
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def install(name: str) -> None:
    if name not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={name!r} is not a fault; allowed: {', '.join(FAULTS)}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if name == "no_soft_cap":
        from vllm_kvq import ops

        ops.soft_cap_for = lambda logits_soft_cap: 0.0
        return
    if name.startswith("window_"):
        from vllm_kvq import backend

        rnd = round_int8_rows if name == "window_int8" else round_fp8_rows
        stage = backend.stage_and_write

        def stage_8bit(md, key, value, pool, addresses, write):
            return stage(md, rnd(key), rnd(value), pool, addresses, write)

        backend.stage_and_write = stage_8bit
        return
    from vllm_kvq.ops import LayerOps

    write = LayerOps.write

    def write_then_clobber(self, key, value, cache, slot_mapping):
        write(self, key, value, cache, slot_mapping)
        cache.fill_(0x3C)

    LayerOps.write = write_then_clobber


def install_from_env() -> None:
    """Install the fault named by VLLM_KVQ_FAULT, if any."""
    name = os.environ.get(FAULT_ENV, "")
    if name:
        install(name)
