"""Test cases for the paged-attention kernels, shared by tests/test_cuda_emulated.py and
scripts/gpu_check.py: one mixed batch (decodes, prefills, chunked prefills) of random
K/V written into shuffled pages by the reference, garbage in every other byte, the
residual window's recent tokens in the staging tensors, and the reference's output."""
from __future__ import annotations

import math

import torch

from vllm_kvq import reference as ref


def static_scales(fmt, H: int, seed: int) -> list[torch.Tensor]:
    """Per kv head (k_scale, v_scale): random for per-head static scales, 0.05 for static
    per-tensor int, else ones (the kernels read them only for static-scale codecs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in (fmt.key, fmt.value):
        if c.granularity == "head":
            out.append(torch.rand(H, generator=g) * 0.2 + 0.02)
        elif c.granularity == "tensor" and c.encoding == "int":
            out.append(torch.full((H,), 0.05))
        else:
            out.append(torch.ones(H))
    return out


def nonuniform_codebooks(fmt) -> tuple:
    """(k_levels, v_levels) for a format's nuq sides (None for the others): non-uniform
    ascending levels in [-1, 1], |u|^1.6 of a uniform grid u, so that reading the pages
    with the uniform grid instead would show."""
    def levels(c):
        if c.encoding != "nuq":
            return None
        u = torch.linspace(-1, 1, 2 ** c.bits)
        return (u.sign() * u.abs() ** 1.6).contiguous()
    return levels(fmt.key), levels(fmt.value)


def attention_case(fmt, D: int, Hq: int, H: int, B: int, qlens: list[int], ctx: list[int],
                   dtype, seed: int, spare_blocks: int = 3, *, scales=None,
                   levels=(None, None), tokens=None, extra_rows: int = 0,
                   unused_block: int = 0, expected: bool = True, window: int = 0,
                   null_block: int = 0, soft_cap: float = 0.0) -> dict:
    """CPU tensors of one batch: sequence s has ctx[s] tokens before its qlens[s] query
    tokens. Keys: the paged_attention arguments (q, cache, bt, sl, qsl, sk, sv, ssl, sp0, R,
    scale), the layout `lay`, static scales `ks`, `vs`, codebooks `kl`, `vl` and (expected=
    True) the reference's output `expected` (float32).

    scales: (ks, vs) per-head static scales (default static_scales(fmt, H, seed)); levels:
    (k_levels, v_levels) of nuq codecs; tokens(s, L) -> (k, v) [L, H, D] replaces sequence
    s's generated K/V; extra_rows: query rows past the batch's last (kernels must leave
    their output alone); unused_block: block-table entry of every unused column (one more
    column than the longest sequence needs), e.g. a block far past the cache; window: a
    sliding window (blocks wholly before every query's window become `null_block`, a block
    holding other data, as vLLM puts its null block there); soft_cap: the logit soft-cap
    (0: none)."""
    g = torch.Generator().manual_seed(seed)
    ks, vs = scales if scales is not None else static_scales(fmt, H, seed)
    kref = ks if fmt.key.static_scale else None
    vref = vs if fmt.value.static_scale else None
    kl, vl = levels
    lay = fmt.layout(D, B)
    R = fmt.residual_chunk
    S = len(qlens)
    L = [c + q for c, q in zip(ctx, qlens)]
    nblk = [(x + B - 1) // B for x in L]
    nb = sum(nblk) + spare_blocks
    cache = torch.randint(0, 256, (nb, H, B, lay.token_bytes), dtype=torch.uint8, generator=g)
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((S, max(nblk) + 1), unused_block, dtype=torch.int32)
    used = 0
    Ks, Vs = [], []
    for s in range(S):
        bt[s, :nblk[s]] = perm[used:used + nblk[s]].to(torch.int32)
        used += nblk[s]
        if tokens is None:
            k = torch.randn(L[s], H, D, generator=g) * 1.5
            v = torch.randn(L[s], H, D, generator=g)
        else:
            k, v = tokens(s, L[s])
        k, v = k.to(dtype), v.to(dtype)
        Ks.append(k)
        Vs.append(v)
        Fw = L[s] // R * R  # whole residual chunks are in the pages
        if Fw:
            pos = torch.arange(Fw)
            slots = bt[s, pos // B].to(torch.int64) * B + pos % B
            ref.write_cache(k[:Fw], v[:Fw], cache, slots, fmt, lay, kref, vref, kl, vl)
    st_k, st_v, ssl, sp0 = [], [], [0], []
    for s in range(S):
        # the staging rows: positions from F(first query) = floor((first + 1) / R) * R
        pos0 = min((L[s] - qlens[s] + 1) // R * R, L[s]) if R > 1 else L[s]
        sp0.append(pos0)
        st_k.append(Ks[s][pos0:])
        st_v.append(Vs[s][pos0:])
        ssl.append(ssl[-1] + L[s] - pos0)
    sk = torch.cat(st_k) if R > 1 else torch.zeros(0, H, D, dtype=dtype)
    sv = torch.cat(st_v) if R > 1 else torch.zeros(0, H, D, dtype=dtype)
    q = torch.randn(sum(qlens) + extra_rows, Hq, D, generator=g).to(dtype)
    qsl = torch.tensor([0] + [int(x) for x in torch.tensor(qlens).cumsum(0)], dtype=torch.int32)
    case = dict(q=q, cache=cache, bt=bt, sl=torch.tensor(L, dtype=torch.int32), qsl=qsl,
                sk=sk, sv=sv, ssl=torch.tensor(ssl, dtype=torch.int32),
                sp0=torch.tensor(sp0, dtype=torch.int32), R=R, scale=1.0 / math.sqrt(D),
                lay=lay, ks=ks, vs=vs, kl=kl, vl=vl, window=window, soft_cap=soft_cap)
    if window:
        for s in range(S):
            bt[s, :max(0, L[s] - qlens[s] - window + 1) // B] = null_block
    if expected:
        case["expected"] = ref.paged_attention(q, cache, bt, case["sl"], qsl, fmt, lay,
                                               case["scale"], kref, vref, sk, sv, case["ssl"],
                                               case["sp0"], kl, vl, window, soft_cap).float()
    return case
