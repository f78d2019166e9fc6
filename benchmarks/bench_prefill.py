"""Prefill attention per layer call on CPU: the paged kernel vs the flash prefill path
(vllm_kvq.prefill) vs vLLM's own CPU attention (torch.ops._C.cpu_attention_with_kv_cache).

Seeded; the whole prompt of every sequence is in this step (chunked prefill with context:
--ctx). Per row: wall ms and process CPU ms per call (min over repeats) of the old kernel
(LayerOps.attend without a split), the new path (with the Builder's split) and vLLM's op on
the same shape in the same run (vLLM: bf16 cache; for fp32 queries its fp32 cache).

  python benchmarks/bench_prefill.py [--formats bf16,int4_group32,kivi2] [--dtypes bf16,fp32]
      [--cases 2x2048,1x4096] [--ctx 0] [--threshold]

--threshold: query tokens per sequence (16..256) after a 2048-token context, both paths,
to place prefill.PREFILL_MIN_QUERY.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


from vllm_kvq import ops, prefill  # noqa: E402
from vllm_kvq.formats import parse_format  # noqa: E402
from vllm_kvq.reference import uniform_codebooks  # noqa: E402
from vllm_kvq.tools.kernel_timing import timeit, vllm_available, vllm_isa  # noqa: E402

BLOCK = 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def setup(name, Hq, H, D, batch, ctx, n, dtype, gen):
    """LayerOps, the attend arguments (positional) and the split of one batch."""
    fmt = parse_format(name)
    R = fmt.residual_chunk
    L = ctx + n
    nblk = (L + BLOCK - 1) // BLOCK
    lay = fmt.layout(D, BLOCK)
    cache = torch.zeros(batch * nblk, H, BLOCK, lay.token_bytes, dtype=torch.uint8)
    bt = torch.randperm(batch * nblk, generator=gen).to(torch.int32).reshape(batch, nblk)
    lv = uniform_codebooks(fmt)
    static = {f"{s}_scale": 0.05 for s, c in (("k", fmt.key), ("v", fmt.value))
              if c.static_scale and c.encoding == "int"}
    lops = ops.LayerOps(fmt, H, D, torch.device("cpu"), **static, **lv)
    k = torch.randn(batch, L, H, D, generator=gen).to(dtype)
    v = torch.randn(batch, L, H, D, generator=gen).to(dtype)
    Lw = L // R * R
    for s in range(batch):
        slots = (bt[s].long().repeat_interleave(BLOCK) * BLOCK +
                 torch.arange(BLOCK).repeat(nblk))[:Lw]
        lops.write(k[s, :Lw], v[s, :Lw], cache, slots)
    q = torch.randn(batch * n, Hq, D, generator=gen).to(dtype)
    sl = torch.full((batch,), L, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * n
    staging = ()
    st_list = (None, None)
    if R > 1:
        pos0 = (ctx + 1) // R * R
        sk = torch.cat([k[s, pos0:] for s in range(batch)])
        sv = torch.cat([v[s, pos0:] for s in range(batch)])
        ssl = torch.arange(batch + 1, dtype=torch.int32) * (L - pos0)
        sp0 = torch.full((batch,), pos0, dtype=torch.int32)
        staging = (sk, sv, ssl, sp0)
        st_list = (ssl.tolist(), sp0.tolist())
    args = (q, cache, bt, sl, qsl, D ** -0.5, torch.empty_like(q), *staging)
    return lops, args, (qsl.tolist(), sl.tolist()) + st_list


def bench_vllm(Hq, H, D, batch, ctx, n, dtype, gen):
    isa = vllm_isa() if dtype == torch.bfloat16 else "vec"
    L = ctx + n
    nblk = (L + BLOCK - 1) // BLOCK
    total = batch * nblk
    kv = torch.randn(total, H, BLOCK, 2 * D, generator=gen).to(dtype)
    kc, vc = kv.view(total, H, 2 * BLOCK, D).chunk(2, dim=2)
    bt = torch.randperm(total, generator=gen).to(torch.int32).reshape(batch, nblk)
    sl = torch.full((batch,), L, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * n
    meta = torch.ops._C.get_scheduler_metadata(batch, Hq, H, D, sl, dtype, qsl, True, -1, isa,
                                               True, None, "auto")
    q = torch.randn(batch * n, Hq, D, generator=gen).to(dtype)
    out = torch.empty_like(q)
    return timeit(lambda: torch.ops._C.cpu_attention_with_kv_cache(
        q, kc, vc, out, qsl, sl, D ** -0.5, True, None, -1, bt, 0.0, meta, None, None, 1.0, 1.0,
        "auto"))


def both(name, Hq, H, D, batch, ctx, n, dtype, min_query=prefill.PREFILL_MIN_QUERY):
    gen = torch.Generator().manual_seed(1)
    lops, args, lists = setup(name, Hq, H, D, batch, ctx, n, dtype, gen)
    split = prefill.plan(*lists, min_query=min_query)
    old = timeit(lambda: lops.attend(*args))
    ref = args[6].clone()
    new = timeit(lambda: lops.attend(*args, split=split))
    err = (args[6].float() - ref.float()).abs().max().item()
    return old, new, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,int4_group32,kivi2")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--cases", default="2x2048,1x4096", help="BATCHxQUERY_TOKENS list")
    ap.add_argument("--ctx", type=int, default=0, help="context tokens before the chunk")
    ap.add_argument("--shape", default="9/3/64", help="Hq/H/D (SmolLM2-135M)")
    ap.add_argument("--threshold", action="store_true")
    args = ap.parse_args()
    Hq, H, D = (int(x) for x in args.shape.split("/"))
    have_vllm = vllm_available()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, SIMD "
          f"{ops.simd_path()}, vLLM: {'isa ' + vllm_isa() if have_vllm else 'n/a'}; "
          f"shape {Hq}/{H}/{D}, ctx {args.ctx}; shared machine: wall times are noisy, "
          f"CPU ms are the robust column")
    if args.threshold:
        print(f"{'format':>13} {'dtype':>5} {'ctx':>5} {'q/seq':>5} {'old ms':>8} {'new ms':>8} "
              f"{'old cpu':>8} {'new cpu':>8} {'new/old':>7}")
        for name in args.formats.split(","):
            for dn in args.dtypes.split(","):
                for n in (16, 32, 64, 128, 256):
                    old, new, _ = both(name, Hq, H, D, 2, 2048, n, DTYPES[dn], min_query=1)
                    print(f"{name:>13} {dn:>5} {2048:>5} {n:>5} {old[0]:8.2f} {new[0]:8.2f} "
                          f"{old[1]:8.2f} {new[1]:8.2f} {new[1] / old[1]:7.2f}")
        return
    print(f"{'case':>7} {'dtype':>5} {'format':>13} {'old ms':>8} {'new ms':>8} {'vLLM ms':>8} "
          f"{'old cpu':>8} {'new cpu':>8} {'vLLM cpu':>8} {'new/old':>7} {'new/vLLM':>8} "
          f"{'|new-old|':>9}")
    for case in args.cases.split(","):
        batch, n = (int(x) for x in case.split("x"))
        for dn in args.dtypes.split(","):
            dtype = DTYPES[dn]
            vl = (bench_vllm(Hq, H, D, batch, args.ctx, n, dtype, torch.Generator().manual_seed(2))
                  if have_vllm else (float("nan"),) * 2)
            for name in args.formats.split(","):
                old, new, err = both(name, Hq, H, D, batch, args.ctx, n, dtype)
                print(f"{case:>7} {dn:>5} {name:>13} {old[0]:8.1f} {new[0]:8.1f} {vl[0]:8.1f} "
                      f"{old[1]:8.1f} {new[1]:8.1f} {vl[1]:8.1f} {new[1] / old[1]:7.2f} "
                      f"{new[1] / vl[1]:8.2f} {err:9.2e}")


if __name__ == "__main__":
    main()
