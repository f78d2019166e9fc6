"""Bookkeeping of the full-precision residual window (mixed precision, KIVI's residual).

Tokens are quantized into vLLM's pages in aligned chunks of R tokens (R divides the block
size). Until its chunk is complete a token lives only in full precision, in a slot of a
per-layer side pool [num_slots, 2, R, H, D] owned by the attention impl, in 16 bits (window_dtype). A slot belongs to
one running sequence; it is found again from the block holding the sequence's last token
(the tail block of a running sequence is never shared). Nothing is read from the pages'
own bytes to decide validity: reused blocks are not zeroed.

Per step, `plan()` says for every request:
  - which staging rows to gather from its slot (positions [c0, L_prev)) and from this step's
    new tokens (positions [L_prev, L)), where c0 = floor(L_prev/R)*R;
  - which staging rows complete chunks and are quantized into the pages (and at which slots);
  - which staging rows stay in the slot for the next step (positions [c1, L), c1 = floor(L/R)*R).
Attention reads positions < floor((p+1)/R)*R from the pages and the rest from staging, so
every query sees exactly what a decode step at its position would see.

Plain Python, no vLLM: tested on its own (tests/test_residual.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


class ResidualStateError(RuntimeError):
    pass


@dataclass
class StepPlan:
    slots: list[int] = field(default_factory=list)           # pool slot per request
    staging_pos0: list[int] = field(default_factory=list)    # c0 per request
    staging_start: list[int] = field(default_factory=lambda: [0])  # S+1 row offsets
    pool_gather: tuple[list[int], list[int], list[int]] = ((), (), ())  # rows, slot, slot_row
    new_gather: tuple[list[int], list[int]] = ((), ())       # rows, token index
    final_rows: list[int] = field(default_factory=list)      # staging rows -> pages
    final_slots: list[int] = field(default_factory=list)     # their cache slots
    keep: tuple[list[int], list[int], list[int]] = ((), (), ())  # rows, slot, slot_row

    @property
    def num_staging(self) -> int:
        return self.staging_start[-1]


@dataclass
class _Record:
    block: int      # block id holding the sequence's last written token
    chunk: int      # absolute position of the slot's first row
    count: int      # rows held


class ResidualSlots:
    """Assigns pool slots to running sequences, step by step (one per kv-cache group)."""

    def __init__(self, num_slots: int, residual_tokens: int, block_size: int):
        assert residual_tokens >= 1 and block_size % residual_tokens == 0
        self.num_slots = num_slots
        self.R = residual_tokens
        self.B = block_size
        self.records: dict[int, _Record] = {}
        self.by_block: dict[int, int] = {}      # block id -> slot
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))

    def _release(self, slot: int) -> None:
        rec = self.records.pop(slot, None)
        if rec is not None and self.by_block.get(rec.block) == slot:
            del self.by_block[rec.block]
        self.lru.pop(slot, None)

    def _allocate(self, taken: set[int]) -> int:
        if self.free:
            return self.free.pop()
        for slot in self.lru:  # oldest first: a finished or preempted sequence's slot
            if slot not in taken:
                self._release(slot)
                return slot
        raise ResidualStateError(
            f"all {self.num_slots} residual slots are in use by this step's requests; "
            f"raise the slot count (it follows max_num_seqs)")

    def plan(self, seq_lens: list[int], query_start_loc: list[int],
             block_table) -> StepPlan:
        """block_table: indexable [S][max_blocks] (a list of lists or a 2-D tensor)."""
        R, B = self.R, self.B
        p = StepPlan()
        taken: set[int] = set()
        pg_rows, pg_slot, pg_srow = [], [], []
        nw_rows, nw_tok = [], []
        kp_rows, kp_slot, kp_srow = [], [], []
        updates = []
        row = 0
        for s, L in enumerate(seq_lens):
            q0, q1 = query_start_loc[s], query_start_loc[s + 1]
            q = q1 - q0
            if q == 0:
                p.slots.append(-1)
                p.staging_pos0.append(L)
                p.staging_start.append(row)
                continue
            L_prev = L - q
            c0, c1 = L_prev // R * R, L // R * R
            need = L_prev - c0
            blocks = block_table[s]
            slot, rec = -1, None
            if L_prev > 0:
                cand = self.by_block.get(int(blocks[(L_prev - 1) // B]))
                if cand is not None and cand not in taken:
                    r = self.records[cand]
                    if r.chunk == c0 and r.count >= need:
                        slot, rec = cand, r
            finalize = True
            if need > 0 and rec is None:
                # Only a full-prompt prefix-cache hit resumes mid-chunk in a block this
                # sequence never wrote: vLLM recomputes the last prompt token, whose chunk
                # the block's first writer already quantized. Nothing is read from staging.
                if not (q == 1 and L == c1):
                    raise ResidualStateError(
                        f"request {s}: positions {c0}..{L_prev - 1} should be in a residual "
                        f"slot but none holds them (seq_len={L}, query_len={q})")
                finalize = False
            if slot < 0:
                slot = self._allocate(taken)
            taken.add(slot)
            p.slots.append(slot)
            p.staging_pos0.append(c0)
            base = row
            if rec is not None:
                for i in range(need):
                    pg_rows.append(base + i); pg_slot.append(slot); pg_srow.append(i)
            row += need
            for i in range(q):
                nw_rows.append(row + i); nw_tok.append(q0 + i)
            row += q
            p.staging_start.append(row)
            if finalize:
                for pos in range(c0, c1):
                    p.final_rows.append(base + pos - c0)
                    p.final_slots.append(int(blocks[pos // B]) * B + pos % B)
            for pos in range(max(c1, L_prev), L):
                kp_rows.append(base + pos - c0); kp_slot.append(slot); kp_srow.append(pos - c1)
            updates.append((slot, _Record(int(blocks[(L - 1) // B]), c1, L - c1)))
        for slot, rec in updates:
            self._release(slot)
            self.records[slot] = rec
            self.by_block[rec.block] = slot
            self.lru[slot] = None
        p.pool_gather = (pg_rows, pg_slot, pg_srow)
        p.new_gather = (nw_rows, nw_tok)
        p.keep = (kp_rows, kp_slot, kp_srow)
        return p


WINDOW_BYTES = 2  # bytes per stored value of the window, whatever the model's dtype


def window_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The window's 16-bit dtype: the model's own when it is 16-bit, else bf16 (the range of
    float32). Tokens are quantized from these values once their chunk is complete; measured
    against a float32 window this moves no quality figure beyond noise (see the e2e tests)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


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


def stage_and_write(md, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor,
                    write) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's step: build staging, quantize completed chunks, keep the rest.

    md: anything with the attributes of plan_tensors() plus `plan`; pool: [slots, 2, R, H, D];
    write(k_rows, v_rows, cache_slots) quantizes rows into the pages.
    Returns staging (K, V) [Ns, H, D] for the attention kernel.
    """
    H, D = key.shape[1:]
    st = torch.empty(2, md.plan.num_staging, H, D, dtype=key.dtype, device=key.device)
    rows, slot, srow = md.pool_gather
    if rows.numel():
        st[:, rows] = pool[slot, :, srow].transpose(0, 1).to(st.dtype)
    rows, tok = md.new_gather
    st[0, rows] = key[tok]
    st[1, rows] = value[tok]
    if md.final_rows.numel():
        write(st[0, md.final_rows], st[1, md.final_rows], md.final_slots)
    rows, slot, srow = md.keep
    if rows.numel():
        pool[slot, :, srow] = st[:, rows].transpose(0, 1).to(pool.dtype)
    return st[0], st[1]
