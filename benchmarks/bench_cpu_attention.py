"""Decode attention on CPU: vllm-kvq formats vs our bf16 vs vLLM's own CPU attention.

Seeded; every sequence decodes one token at position ctx-1 of a paged cache (block size
128, shuffled block tables, distinct blocks per sequence). Per row: ms per call (the
least of --rounds timings, each taken beside a timing of vLLM's op, whose row keeps the
least of all of them), effective GB/s of KV bytes read (pages incl. scales), speed ratio vs
our bf16 and vs vLLM's bf16 kernel (torch.ops._C.cpu_attention_with_kv_cache) on the same
shape in the same run.

  python benchmarks/bench_cpu_attention.py [--quick] [--threads N] [--formats bf16,kivi2]
      [--shapes 32/8/128,9/3/64] [--batches 4,16] [--contexts 512,32768] [--huge-pages]
      [--rounds 2] [--interleave]

--interleave: every row of a cell (vLLM's op and each format) is built first and then timed
in turn, --rounds passes over all of them (shorter timings, each row keeping its least), so a
slow phase of the host lasting a minute slows every row of the cell instead of the few timed
in it (on session 45's Zen 3 VM one 512-token cell's rows drifted 30% within a run). It
holds all the cell's caches at once: at 32k tokens, batch 16, 32/8/128 ~10 GB.

nuq formats (e.g. --formats nuq3,int4_token_o1) run with the uniform codebook: the speed of
a codebook does not depend on its levels. vLLM's op is its build for our SIMD path: with
KVQ_SIMD=avx2 its AVX2 build (what an AVX2-only machine runs), else the one vLLM picks for
this CPU (--vllm-build).

OpenMP's wait policy is the environment's. Unset, it is what a served engine runs with
(vLLM's CPU worker sets none): GOMP's default, where a thread spins a while at the end of a
parallel region before it sleeps, so the next region (the next layer's op) starts at once.
With OMP_WAIT_POLICY=PASSIVE threads sleep at once: process CPU time is then the work done
and the cpu columns are printed (the robust ones on a shared machine), but every call pays
waking its threads, in wall time, tens of microseconds in a VM (a 512-token call's median
rose 1.6-2.6x here), which a served step does not.
"""
from __future__ import annotations

import argparse
import os

import torch

from vllm_kvq import hugepages, ops
from vllm_kvq.tools import kernel_timing
from vllm_kvq.tools.kernel_timing import (BASE_TOKENS, decode_case, timeit, vllm_available,
                                           vllm_decode_case, vllm_isa)

SHAPES = [(32, 8, 128), (9, 3, 64)]  # (query heads, kv heads, head_dim); 9/3/64 = SmolLM2
BATCHES = [1, 4, 16]
CONTEXTS = [1024, 4096, 16384]
FORMATS = ["bf16", "fp8_e4m3", "int8_token", "int4_group32", "kivi4", "kivi2"]


def min_times(a, b):
    """Elementwise minimum of two (wall ms, cpu ms) pairs; a may be None."""
    return b if a is None else (min(a[0], b[0]), min(a[1], b[1]))


def check_bf16(out, vllm_out):
    """Same data: our bf16 kernel and vLLM's agree."""
    if vllm_out is not None:
        diff = (out.float() - vllm_out.float()).abs().max().item()
        assert diff < 2e-2, f"our bf16 vs vLLM bf16 differ by {diff}"


def sequential_rows(formats, vllm_run, vllm_out, vllm_nb, rounds, H, D, batch, ctx, q, k, v):
    """(rows, our bf16's times, vLLM's times): one format at a time, timed `rounds` times,
    each time beside vLLM's op, whose row keeps the least of all its timings."""
    rows, ours_bf16 = [], None
    vllm_ms = timeit(vllm_run) if vllm_run is not None else None
    for name in formats:
        _, lay, run, out = decode_case(name, H, D, batch, ctx, torch.Generator().manual_seed(7),
                                       q, k, v)
        ms = None
        for _ in range(max(1, rounds)):
            ms = min_times(ms, timeit(run))
            if vllm_run is not None:
                vllm_ms = min_times(vllm_ms, timeit(vllm_run))
        if name == "bf16":
            ours_bf16 = ms
            check_bf16(out, vllm_out)
        rows.append((name, ms, batch * H * ctx * lay.token_bytes))
        del run, out  # one format's cache at a time
    if vllm_run is not None:
        rows.insert(0, ("vLLM bf16", vllm_ms, vllm_nb))
    return rows, ours_bf16, vllm_ms


