"""The residual window's bookkeeping, driven like vLLM drives it, checked against a direct
computation of what every query must see (pure PyTorch reference, no vLLM, no kernels)."""
from types import SimpleNamespace

import pytest
import torch

from vllm_kvq import reference as ref
from vllm_kvq.formats import parse_format
from vllm_kvq.residual import (ResidualStateError, ResidualWindows, dequantize_window_rows,
                               plan_tensors, quantize_window_rows, stage_and_write,
                               stage_and_write_torch, window_addresses)

B, H, HQ, D = 64, 2, 4, 64
SCALE = D ** -0.5


class Sim:
    """A tiny engine: block tables, steps of mixed prefill/decode, one attention layer."""

    def __init__(self, name: str, num_blocks: int = 48, rows_per_block: int = 7,
                 seed: int = 0, lookback: int = 0):
        self.fmt = parse_format(name)
        self.layout = self.fmt.layout(D, B)
        self.cache = ref.new_cache(num_blocks, H, self.layout)
        self.R = self.fmt.residual_chunk
        # a few rows per block, so that a window spans several blocks
        self.windows = ResidualWindows(self.R, B, rows_per_block, lookback)
        row = self.fmt.window_value_row_bytes(D)
        self.pool = (torch.zeros(num_blocks, rows_per_block, 2, H, row, dtype=torch.uint8)
                     if self.fmt.window_bits == 8 else
                     torch.zeros(num_blocks, rows_per_block, 2, H, D, dtype=torch.bfloat16))
        # window blocks, handed out and taken back like vLLM's block manager does (LIFO)
        self.free = list(range(num_blocks - 1, 23, -1))
        self.window_of = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.history = {}  # request -> (K, V) [L, H, D] bf16 in position order

    def tokens(self, n):
        k = torch.randn(n, H, D, generator=self.gen).to(torch.bfloat16)
        v = torch.randn(n, H, D, generator=self.gen).to(torch.bfloat16)
        q = torch.randn(n, HQ, D, generator=self.gen).to(torch.bfloat16)
        return k, v, q

    def reject(self, rid, accepted_len):
        """Speculative decoding: the scheduler keeps the first accepted_len tokens; the next
        step writes new ones over the rejected drafts' slots."""
        self.history[rid] = tuple(x[:accepted_len] for x in self.history[rid])

    def release(self, rid):
        """The request finished or was preempted: vLLM takes its window blocks back."""
        self.free += reversed(self.window_of.pop(rid))

    def window(self, rid):
        if rid not in self.window_of:
            self.window_of[rid] = [self.free.pop() for _ in range(self.windows.num_blocks)]
        return self.window_of[rid]

    def step(self, batch):
        """batch: list of (request id, block ids, L_prev, n_new). Returns per-request errors."""
        seq_lens, qsl, tables, ks, vs, qs = [], [0], [], [], [], []
        for rid, blocks, L_prev, n in batch:
            k, v, q = self.tokens(n)
            hk, hv = self.history.get(rid, (k[:0], v[:0]))
            if hk.shape[0] >= L_prev + n:  # tokens given in advance (a recomputed prompt)
                k, v = hk[L_prev:L_prev + n], hv[L_prev:L_prev + n]
            self.history[rid] = (torch.cat([hk[:L_prev], k]), torch.cat([hv[:L_prev], v]))
            seq_lens.append(L_prev + n)
            qsl.append(qsl[-1] + n)
            tables.append(blocks + [0] * (8 - len(blocks)))
            ks.append(k), vs.append(v), qs.append(q)
        k, v, q = torch.cat(ks), torch.cat(vs), torch.cat(qs)
        bt = torch.tensor(tables, dtype=torch.int32)
        windows = [self.window(rid) for rid, *_ in batch]
        plan = self.windows.plan(seq_lens, qsl, tables, windows)
        md = SimpleNamespace(plan=plan, **plan_tensors(plan, "cpu"))
        addresses = window_addresses(md, torch.tensor(windows), self.windows.rows)
        # the extension's row copies against torch indexing, on a copy of the pool and cache
        pool_t, cache_t = self.pool.clone(), self.cache.clone()
        want_k, want_v = stage_and_write_torch(
            md, k, v, pool_t, addresses,
            lambda a, b, s: ref.write_cache(a, b, cache_t, s, self.fmt, self.layout))
        st_k, st_v = stage_and_write(
            md, k, v, self.pool, addresses,
            lambda a, b, s: ref.write_cache(a, b, self.cache, s, self.fmt, self.layout))
        filled = torch.cat([md.pool_gather[0], md.new_gather[0]])  # the others: never read
        assert torch.equal(st_k[filled], want_k[filled])
        assert torch.equal(st_v[filled], want_v[filled])
        assert torch.equal(self.pool, pool_t) and torch.equal(self.cache, cache_t)
        out = ref.paged_attention(q, self.cache, bt, torch.tensor(seq_lens), torch.tensor(qsl),
                                  self.fmt, self.layout, SCALE, staging_k=st_k, staging_v=st_v,
                                  staging_start_loc=md.staging_start_loc,
                                  staging_pos0=md.staging_pos0)
        errs = []
        for i, (rid, _, L_prev, n) in enumerate(batch):
            want = self.expected(rid, qs[i], L_prev)
            errs.append((out[qsl[i]:qsl[i + 1]].float() - want).abs().max().item())
        return errs

    def expected(self, rid, q, L_prev):
        """What decode at each position sees: complete chunks quantized, the rest exact (with
        an 8-bit window: every token rounded to int8 per row first, chunks quantized from
        those values)."""
        K, V = self.history[rid]
        if self.fmt.window_bits == 8:
            K, V = (dequantize_window_rows(quantize_window_rows(x), x.dtype) for x in (K, V))
        K, V = K.float(), V.float()
        out = torch.zeros(q.shape[0], HQ, D)
        for i in range(q.shape[0]):
            p = L_prev + i
            F = (p + 1) // self.R * self.R
            Kp, Vp = K[:p + 1].clone(), V[:p + 1].clone()
            for h in range(H):
                if F:
                    Kp[:F, h] = ref.fake_quantize(K[:F, h], self.fmt.key)
                    Vp[:F, h] = ref.fake_quantize(V[:F, h], self.fmt.value)
            for hq in range(HQ):
                h = hq // (HQ // H)
                w = torch.softmax(Kp[:, h] @ q[i, hq].float() * SCALE, 0)
                out[i, hq] = w @ Vp[:, h]
        return out


