"""Test-only faults, installed by the process that runs an engine (never by serving code).

`clobber_cache`: every cache write is followed by overwriting the layer's whole cache, so a
measurement that really reads K/V back from the pages must change (tests and `compare`
use it to show they would catch a broken cache). The patch lives in this process, so the
engine must run in-process too: installing it turns vLLM's engine-core child process off.
"""
from __future__ import annotations

import os

FAULT_ENV = "VLLM_KVQ_FAULT"
FAULTS = ("clobber_cache",)


def install(name: str) -> None:
    if name not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={name!r} is not a fault; allowed: {', '.join(FAULTS)}")
    from vllm_kvq.ops import LayerOps

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
