"""The prefill path: a long query chunk attends through torch's CPU flash attention.

Semantics are reference.paged_attention's: a query at position p reads positions
< F(p) = floor((p+1)/R)*R from the quantized pages and [F(p), p] from the full-precision
staging rows (R = fmt.residual_chunk; with R == 1 everything comes from the pages, and the
chunk's own tokens are already written there when attend runs).

Per prefill sequence: its pages [0, F(L-1)) are dequantized ONCE (torch.ops.vllm_kvq.
dequantize_pages: the kernel's fp32 values rounded to the query dtype) into [1, H, Lp, D];
then
  * R == 1 and no context: one causal flash call;
  * otherwise the queries go in tiles of T positions (tile edges where (p+1) % T == 0, T a
    multiple of R, so F(p) is constant over every run of R queries), two flash calls per tile:
      A  pages [0, A) with no mask (A = Fa = F(first position of the tile), or one less when
         that would leave the first row nothing in B; every row sees them),
      B  pages [A, Fb) then staging [Fa, last] in one key tensor, with a mask: a page
         position j is seen iff j < F(p), a staging position iff F(p) <= j <= p. Every row
         sees at least one key in B (position p, from the pages or staging);
    merged with their logsumexps (out = oa + (ob - oa) * sigmoid(lse_b - lse_a), one lerp
    into out). With R > 1 the staging rows are copied behind the pages and every tile's B
    keys gathered once per sequence (one index_select): few big ops, each of which is an
    OpenMP region. B's masks and that index depend only on positions and R: they are made
    once per step and shared by all layers (Split.masks).
GQA: flash attention takes H kv heads for Hq query heads directly.

Decode rows and short chunks stay on the paged kernel: the Builder sets vLLM's
reorder_batch_threshold = PREFILL_MIN_QUERY - 1, so such sequences come first and `plan`
splits the batch at the first longer one (any sequence after it also takes this path, which
is correct for every query length).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Query tokens per sequence from which the flash path is used. Measured (bench_prefill.py
# --threshold, SmolLM2 9/3/64, bf16, 2048 context, CPU ms new/old): bf16 16: 1.49, 32: 0.67,
# 64: 0.39; kivi2 16: 1.81, 32: 1.19, 64: 0.53 -- 64 wins for every format measured.
PREFILL_MIN_QUERY = 64
# On by default; KVQ_FLASH_PREFILL=0 sends every prefill row to the paged kernel (for A/B
# runs). Read once per process. Measured end to end (benchmarks/bench_e2e_decode.py, 4 x 2048
# tokens, bf16 model, AVX-512, 2 cores), prefill time x vLLM's own backend, off -> on: bf16
# 0.54 -> 0.95, int4_group32 0.66 -> 0.99, kivi2 0.54 -> 0.76, nuq3 0.44 -> 0.68.
FLASH_PREFILL = os.environ.get("KVQ_FLASH_PREFILL", "1") != "0"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class PrefillSeq:
    s: int        # sequence index in the batch
    q0: int       # its query rows [q0, q1)
    q1: int
    L: int        # seq_len (incl. this step's tokens)
    st0: int = 0  # staging row of position pos0 (R > 1)
    pos0: int = 0


@dataclass
class Split:
    """A step's batch split: sequences [0, num_decodes) (rows [0, num_decode_tokens)) go to
    the paged kernel, `prefills` to the flash path. Built on the host once per step."""
    num_decodes: int
    num_decode_tokens: int
    prefills: list[PrefillSeq]
    masks: dict = field(default_factory=dict)  # B's masks, shared by the step's layers


def plan(query_start_loc: list[int], seq_lens: list[int], staging_start: list[int] | None = None,
         staging_pos0: list[int] | None = None,
         min_query: int = PREFILL_MIN_QUERY) -> Split | None:
    """Split at the first sequence with >= min_query query tokens; None: no such sequence."""
    S = len(seq_lens)
    nd = next((s for s in range(S) if query_start_loc[s + 1] - query_start_loc[s] >= min_query),
              S)
    if nd == S:
        return None
    pre = [PrefillSeq(s, query_start_loc[s], query_start_loc[s + 1], seq_lens[s],
                      staging_start[s] if staging_start else 0,
                      staging_pos0[s] if staging_pos0 else 0)
           for s in range(nd, S) if query_start_loc[s + 1] > query_start_loc[s]]
    return Split(nd, query_start_loc[nd], pre)


def _tile(R: int) -> int:
    return max(R, 256)


def _edges(p_first: int, p_last: int, R: int) -> tuple[int, int, int]:
    """(A, Fa, Fb) of a tile: call A reads pages [0, A), call B pages [A, Fb) and staging
    [Fa, p_last]. A = Fa = F(p_first), except when the first row's staging range is empty
    (F(p_first) = p_first + 1): then A = p_first, so that B holds a key of every row."""
    Fa, Fb = (p_first + 1) // R * R, (p_last + 1) // R * R
    return (p_first if Fa == p_first + 1 else Fa), Fa, Fb


def _tiles(ctx: int, L: int, R: int, T: int) -> list[tuple[int, int, int, int, int]]:
    """(first, last position, A, Fa, Fb) of the tiles of positions [ctx, L)."""
    out, pa = [], ctx
    while pa < L:
        pb = min(((pa + 1) // T + 1) * T - 2, L - 1)  # tile edges where (p + 1) % T == 0
        out.append((pa, pb) + _edges(pa, pb, R))
        pa = pb + 1
    return out


def _gather_index(ctx: int, L: int, pos0: int, R: int, T: int, masks: dict) -> torch.Tensor:
    """Positions in the [pages (Lp) | staging from pos0] buffer of every tile's B keys."""
    key = ("idx", ctx, L, pos0, R, T)
    idx = masks.get(key)
    if idx is None:
        Lp = L // R * R
        idx = torch.cat([torch.cat([torch.arange(A, Fb), Lp + torch.arange(Fa, pb + 1) - pos0])
                         for pa, pb, A, Fa, Fb in _tiles(ctx, L, R, T)])
        masks[key] = idx
    return idx


