"""Transparent huge pages for the KV cache on the CPU (Linux).

vLLM 0.32 allocates every layer's KV cache as views of one zeroed buffer in which block b of
layer l sits at b * block_stride + l * layer_stride: a decode step reads each sequence's
blocks of one layer scattered over the whole buffer, a few 4 KiB pages per block, so the
kernels take TLB misses at block switches (perf: the next tile's prefetch instructions
stall). Where transparent huge pages are in `madvise` mode (Ubuntu's default, and this
project's test machines'), that buffer stays on 4 KiB pages. `advise_huge_pages` marks it
MADV_HUGEPAGE and drops its (all-zero, not yet used) pages with MADV_DONTNEED, so each
2 MiB is faulted back as one huge page on first write.

Measured (benchmarks/bench_huge_pages.py: a decode step's 30 attention calls over that
layout, 4 KiB vs huge pages alternating, 2-core Zen 4, 9/3/64;
reports/e2e-speed/zen4-avx512/huge-pages-session41.txt): our kernels 1.02-1.13x faster (16 x
1024 tokens: int8_token 12.5 -> 11.3 ms, int4_group32 12.2 -> 11.4; 4 x 8192: bf16 33.4 ->
30.5), vLLM's own op 1.02-1.08x on the same buffers (its engines keep 4 KiB pages:
the plugin leaves vLLM's backend as it is unless KVQ_HUGE_PAGES=all; THP `always` gives
both huge pages).

Only for a buffer nothing has been written to: the plugin calls it right after vLLM
allocated the cache, before any step. KVQ_HUGE_PAGES=0 turns it off (A/B runs); =all also
gives it to engines on vLLM's own backend (like-for-like comparisons: the default leaves
vLLM's backend as vLLM allocates it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MODES = ("0", "1", "all")
MODE = os.environ.get("KVQ_HUGE_PAGES", "1")
if MODE not in MODES:
    raise ValueError(f"KVQ_HUGE_PAGES={MODE!r}; allowed: {', '.join(MODES)} (0: off, 1: the "
                     f"KV cache of engines served by vllm-kvq, all: every engine's)")
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" where
    there is none (not Linux, no THP)."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _private_anonymous(start: int, end: int) -> bool:
    """Whether [start, end) is covered by private anonymous mappings of this process (where
    MADV_DONTNEED means: read back as zeros). One allocation may span several mappings
    (e.g. vLLM's NUMA memory binding splits them)."""
    covered = start
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi <= covered or lo >= end:
                    continue
                # unnamed, "[anon:...]" or glibc's "[heap]" (a buffer below its mmap
                # threshold): private anonymous memory all
                anonymous = fields[4] == "0" and (len(fields) == 5 or fields[5] == "[heap]"
                                                  or fields[5].startswith("[anon"))
                if lo > covered or not fields[1].endswith("p") or not anonymous:
                    return False
                covered = hi
                if covered >= end:
                    return True
    except (OSError, ValueError, IndexError):
        pass
    return False


def wanted(served_by_kvq: bool) -> bool:
    """Whether an engine's KV cache goes on huge pages (KVQ_HUGE_PAGES)."""
    return MODE == "all" or (MODE == "1" and served_by_kvq)


def advise_huge_pages(buffers: list[torch.Tensor]) -> int:
    """Back the whole 2 MiB pages inside each (zero-filled, unused) CPU buffer with huge
    pages on first touch; returns the bytes advised (0 where nothing applies: off, no THP
    madvise mode, not Linux, not private anonymous memory)."""
    if MODE == "0" or not sys.platform.startswith("linux") or thp_mode() != "madvise":
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done, seen = 0, set()
    for t in buffers:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in seen:
            continue
        seen.add(ptr)
        start = (ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end <= start or not _private_anonymous(start, end):
            continue
        if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
            continue
        if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            done += end - start
    return done
