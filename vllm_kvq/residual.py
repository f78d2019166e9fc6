"""Bookkeeping of the full-precision residual window (mixed precision, KIVI's residual).

Tokens are quantized into vLLM's pages in aligned chunks of R tokens (R divides the block
size). Until its chunk is complete a token lives only in full precision, in its sequence's
window: rows [rows_per_block, 2, H, D] (16 bits, window_dtype) of a few blocks that vLLM's
own block manager gives every running request for as long as it runs
(vllm_kvq.window_cache). The window is a ring of W = R + lookback rows: position p lives in
window row j = p % W (lookback = 0: p - c1, its place in the chunk in progress), which is
row j % rows_per_block of the window's block j // rows_per_block. The plan names rows as
(request, window row): layers whose windows sit in different KV-cache groups (vLLM splits a model's layers into groups of equal size) have
different blocks, resolved per group by window_addresses(). Nothing is read from the pages' own bytes to decide validity: a window's
blocks are not zeroed when a new request receives them.

Per step, `plan()` says for every request:
  - which staging rows to gather from its window (positions [c0, L_prev)) and from this
    step's new tokens (positions [L_prev, L)), where c0 = floor(L_prev/R)*R;
  - which staging rows complete chunks and are quantized into the pages (and at which slots);
  - which staging rows stay in the window for the next step (positions [k1, L),
    k1 = floor(max(L - lookback, L_prev + 1)/R)*R: with lookback = 0, c1 = floor(L/R)*R).
Speculative decoding (lookback = vLLM's num_speculative_tokens): a verification step
writes its drafts, and the scheduler rolls back the rejected ones; the next step starts at
some L_prev' in [max(L_prev + 1, L - lookback), L] and may resume inside a chunk this step
already quantized (its drafts now stale in the pages). The window still holds that chunk's
rows exactly, so the chunk is quantized again, from the accepted tokens, once it is
complete; until then every query reads it from staging.
Attention reads positions < floor((p+1)/R)*R from the pages and the rest from staging, so
every query sees exactly what a decode step at its position would see.

Plain Python and one extension op (row copies), no vLLM: tested on its own
(tests/test_residual.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


class ResidualStateError(RuntimeError):
    pass


@dataclass
class StepPlan:
    staging_pos0: list[int] = field(default_factory=list)    # c0 per request
    staging_start: list[int] = field(default_factory=lambda: [0])  # S+1 row offsets
    pool_gather: tuple[list[int], list[int], list[int]] = ((), (), ())  # rows, request, wrow
    new_gather: tuple[list[int], list[int]] = ((), ())       # rows, token index
    final_rows: list[int] = field(default_factory=list)      # staging rows -> pages
    final_slots: list[int] = field(default_factory=list)     # their cache slots
    keep: tuple[list[int], list[int], list[int]] = ((), (), ())  # rows, request, wrow

    @property
    def num_staging(self) -> int:
        return self.staging_start[-1]


@dataclass
class _Record:
    blocks: tuple[int, ...]  # the window's blocks
    lo: int         # positions [lo, hi) are held, position p in window row p % W
    hi: int
    tail: dict      # block index -> the sequence's block id, for the blocks of [lo, hi)


class ResidualWindows:
    """What each running sequence's window holds, step by step (one per kv-cache group).

    vLLM hands a request its window blocks when it first runs and takes them back when it
    finishes or is preempted; nothing here allocates. A window is known again by its first
    block, and its rows are trusted only if that block's record names the same blocks and
    the block holding the sequence's last token: a request that receives blocks some finished
    request held starts with an empty window (its computed prefix is block-aligned)."""

    def __init__(self, residual_tokens: int, block_size: int, rows_per_block: int,
                 lookback: int = 0):
        """lookback: draft tokens a step may write and the next step roll back (vLLM's
        num_speculative_tokens; 0 without speculative decoding)."""
        assert residual_tokens >= 1 and block_size % residual_tokens == 0
        assert rows_per_block >= 1 and lookback >= 0
        self.R = residual_tokens
        self.B = block_size
        self.rows = rows_per_block
        self.lookback = lookback
        self.W = window_rows(residual_tokens, lookback)
        self.num_blocks = -(-self.W // rows_per_block)
        self.records: dict[int, _Record] = {}   # first window block -> what it holds

    def plan(self, seq_lens: list[int], query_start_loc: list[int], block_table,
             window_blocks) -> StepPlan:
        """block_table: indexable [S][max_blocks] (lists or a 2-D tensor); window_blocks:
        [S][num_blocks], each request's window blocks (of one layer: they identify the
        request's window; all its layers' windows are claimed and freed together)."""
        R, B, W = self.R, self.B, self.W
        p = StepPlan()
        pg_rows, pg_blk, pg_brow = [], [], []
        nw_rows, nw_tok = [], []
        kp_rows, kp_blk, kp_brow = [], [], []
        updates = []
        row = 0
        for s, L in enumerate(seq_lens):
            q0, q1 = query_start_loc[s], query_start_loc[s + 1]
            q = q1 - q0
            if q == 0:
                p.staging_pos0.append(L)
                p.staging_start.append(row)
                continue
            L_prev = L - q
            c0, c1 = L_prev // R * R, L // R * R
            need = L_prev - c0
            blocks = block_table[s]
            win = tuple(int(b) for b in window_blocks[s][:self.num_blocks])
            if len(win) < self.num_blocks:
                raise ResidualStateError(
                    f"request {s} has {len(win)} window blocks, the window needs "
                    f"{self.num_blocks}")
            rec = self.records.get(win[0]) if L_prev > 0 else None
            if rec is not None and not (rec.blocks == win and rec.lo <= c0 and L_prev <= rec.hi
                                        and rec.tail.get((L_prev - 1) // B)
                                        == int(blocks[(L_prev - 1) // B])):
                rec = None
            finalize = True
            if need > 0 and rec is None:
                # Only a full-prompt prefix-cache hit resumes mid-chunk in a block this
                # sequence never wrote: vLLM recomputes the last prompt token, whose chunk
                # the block's first writer already quantized. Nothing is read from staging.
                if not (q == 1 and L == c1):
                    raise ResidualStateError(
                        f"request {s}: positions {c0}..{L_prev - 1} should be in its "
                        f"residual window but it holds none of them (seq_len={L}, "
                        f"query_len={q})")
                finalize = False
            p.staging_pos0.append(c0)
            base = row
            if rec is not None:
                for pos in range(c0, L_prev):
                    pg_rows.append(base + pos - c0)
                    pg_blk.append(s)
                    pg_brow.append(pos % W)
            row += need
            for i in range(q):
                nw_rows.append(row + i)
                nw_tok.append(q0 + i)
            row += q
            p.staging_start.append(row)
            if finalize:
                for pos in range(c0, c1):
                    p.final_rows.append(base + pos - c0)
                    p.final_slots.append(int(blocks[pos // B]) * B + pos % B)
            # the next step starts at L_prev + 1 or later, and at most `lookback` drafts back
            k1 = max(L - self.lookback, L_prev + 1) // R * R
            for pos in range(max(k1, L_prev), L):
                kp_rows.append(base + pos - c0)
                kp_blk.append(s)
                kp_brow.append(pos % W)
            # held now: [k1, L). Rows of [k1, L_prev) (k1 >= c0 >= rec.lo) are in place
            # from earlier steps; the next step's c0 is >= k1
            tail = {i: int(blocks[i]) for i in range(k1 // B, (L - 1) // B + 1)}
            updates.append((win, _Record(win, k1, L, tail)))
        for win, rec in updates:
            self.records[win[0]] = rec
        p.pool_gather = (pg_rows, pg_blk, pg_brow)
        p.new_gather = (nw_rows, nw_tok)
        p.keep = (kp_rows, kp_blk, kp_brow)
        return p


def window_rows(residual_tokens: int, lookback: int = 0) -> int:
    """Rows of a sequence's window ring: positions [k1, L) span at most R - 1 + lookback."""
    return residual_tokens + lookback