@pytest.mark.parametrize("name", ["kivi2_k16_g16_r32", "int4_group32_r64", "int8_token",
                                  "kivi2_k16_g16_r32_w8"])
def test_chunked_prefill_decode_and_mixed_batches(name):
    sim = Sim(name)
    a, b = [5, 2, 9], [7, 1, 3]
    steps = [
        [("a", a, 0, 20)],                          # chunk ends mid-group
        [("a", a, 20, 30), ("b", b, 0, 70)],        # a crosses a chunk; b crosses a block
        [("a", a, 50, 1), ("b", b, 70, 1)],
        [("a", a, 51, 13), ("b", b, 71, 1)],        # a ends exactly on a block boundary
        [("a", a, 64, 1), ("b", b, 72, 1)],
    ]
    for batch in steps:
        assert max(sim.step(batch)) < 2e-2, batch


def test_prefix_hit_and_preemption_recompute():
    sim = Sim("kivi2_k16_g16_r32")
    a = [4, 6, 8]
    sim.step([("a", a, 0, 64)])
    sim.step([("a", a, 64, 10)])
    # c shares a's first (full, finalized) block and computes from position 64
    sim.history["c"] = tuple(x[:64] for x in sim.history["a"])
    assert max(sim.step([("c", [4, 11], 64, 5), ("a", a, 74, 1)])) < 2e-2
    # full-prompt hit: vLLM recomputes the last prompt token inside the shared block
    sim.history["d"] = tuple(x[:64] for x in sim.history["a"])
    assert max(sim.step([("d", [4], 63, 1)])) < 2e-2
    # preemption: a restarts from scratch on new blocks, and on the window blocks c held
    # (c finished); e, new, receives a's old window blocks
    sim.release("a"), sim.release("c")
    assert max(sim.step([("a", [12, 13], 0, 75)])) < 2e-2
    assert max(sim.step([("a", [12, 13], 75, 2), ("e", [14, 15], 0, 70)])) < 2e-2


def test_a_reused_window_is_not_trusted():
    """Window blocks a finished request held come back to a new request: its window starts
    empty, and resuming mid-chunk from such blocks is an error, never their old rows."""
    windows = ResidualWindows(residual_tokens=32, block_size=64, rows_per_block=16)
    windows.plan([10], [0, 10], [[3]], [[7, 8]])           # x: positions 0..9 in the window
    plan = windows.plan([10], [0, 10], [[5]], [[7, 8]])    # y, new, on x's window blocks
    assert plan.pool_gather == ([], [], [])
    with pytest.raises(ResidualStateError, match="residual window"):
        windows.plan([12], [0, 2], [[6]], [[7, 8]])        # z resumes at 10 on other pages


