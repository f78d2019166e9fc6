"""Error of the int8 query (decode with int keys, csrc/cpu/attn_body.h "integer Q.K") against
the exact fp32 Q.K of the same kernel (KVQ_EXACT_QK=1): relative L2 error of each decode
row's attention output, on random K/V/queries and on captured SmolLM2-135M K/V (with random
queries: the captures hold keys and values only).

  python benchmarks/int8_query_error.py [--formats int8_token,int4_group32,kivi4]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_kernels import build_case, run_mine  # noqa: E402

FORMATS = ["int8_token", "int4_group32", "int4_token", "int2_group32", "kivi4", "kivi2"]


def rel_err(c):
    os.environ["KVQ_EXACT_QK"] = "1"
    exact = run_mine(c)
    os.environ.pop("KVQ_EXACT_QK")
    approx = run_mine(c)
    return ((approx - exact).norm(dim=-1) / exact.norm(dim=-1)).flatten()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    real = None
    try:
        from kv_capture import capture_kv
        real = capture_kv(n_windows=1, window=256, seed=5)
    except Exception as e:  # noqa: BLE001
        print(f"(no captured K/V: {e})")
    print(f"{'format':>22} {'data':>12} {'rows':>5} {'mean rel':>9} {'max rel':>9}")
    for name in args.formats.split(","):
        seqs = [(256, 1)] * 8
        cases = [("random", build_case(name, 64, 128, gq=3, H=3, dtype=torch.float32,
                                       seqs=seqs, seed=s)) for s in range(2)]
        if real is not None:
            for layer in (0, 15, 29):
                K, V = real["k"][layer].float(), real["v"][layer].float()  # [256, 3, 64]
                cases.append((f"real L{layer}", build_case(
                    name, 64, 128, gq=3, H=3, dtype=torch.float32, seqs=seqs, seed=layer,
                    tokens=lambda s, L: (K[:L], V[:L]))))
        for label, c in cases:
            e = rel_err(c)
            print(f"{name:>22} {label:>12} {e.numel():>5} {e.mean():9.2e} {e.max():9.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
