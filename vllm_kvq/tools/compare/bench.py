"""The attention kernel alone (`python -m vllm_kvq.tools.compare kernel SPEC OUT`, its own
process): decode attention through our kernel and vLLM's bf16 CPU op on the same data,
timed by vllm_kvq.tools.kernel_timing."""
from __future__ import annotations

from vllm_kvq.tools import kernel_timing as timing
from vllm_kvq.tools.compare.children import progress


def run_kernel_bench(spec: dict) -> dict:
    """Decode attention alone on the model's shape: each format through our kernel and vLLM's
    bf16 CPU attention op on the same queries, K/V and block tables (seeded)."""
    import torch

    from vllm_kvq import ops

    Hq, H, D = spec["shape"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    have_vllm = timing.vllm_available()
    rows = []
    for batch in spec["batches"]:
        for ctx in spec["contexts"]:
            progress(f"kernel batch {batch} ctx {ctx}")
            gen = torch.Generator().manual_seed(1000 * batch + ctx + D)
            q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16)
            k = torch.randn(timing.BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
            v = torch.randn(timing.BASE_TOKENS, H, D, generator=gen).to(torch.bfloat16)
            row = {"batch": batch, "context": ctx, "ms": {}}
            if have_vllm:
                row["ms"]["vllm"] = timing.time_vllm(Hq, H, D, batch, ctx,
                                                     torch.Generator().manual_seed(7), q, k, v)
            for name in spec["formats"]:
                row["ms"][name] = timing.time_ours(name, Hq, H, D, batch, ctx,
                                                   torch.Generator().manual_seed(7), q, k, v)
            rows.append(row)
    return {"shape": list(spec["shape"]), "threads": torch.get_num_threads(),
            "simd_path": ops.simd_path(), "vllm_op": have_vllm, "rows": rows}
