"""The residual window's per-layer staging op (torch.ops.vllm_kvq.stage_window), 16-bit and
8-bit (_w8) windows side by side in one run.

A decode step of S sequences, each with G of its window's rows gathered into staging, its
new token appended and kept (what csrc/cpu/window_stage.cpp does per layer and step:
memory-bound copies, plus the int8 row codecs for _w8), read from a rotation of pools so
that every call starts from cold rows as in a served step; and a prefill chunk of N new
tokens staged and kept (the 8-bit window quantizes every one). Prints microseconds per call
and the staging bytes each call writes.

    python benchmarks/bench_window_stage.py [--seqs 16] [--rows 64,124] [--chunk 2048]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import vllm_kvq._C  # noqa: F401  -- registers torch.ops.vllm_kvq
from vllm_kvq.residual import quantize_window_rows

H, D = 3, 64            # SmolLM2's kv heads and head size
ROWS_PER_BLOCK = 128    # window rows one pool block holds here (fits either window form)
POOLS = 24              # pools cycled through: each call reads rows no earlier call touched


def pools(bits: int, blocks: int) -> list[torch.Tensor]:
    def one():
        x = torch.randn(blocks, ROWS_PER_BLOCK, 2, H, D)
        return quantize_window_rows(x) if bits == 8 else x.to(torch.bfloat16)
    return [one() for _ in range(POOLS)]


def plan(seqs: int, gathered: int, new: int):
    """Index tensors of one call: per sequence `gathered` window rows, then `new` tokens,
    the last of which is kept in the window (sequence s owns pool block s)."""
    gather, new_rows, keep = [], [], []   # (staging row, block, window row) / (row, token)
    row = 0
    for s in range(seqs):
        gather += [(row + j, s, j) for j in range(gathered)]
        row += gathered
        new_rows += [(row + i, s * new + i) for i in range(new)]
        row += new
        keep.append((row - 1, s, gathered % ROWS_PER_BLOCK))
    def columns(entries, n):
        return [torch.tensor([e[i] for e in entries], dtype=torch.int64) for i in range(n)]
    return row, columns(gather, 3) + columns(new_rows, 2) + columns(keep, 3)


def time_call(bits: int, seqs: int, gathered: int, new: int, secs: float) -> tuple[float, int]:
    rows, idx = plan(seqs, gathered, new)
    ps = pools(bits, max(seqs, 1))
    key = torch.randn(seqs * new, H, D).to(torch.bfloat16)
    value = torch.randn(seqs * new, H, D).to(torch.bfloat16)
    op = torch.ops.vllm_kvq.stage_window

    def call(i):
        st = torch.empty(2, rows, H, D, dtype=torch.bfloat16)
        op(st, key, value, ps[i % POOLS], *idx)

    for i in range(POOLS):
        call(i)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        call(n)
        n += 1
    return (time.perf_counter() - t0) / n * 1e6, rows * 2 * H * D * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16, help="sequences of a decode step")
    ap.add_argument("--rows", default="64,124",
                    help="window rows gathered per sequence (kivi2 at 128: 64 on average)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens (0: none)")
    ap.add_argument("--secs", type=float, default=2.0, help="timed seconds per case")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    simd = os.environ.get("KVQ_SIMD", "best")
    print(f"stage_window, {H} kv heads x head_dim {D}, bf16 staging, threads "
          f"{torch.get_num_threads()}, KVQ_SIMD={simd}")
    print(f"{'case':>34}  {'16-bit us':>10}  {'8-bit us':>10}  {'8 / 16':>7}  {'staging KB':>10}")
    cases = [(f"decode {args.seqs} seqs x {g} rows", args.seqs, g, 1)
             for g in (int(x) for x in args.rows.split(","))]
    if args.chunk:
        cases.append((f"prefill chunk of {args.chunk} tokens", 1, 0, args.chunk))
    for label, seqs, gathered, new in cases:
        t16, nbytes = time_call(16, seqs, gathered, new, args.secs)
        t8, _ = time_call(8, seqs, gathered, new, args.secs)
        print(f"{label:>34}  {t16:10.1f}  {t8:10.1f}  {t8 / t16:7.2f}  {nbytes / 1e3:10.0f}")


if __name__ == "__main__":
    main()
