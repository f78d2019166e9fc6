"""The machine a comparison runs on: its description for the report, and whether vLLM's
FP8 CPU cache can start here."""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path


def cpu_has_fp8_kv() -> bool:
    """vLLM 0.32's FP8 CPU cache needs AVX-512 or AMX (checked by its worker at start)."""
    try:
        flags = re.search(r"flags\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        return True
    f = set(flags.group(1).split()) if flags else set()
    return "avx512f" in f or "amx_tile" in f


def machine_description() -> str:
    cpu, flags = platform.processor() or "cpu", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.+)", info)
        cpu = m.group(1).strip() if m else cpu
        f = re.search(r"flags\s*:\s*(.+)", info)
        flags = f.group(1).split() if f else []
        simd = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
        flags = f", {simd}" + (", AVX512-BF16" if "avx512_bf16" in flags else "")
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}{flags})"