# how a window value may be stored (csrc/kvq_layout.h window_value_row_bytes has the bytes)
WINDOW_BITS = (16, 8)


def window_dtype(model_dtype: torch.dtype, window_bits: int = 16) -> torch.dtype:
    """The window pool's element dtype. 16 bits: the model's own dtype when it is 16-bit, else
    bf16 (the range of float32); tokens are quantized from these values once their chunk is
    complete, and measured against a float32 window this moves no quality figure beyond
    noise (see the e2e tests). 8 bits (the `_w8` formats): uint8 rows of int8 codes and a
    float32 scale per (token, K or V, kv head), half the window's memory. Measured through
    the engine (SmolLM2, bf16 model, 8 x 1024 held-out tokens vs our bf16 cache,
    reports/window-int8), 16-bit -> int8 window: kivi4 KL 0.0028 -> 0.0033 (ppl -0.05% ->
    -0.10%), kivi2 0.0892 -> 0.0892 (+14.8% -> +15.3%), nuq3 0.0112 -> 0.0117; an fp8 e4m3
    window (unscaled; tools/faults.py) tripled kivi4's KL, so int8 it is."""
    if window_bits == 8:
        return torch.uint8
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def quantize_window_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D + 4] uint8: int8 codes round(x * (1 / s)) and the float32 scale
    s = max|x| / 127 (1 for an all-zero row) of every row; a non-finite max stores codes 0
    and the scale as it is (the row reads back as NaN). The reference of the extension's
    8-bit window rows (csrc/cpu/window_stage.cpp)."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True)  # NaN propagates
    s = s / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.where(torch.isfinite(s), (xf * (1 / s)).round().clamp(-127, 127),
                        torch.zeros_like(xf)).to(torch.int8)
    return torch.cat([codes.view(torch.uint8), s.view(torch.uint8)], -1)