def interleaved_rows(formats, vllm_run, vllm_out, vllm_nb, rounds, H, D, batch, ctx, q, k, v):
    """(rows, our bf16's times, vLLM's times): every row of a cell built, then `rounds`
    passes timing each in turn (timeit's min_time / 4 each), each row keeping its least."""
    cases = []
    if vllm_run is not None:
        vllm_run()  # its output, for check_bf16
        cases.append(("vLLM bf16", vllm_run, vllm_nb))
    for name in formats:
        _, lay, run, out = decode_case(name, H, D, batch, ctx, torch.Generator().manual_seed(7),
                                       q, k, v)
        run()
        if name == "bf16":
            check_bf16(out, vllm_out)
        cases.append((name, run, batch * H * ctx * lay.token_bytes))
    best = {name: None for name, _, _ in cases}
    for _ in range(max(1, rounds)):
        for name, run, _ in cases:
            best[name] = min_times(best[name], timeit(run, min_time=0.1))
    rows = [(name, best[name], nb) for name, _, nb in cases]
    return rows, best.get("bf16"), best.get("vLLM bf16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1/4, context 1k/4k only")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=None,
                    help="Hq/H/D list, e.g. 32/8/128,9/3/64 (default: both)")
    ap.add_argument("--batches", default=None, help="e.g. 4,16 (default 1,4,16)")
    ap.add_argument("--contexts", default=None,
                    help="e.g. 512,32768 (default 1024,4096,16384)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-build", choices=["auto", "avx2"], default=None,
                    help="vLLM's CPU ops to compare with: auto (the build vLLM picks for this "
                         "CPU) or avx2 (its AVX2 build, what an AVX2-only machine runs); "
                         "default: avx2 when our SIMD path is avx2 (KVQ_SIMD=avx2), else auto")
    ap.add_argument("--huge-pages", action="store_true",
                    help="both sides' caches on transparent huge pages (what an engine served "
                         "by vllm-kvq gets; vllm_kvq.hugepages); default: as allocated")
    ap.add_argument("--rounds", type=int, default=None,
                    help="times each format is timed (default 2), each time beside vLLM's "
                         "op (a row keeps its minimum): a phase of host noise then slows both "
                         "rows instead of one")
    ap.add_argument("--interleave", action="store_true",
                    help="build every row of a cell first, then time them in turn, --rounds "
                         "passes (default 8 then) of shorter timings: robust to a drifting host, "
                         "holds all of a cell's caches at once")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch/OpenMP threads (0: torch's default); on a shared or oversubscribed "
                         "machine 1 thread gives the stablest numbers")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel_timing.HUGE_PAGES = args.huge_pages
    formats = args.formats.split(",")
    batches, contexts = (BATCHES[:2], CONTEXTS[:2]) if args.quick else (BATCHES, CONTEXTS)
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(y) for y in x.split("/")) for x in args.shapes.split(",")]
    build = args.vllm_build or ("avx2" if ops.simd_path() == "avx2" else "auto")
    have_vllm = not args.no_vllm and vllm_available(build)
    # spinning threads' time is not work (and the VM accounts it to the process late)
    cpu_cols = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"vllm-kvq SIMD path {ops.simd_path()}, vLLM CPU attention: "
          f"{f'isa {vllm_isa()}, build {build}' if have_vllm else 'not available'}, caches on "
          f"{'huge pages' if args.huge_pages else 'pages as allocated'} (THP mode "
          f"{hugepages.thp_mode() or 'none'}), OpenMP wait policy "
          f"{os.environ.get('OMP_WAIT_POLICY') or 'unset (as served)'}")
    hdr = (f"{'Hq/H/D':>10} {'batch':>5} {'ctx':>6} {'format':>14} {'ms':>9} {'GB/s':>7} "
           f"{'x our bf16':>10} {'x vLLM bf16':>11} {'cpu ms':>9} {'cpu x bf16':>10} "
           f"{'cpu x vLLM':>10}")
    print(hdr)
    print("-" * len(hdr))
    for Hq, H, D in shapes:
        for batch in batches:
            for ctx in contexts:
                gen = torch.Generator().manual_seed(1000 * batch + ctx + D)
                q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16)
                k = torch.randn(BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
                v = torch.randn(BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
                vllm_out = vllm_run = None
                vllm_nb = 0
                if have_vllm:
                    # same block tables (same seed) and same K/V as our runs
                    vllm_run, vllm_out, vllm_nb = vllm_decode_case(
                        Hq, H, D, batch, ctx, torch.Generator().manual_seed(7), q, k, v)
                timed = interleaved_rows if args.interleave else sequential_rows
                rows, ours_bf16, vllm_ms = timed(
                    formats, vllm_run, vllm_out, vllm_nb,
                    args.rounds or (8 if args.interleave else 2), H, D, batch, ctx, q, k, v)
                del vllm_run
                for name, (ms, cms), nb in rows:
                    r1 = f"{ours_bf16[0] / ms:10.2f}" if ours_bf16 else f"{'-':>10}"
                    r2 = f"{vllm_ms[0] / ms:11.2f}" if vllm_ms else f"{'-':>11}"
                    c0 = f"{cms:9.3f}" if cpu_cols else f"{'-':>9}"
                    c1 = f"{ours_bf16[1] / cms:10.2f}" if ours_bf16 and cpu_cols else f"{'-':>10}"
                    c2 = f"{vllm_ms[1] / cms:10.2f}" if vllm_ms and cpu_cols else f"{'-':>10}"
                    print(f"{f'{Hq}/{H}/{D}':>10} {batch:>5} {ctx:>6} {name:>14} {ms:9.3f} "
                          f"{nb / ms / 1e6:7.1f} {r1} {r2} {c0} {c1} {c2}", flush=True)
    print("ratios > 1: faster than the reference kernel (ms_ref / ms)")


if __name__ == "__main__":
    main()