def test_missing_state_mid_chunk_is_an_error_not_garbage():
    windows = ResidualWindows(residual_tokens=32, block_size=64, rows_per_block=32)
    with pytest.raises(ResidualStateError, match="should be in its residual window"):
        windows.plan([12], [0, 2], [[3]], [[9]])  # resumes at 10 with nothing stored
    with pytest.raises(ResidualStateError, match="window blocks"):
        windows.plan([12], [0, 12], [[3]], [[]])  # vLLM gave it no window block


# Speculative decoding (vLLM's n-gram proposer, num_speculative_tokens=4): a verification
# step of 1 + 4 tokens per request; the scheduler then rolls back the rejected drafts.
SPEC = 4


@pytest.mark.parametrize("name", ["kivi2_k16_g16_r32", "int4_group32_r64",
                                  "int4_group32_r64_w8"])
def test_speculative_drafts_rolled_back_inside_a_quantized_chunk(name):
    """A verification step completes a chunk with drafts in it and quantizes it; the drafts
    are rejected; the next step resumes inside that chunk, with other tokens there. The
    window's ring still holds the chunk's accepted rows, so every query sees exactly what
    decoding one token at a time would: the accepted tokens quantized once their chunk is
    complete again, the rest exact."""
    sim = Sim(name, lookback=SPEC)
    R = sim.R
    a, b = [5, 2, 9], [7, 1, 3]
    steps = [([("a", a, 0, R - 2), ("b", b, 0, 2 * R - 3)], {}),
             # a crosses its first chunk boundary with drafts; b crosses the second
             ([("a", a, R - 2, 1 + SPEC), ("b", b, 2 * R - 3, 1 + SPEC)], {"a": R - 1,
                                                                           "b": 2 * R - 1}),
             # a: only its own token accepted (chunk 0's last position was a draft)
             ([("a", a, R - 1, 1 + SPEC), ("b", b, 2 * R - 1, 1 + SPEC)], {"a": R + 1,
                                                                           "b": 2 * R + 4}),
             ([("a", a, R + 1, 1), ("b", b, 2 * R + 4, 1 + SPEC)], {"b": 2 * R + 5}),
             ([("a", a, R + 2, 1 + SPEC), ("b", b, 2 * R + 5, 1)], {"a": R + 2 + 1 + SPEC})]
    for batch, accepted in steps:
        assert max(sim.step(batch)) < 2e-2, batch
        for rid, n in accepted.items():
            sim.reject(rid, n)
    assert sim.windows.num_blocks == -(-(R + SPEC) // 7)


def test_speculative_rollback_crosses_a_block_boundary():
    """Drafts that crossed into the sequence's next block are rejected: the window is still
    trusted (the record knows the blocks its rows belong to), and the next step rewrites."""
    sim = Sim("kivi2_k16_g16_r32", lookback=SPEC)
    a = [5, 2, 9]
    assert max(sim.step([("a", a, 0, B - 2)])) < 2e-2
    assert max(sim.step([("a", a, B - 2, 1 + SPEC)])) < 2e-2   # writes into block 2
    sim.reject("a", B - 1)
    assert max(sim.step([("a", a, B - 1, 1 + SPEC)])) < 2e-2
    sim.reject("a", B + 1)
    assert max(sim.step([("a", a, B + 1, 1)])) < 2e-2


def test_a_rollback_without_lookback_is_refused():
    """Without the lookback rows (the window sized for R only), a rollback into a chunk
    already quantized finds the window moved on: an error, never a wrong answer."""
    sim = Sim("kivi2_k16_g16_r32")
    R, a = sim.R, [5, 2, 9]
    sim.step([("a", a, 0, R - 2)])
    sim.step([("a", a, R - 2, 1 + SPEC)])
    sim.reject("a", R - 1)
    with pytest.raises(ResidualStateError, match="should be in its residual window"):
        sim.step([("a", a, R - 1, 1 + SPEC)])


def test_lookback_rows_do_not_change_plain_steps():
    """Decode steps keep [c1, L) with or without lookback rows: the same staging rows are
    gathered, quantized and kept (only their places in the longer ring differ)."""
    plain, spec = (ResidualWindows(32, 64, 16, lookback) for lookback in (0, SPEC))
    for seq_lens, qsl in (([20], [0, 20]), ([21], [0, 1]), ([40], [0, 19]), ([41], [0, 1])):
        p0, p1 = (w.plan(seq_lens, qsl, [[3]], [[7, 8, 9]]) for w in (plain, spec))
        assert (p0.pool_gather[0], p0.new_gather, p0.final_rows, p0.final_slots,
                p0.keep[0]) == (p1.pool_gather[0], p1.new_gather, p1.final_rows,
                                p1.final_slots, p1.keep[0])
        L_prev = seq_lens[0] - qsl[1]
        assert p1.pool_gather[2] == [p % (32 + SPEC) for p in range(L_prev // 32 * 32, L_prev)]


def _random_window_step(key_dtype, pool_dtype, seed=0):
    """A step's row lists drawn at random (staging rows each filled once, kept rows from
    staging), the layer's inputs, and a pool with strided blocks as vLLM's pages give it."""
    g = torch.Generator().manual_seed(seed)
    Ns, N, nb, rpb = 40, 12, 6, 5
    rows = torch.randperm(Ns, generator=g)
    pg, nw = rows[:25], rows[25:25 + N]
    keep = rows[torch.randperm(25 + N, generator=g)[:9]]  # rows this step filled
    md = SimpleNamespace(
        plan=SimpleNamespace(num_staging=Ns),
        pool_gather=(pg,), new_gather=(nw, torch.randperm(N, generator=g)),
        keep=(keep,), final_rows=rows[:2],
        final_slots=torch.tensor([7, 8], dtype=torch.int64))
    addresses = ((torch.randint(nb, (25,), generator=g), torch.randint(rpb, (25,), generator=g)),
                 (torch.randperm(nb * rpb, generator=g)[:9] // rpb,
                  torch.randperm(nb * rpb, generator=g)[:9] % rpb))
    # distinct (block, row) targets for the kept rows: a second write would be order-dependent
    flat = torch.randperm(nb * rpb, generator=g)[:9]
    addresses = (addresses[0], (flat // rpb, flat % rpb))
    qkv = torch.randn(N, 3 * H + 1, D, generator=g).to(key_dtype)
    key, value = qkv[:, 1:H + 1], qkv[:, H + 1:2 * H + 1]  # strided, as vLLM's qkv split
    pages = torch.randn(nb, rpb * 2 * H * D + 32, generator=g).to(pool_dtype)
    pool = pages[:, :rpb * 2 * H * D].view(nb, rpb, 2, H, D)  # blocks padded beyond the rows
    return md, key, value, pages, pool, addresses


@pytest.mark.parametrize("key_dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16),
                                                  (torch.float32, torch.bfloat16)])
def test_stage_window_op_matches_torch_indexing(key_dtype, pool_dtype):
    md, key, value, pages, pool, addresses = _random_window_step(key_dtype, pool_dtype)
    _assert_op_matches_torch(md, key, value, pages, pool, addresses)


def _assert_op_matches_torch(md, key, value, pages, pool, addresses):
    """The extension and stage_and_write_torch on copies of the same pages: the same
    staging rows, the same bytes kept (padding untouched), the same rows written."""
    pages_t = pages.clone()
    pool_t = pages_t[:, :pool[0].numel()].view(pool.shape)
    writes, writes_t = [], []
    got = stage_and_write(md, key, value, pool, addresses, lambda *a: writes.append(a))
    want = stage_and_write_torch(md, key, value, pool_t, addresses,
                                 lambda *a: writes_t.append(a))
    filled = torch.cat([md.pool_gather[0], md.new_gather[0]])
    assert all(torch.equal(a[filled], b[filled]) for a, b in zip(got, want))
    assert torch.equal(pages, pages_t)
    assert len(writes) == 1 and all(torch.equal(a, b) for a, b in zip(writes[0], writes_t[0]))


def test_stage_window_op_rejects_bad_rows():
    md, key, value, pages, pool, addresses = _random_window_step(torch.bfloat16, torch.bfloat16)
    (g_blk, g_row), keep = addresses
    bad = g_blk.clone()
    bad[2] = pool.shape[0]
    with pytest.raises(RuntimeError, match=r"gather_blk\[2\] = 6 is outside \[0, 6\)"):
        stage_and_write(md, key, value, pool, ((bad, g_row), keep), lambda *a: None)
    with pytest.raises(RuntimeError, match="pool must be bfloat16 or float16"):
        stage_and_write(md, key, value, pool.float(), addresses, lambda *a: None)


def _int8_pages(nb, rpb, seed=1):
    """Window pages of 8-bit rows (random codes, positive scales) padded beyond the rows."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(nb, rpb, 2, H, D, generator=g) * 3
    q = quantize_window_rows(rows).view(nb, -1)
    pages = torch.cat([q, torch.randint(256, (nb, 32), generator=g, dtype=torch.uint8)], 1)
    return pages, pages[:, :q.shape[1]].view(nb, rpb, 2, H, D + 4)


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stage_window_op_matches_torch_indexing_int8_window(key_dtype, path, monkeypatch):
    """An 8-bit window (_w8): the extension (on each SIMD path its row codecs are compiled
    for) and the torch reference stage the same values and keep the same bytes (codes and
    scales), gathered rows and new tokens alike."""
    from vllm_kvq import ops
    monkeypatch.setenv("KVQ_SIMD", path)
    if ops.simd_path() != path:
        pytest.skip(f"this CPU has no {path} path")
    md, key, value, _, _, addresses = _random_window_step(key_dtype, torch.bfloat16)
    _assert_op_matches_torch(md, key, value, *_int8_pages(6, 5), addresses)


def test_an_int8_window_stages_every_row_rounded():
    """New tokens are staged as their int8 rounding (so a prefill chunk's queries read what
    later decode steps read back from the pool), kept as those codes, and read back
    unchanged: max error half a step (max|x| / 254) per row, plus the bf16 rounding of the
    decoded value."""
    g = torch.Generator().manual_seed(3)
    key = torch.randn(3, H, D, generator=g).to(torch.bfloat16)
    value = torch.randn(3, H, D, generator=g).to(torch.bfloat16)
    pool = torch.zeros(2, 4, 2, H, D + 4, dtype=torch.uint8)
    md = SimpleNamespace(plan=SimpleNamespace(num_staging=3),
                         pool_gather=(torch.tensor([], dtype=torch.int64),),
                         new_gather=(torch.arange(3), torch.arange(3)),
                         keep=(torch.arange(3),), final_rows=torch.tensor([], dtype=torch.int64),
                         final_slots=torch.tensor([], dtype=torch.int64))
    empty = torch.tensor([], dtype=torch.int64)
    addresses = ((empty, empty), (torch.tensor([0, 0, 1]), torch.tensor([0, 3, 2])))
    st_k, st_v = stage_and_write(md, key, value, pool, addresses, None)
    for x, st in ((key, st_k), (value, st_v)):
        step = x.float().abs().amax(-1, keepdim=True) / 127
        bound = step / 2 + st.float().abs() * 2.0 ** -8
        assert ((st.float() - x.float()).abs() <= bound).all()
        assert not torch.equal(st, x)  # rounded, not copied
        assert torch.equal(st, dequantize_window_rows(quantize_window_rows(x), x.dtype))
    # read back by a later step: the same values
    md2 = SimpleNamespace(plan=SimpleNamespace(num_staging=3),
                          pool_gather=(torch.arange(3),), new_gather=(empty, empty),
                          keep=(empty,), final_rows=empty, final_slots=empty)
    back = stage_and_write(md2, key[:0], value[:0], pool, (addresses[1], (empty, empty)), None)
    assert torch.equal(back[0], st_k) and torch.equal(back[1], st_v)


def test_int8_window_rows_zero_and_non_finite():
    x = torch.zeros(2, D)
    x[1, 5] = float("inf")
    q = quantize_window_rows(x)
    back = dequantize_window_rows(q, torch.float32)
    assert torch.equal(back[0], torch.zeros(D))  # scale 1, codes 0
    assert back[1].isnan().all()  # a non-finite row reads back as NaN, never as numbers
    # the extension the same way: a key row with an inf stages as NaN, its other heads and
    # the zero value rows as they are
    key = torch.zeros(1, H, D, dtype=torch.bfloat16)
    key[0, 1, 3] = float("inf")
    key[0, 0] = 1.0
    empty = torch.tensor([], dtype=torch.int64)
    md = SimpleNamespace(plan=SimpleNamespace(num_staging=1), pool_gather=(empty,),
                         new_gather=(torch.tensor([0]), torch.tensor([0])), keep=(empty,),
                         final_rows=empty, final_slots=empty)
    pool = torch.zeros(1, 1, 2, H, D + 4, dtype=torch.uint8)
    st_k, st_v = stage_and_write(md, key, torch.zeros_like(key), pool,
                                 ((empty, empty), (empty, empty)), None)
    assert st_k[0, 1].isnan().all() and torch.equal(st_k[0, 0], key[0, 0])
    assert torch.equal(st_v, torch.zeros_like(st_v))