def dequantize_window_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_window_rows' [..., D + 4] uint8 rows -> [..., D] values of `dtype`."""
    D = rows.shape[-1] - 4
    codes = rows[..., :D].contiguous().view(torch.int8).float()
    s = rows[..., D:].contiguous().view(torch.float32)
    return (codes * s).to(dtype)


def plan_tensors(plan: StepPlan, device) -> dict:
    """The plan's index lists as tensors, built once per step and shared by all layers."""
    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)

    return dict(staging_start_loc=t(plan.staging_start, torch.int32),
                staging_pos0=t(plan.staging_pos0, torch.int32),
                pool_gather=tuple(t(x) for x in plan.pool_gather),
                new_gather=tuple(t(x) for x in plan.new_gather),
                final_rows=t(plan.final_rows), final_slots=t(plan.final_slots),
                keep=tuple(t(x) for x in plan.keep))


def window_addresses(md, blocks: torch.Tensor, rows_per_block: int) -> tuple:
    """(gather, keep) of md's plan as (block, row) index tensors into one group's window
    rows; blocks [S, window_blocks]: that group's window blocks per request."""
    def at(req, wrow):
        return blocks[req, wrow // rows_per_block].long(), wrow % rows_per_block

    return at(*md.pool_gather[1:]), at(*md.keep[1:])


@functools.cache
def _stage_window_op():
    """The extension's stage_window, resolved once per process."""
    import vllm_kvq._C  # noqa: F401  -- registers torch.ops.vllm_kvq
    return torch.ops.vllm_kvq.stage_window


def stage_and_write(md, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor,
                    addresses: tuple, write) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's step: build staging, quantize completed chunks, keep the rest.

    md: anything with the attributes of plan_tensors() plus `plan`; pool: the window rows
    [num_blocks, rows_per_block, 2, H, D]; addresses: window_addresses() for this layer's
    group; write(k_rows, v_rows, cache_slots) quantizes rows into the pages. Returns staging
    (K, V) [Ns, H, D] for the attention kernel. On the CPU the row copies are one call of
    the extension (csrc/cpu/window_stage.cpp); elsewhere, and as its reference, torch
    indexing (stage_and_write_torch).
    """
    if pool.device.type != "cpu":
        return stage_and_write_torch(md, key, value, pool, addresses, write)
    H, D = key.shape[1:]
    (g_blk, g_row), (k_blk, k_row) = addresses
    st = torch.empty(2, md.plan.num_staging, H, D, dtype=key.dtype, device=key.device)
    _stage_window_op()(st, key, value, pool, md.pool_gather[0], g_blk, g_row,
                       *md.new_gather, md.keep[0], k_blk, k_row)
    if md.final_rows.numel():
        write(st[0, md.final_rows], st[1, md.final_rows], md.final_slots)
    return st[0], st[1]


def stage_and_write_torch(md, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor,
                          addresses: tuple, write) -> tuple[torch.Tensor, torch.Tensor]:
    """stage_and_write in torch indexing ops (any device)."""
    H = key.shape[1]
    (g_blk, g_row), (k_blk, k_row) = addresses
    # rows in the window's own form (an 8-bit window: its bytes, decoded once for staging)
    w8 = pool.dtype == torch.uint8
    stored = torch.empty(2, md.plan.num_staging, H, pool.shape[-1],
                         dtype=torch.uint8 if w8 else key.dtype, device=key.device)
    rows = md.pool_gather[0]
    if rows.numel():
        stored[:, rows] = pool[g_blk, g_row].transpose(0, 1).to(stored.dtype)
    rows, tok = md.new_gather
    for side, x in enumerate((key, value)):
        stored[side, rows] = quantize_window_rows(x[tok]) if w8 else x[tok]
    st = dequantize_window_rows(stored, key.dtype) if w8 else stored
    if md.final_rows.numel():
        write(st[0, md.final_rows], st[1, md.final_rows], md.final_slots)
    rows = md.keep[0]
    if rows.numel():
        pool[k_blk, k_row] = stored[:, rows].transpose(0, 1).to(pool.dtype)
    return st[0], st[1]