def _band_mask(p_first: int, p_last: int, R: int, dtype, masks: dict) -> torch.Tensor:
    """Additive mask [rows, (Fb - A) + (p_last - Fa + 1)] of call B (see module doc)."""
    key = (p_first, p_last, R, dtype)
    m = masks.get(key)
    if m is None:
        p = torch.arange(p_first, p_last + 1).unsqueeze(1)
        Fp = (p + 1) // R * R
        A, Fa, Fb = _edges(p_first, p_last, R)
        pages = torch.arange(A, Fb).unsqueeze(0)
        seen = [pages < Fp]
        if R > 1:
            stg = torch.arange(Fa, p_last + 1).unsqueeze(0)
            seen.append((stg >= Fp) & (stg <= p))
        ok = torch.cat(seen, 1)
        m = torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, float("-inf"))
        masks[key] = m
    return m


def attend_prefills(lops, query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, staging_k, staging_v,
                    split: Split) -> None:
    """Write out rows of every prefill sequence of `split` (lops: the layer's LayerOps)."""
    R = lops.residual_chunk
    H, D = cache.shape[1], query.shape[2]
    dt = query.dtype
    T = _tile(R)
    for ps in split.prefills:
        n = ps.q1 - ps.q0
        ctx = ps.L - n
        Lp = ps.L // R * R
        Ns = ps.L - ps.pos0 if R > 1 else 0  # staging rows of this sequence
        # pages [0, Lp) then (R > 1) staging positions pos0.. in one buffer per side
        KS = torch.empty(1, H, Lp + Ns, D, dtype=dt)
        VS = torch.empty(1, H, Lp + Ns, D, dtype=dt)
        K, V = KS[:, :, :Lp], VS[:, :, :Lp]
        if Lp:
            lops._ops.dequantize_pages(cache, block_table[ps.s], Lp, lops.k_codec, lops.v_codec,
                                       lops.k_scale, lops.v_scale, lops.k_levels,
                                       lops.v_levels, K[0], V[0])
        q = query[ps.q0:ps.q1].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D] (a view)
        o = out[ps.q0:ps.q1].transpose(0, 1)                 # [Hq, n, D] (a view)
        if R == 1 and ctx == 0:
            o.copy_(F.scaled_dot_product_attention(q, K, V, is_causal=True, scale=softmax_scale,
                                                   enable_gqa=True)[0])
            continue
        tiles = _tiles(ctx, ps.L, R, T)
        if R > 1:  # every tile's B keys, gathered in one pass: [tile 0 | tile 1 | ...]
            KS[0, :, Lp:].copy_(staging_k[ps.st0:ps.st0 + Ns].transpose(0, 1))
            VS[0, :, Lp:].copy_(staging_v[ps.st0:ps.st0 + Ns].transpose(0, 1))
            idx = _gather_index(ctx, ps.L, ps.pos0, R, T, split.masks)
            KB, VB = KS.index_select(2, idx), VS.index_select(2, idx)
        off = 0
        for pa, pb, A, Fa, Fb in tiles:
            a, b = pa - ctx, pb - ctx + 1
            qt = q[:, :, a:b]
            if R > 1:
                w = (Fb - A) + (pb + 1 - Fa)
                kb, vb = KB[:, :, off:off + w], VB[:, :, off:off + w]
                off += w
            else:
                kb, vb = K[:, :, A:Fb], V[:, :, A:Fb]
            ob, lb = _flash(qt, kb, vb, attn_mask=_band_mask(pa, pb, R, dt, split.masks),
                            scale=softmax_scale)
            if A == 0:
                o[:, a:b].copy_(ob[0])
            else:
                oa, la = _flash(qt, K[:, :, :A], V[:, :, :A], scale=softmax_scale)
                # softmax over both key sets: oa + (ob - oa) * exp(lb) / (exp(la) + exp(lb)),
                # one pass written straight into out (few big ops: each is a parallel region)
                w8 = torch.sigmoid(lb - la).to(dt).unsqueeze(-1)
                torch.lerp(oa[0], ob[0], w8[0], out=o[:, a:b])
