"""Decode attention on CPU: vllm-kvq formats vs our bf16 vs vLLM's own CPU attention.

Seeded; every sequence decodes one token at position ctx-1 of a paged cache (block size
128, shuffled block tables, distinct blocks per sequence). Per row: ms per call (median),
effective GB/s of KV bytes read (pages incl. scales; min over repeats), speed ratio vs our bf16 and vs vLLM's
bf16 kernel (torch.ops._C.cpu_attention_with_kv_cache) on the same shape in the same run.

  python benchmarks/bench_cpu_attention.py [--quick] [--threads N] [--formats bf16,kivi2]
      [--shapes 32/8/128,9/3/64] [--batches 4,16] [--contexts 512,32768] [--huge-pages]

nuq formats (e.g. --formats nuq3,int4_token_o1) run with the uniform codebook: the speed of
a codebook does not depend on its levels.
"""
from __future__ import annotations

import argparse
import os

# Waiting OpenMP threads sleep instead of spinning, so process CPU time is the work done:
# on a shared machine the CPU-time columns are the robust ones (wall time then includes
# waiting for a descheduled thread at every barrier).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from vllm_kvq import hugepages, ops
from vllm_kvq.formats import parse_format
from vllm_kvq.tools import kernel_timing
from vllm_kvq.tools.kernel_timing import (BASE_TOKENS, decode_case, timeit, vllm_available,
                                           vllm_decode_case, vllm_isa)

SHAPES = [(32, 8, 128), (9, 3, 64)]  # (query heads, kv heads, head_dim); 9/3/64 = SmolLM2
BATCHES = [1, 4, 16]
CONTEXTS = [1024, 4096, 16384]
FORMATS = ["bf16", "fp8_e4m3", "int8_token", "int4_group32", "kivi4", "kivi2"]


def bench_ours(name, Hq, H, D, batch, ctx, gen, q, k, v):
    fmt, lay, run, out = decode_case(name, H, D, batch, ctx, gen, q, k, v)
    ms = timeit(run)
    nbytes = batch * H * ctx * lay.token_bytes
    return ms, nbytes, out.clone()


def bench_vllm(Hq, H, D, batch, ctx, gen, q, k, v):
    run, out, nbytes = vllm_decode_case(Hq, H, D, batch, ctx, gen, q, k, v)
    return timeit(run), nbytes, out.clone()


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
    ap.add_argument("--huge-pages", action="store_true",
                    help="both sides' caches on transparent huge pages (what an engine served "
                         "by vllm-kvq gets; vllm_kvq.hugepages); default: as allocated")
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
    have_vllm = not args.no_vllm and vllm_available()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"vllm-kvq SIMD path {ops.simd_path()}, vLLM CPU attention: "
          f"{'isa ' + vllm_isa() if have_vllm else 'not available'}, caches on "
          f"{'huge pages' if args.huge_pages else 'pages as allocated'} (THP mode "
          f"{hugepages.thp_mode() or 'none'})")
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
                rows = []
                vllm_ms = vllm_out = None
                if have_vllm:
                    # same block tables (same seed) and same K/V as our runs
                    vllm_ms, nb, vllm_out = bench_vllm(Hq, H, D, batch, ctx,
                                                       torch.Generator().manual_seed(7), q, k, v)
                    rows.append(("vLLM bf16", vllm_ms, nb))
                ours_bf16 = None
                for name in formats:
                    ms, nb, out = bench_ours(name, Hq, H, D, batch, ctx,
                                             torch.Generator().manual_seed(7), q, k, v)
                    if name == "bf16":
                        ours_bf16 = ms
                        if vllm_out is not None:  # same data: the two bf16 kernels agree
                            diff = (out.float() - vllm_out.float()).abs().max().item()
                            assert diff < 2e-2, f"our bf16 vs vLLM bf16 differ by {diff}"
                    rows.append((name, ms, nb))
                for name, (ms, cms), nb in rows:
                    r1 = f"{ours_bf16[0] / ms:10.2f}" if ours_bf16 else f"{'-':>10}"
                    r2 = f"{vllm_ms[0] / ms:11.2f}" if vllm_ms else f"{'-':>11}"
                    c1 = f"{ours_bf16[1] / cms:10.2f}" if ours_bf16 else f"{'-':>10}"
                    c2 = f"{vllm_ms[1] / cms:10.2f}" if vllm_ms else f"{'-':>10}"
                    print(f"{f'{Hq}/{H}/{D}':>10} {batch:>5} {ctx:>6} {name:>14} {ms:9.3f} "
                          f"{nb / ms / 1e6:7.1f} {r1} {r2} {cms:9.3f} {c1} {c2}", flush=True)
    print("ratios > 1: faster than the reference kernel (ms_ref / ms)")


if __name__ == "__main__":
    main()
