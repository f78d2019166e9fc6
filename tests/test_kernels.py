"""CPU kernels (vllm_kvq.ops -> torch.ops.vllm_kvq) against the PyTorch reference.

write_cache: the planes must be byte-identical to reference.write_cache (the only
  exception: float-baseline NaN payloads, where torch's own fp32->bf16 cast is not
  consistent, e.g. 0xFFFF vs 0x7FC0; there we require NaN where the reference has NaN).
paged_attention: mixed batches (a prefill, chunked prefills continuing mid-block and across
  a residual-chunk boundary, a sequence with no queries this step, decodes), shuffled block
  tables over a cache filled with random garbage bytes, GQA 1/3/8, head sizes 64..256,
  block sizes 16/32/128, residual R in {1, 32, 128} with staging, on every SIMD path this
  CPU has (KVQ_SIMD, read by the kernels on every call).

Non-finite inputs: quantized codecs store NaN as 0 and +-Inf as the group's extreme, so a
NaN/Inf token never makes other tokens' outputs NaN (checked below). For the float
baselines (bf16/fp16) the value is stored as is; queries whose softmax includes that token
get NaN, exactly like the reference, and all other queries stay finite.
"""
from __future__ import annotations

import math
import os
import zlib
from contextlib import contextmanager

import pytest
import torch

from vllm_kvq import ops, reference, rotation
from vllm_kvq.formats import EXAMPLE_NAMES, parse_format
from vllm_kvq.tools.paged_attention_case import attention_case

pytest.importorskip("vllm_kvq._C")

# --- formats ---------------------------------------------------------------------------
WRITE_FORMATS = list(EXAMPLE_NAMES) + [
    "int3_token", "int2_token", "int8_token_sym", "int4_group32_sym", "int3_group32",
    "int4_channel32_sym_r32", "int2_channel16_r32", "fp8_e5m2_token", "fp8_e4m3_head",
    "fp8_e5m2_head", "int8_tensor_sym", "int4_head_sym", "kivi4_r32", "kivi2_k16_g16_r32",
    "kivi2_sink", "int4_group32_sink", "int2_channel16_r32_sink",
]
# Formats run through attention on the standard mixed batch.
ATTN_FORMATS = list(EXAMPLE_NAMES) + [
    "int3_token", "int2_token", "int8_token_sym", "int4_group32_sym", "fp8_e5m2_token",
    "fp8_e4m3_head", "int8_tensor_sym", "kivi4_r32", "int8_token_r32", "bf16_r32",
    "int3_group32", "kivi2_sink", "int4_group32_sink", "kivi4_r32_sink", "int8_token_r32_sink",
    "int2_group32_sink_rot",
]
DATA_KINDS = ["normal", "adversarial", "wide"]


def _available_paths() -> list[str]:
    out = []
    for p in ("scalar", "avx2", "avx512"):
        with simd(p):
            if ops.simd_path() == p:
                out.append(p)
    return out


@contextmanager
def env_var(name: str, value: str | None):
    """name=value (None: unset) inside the block, as it was after it."""
    def put(v):
        if v is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = v
    old = os.environ.get(name)
    put(value)
    try:
        yield
    finally:
        put(old)


def simd(path: str | None):
    return env_var("KVQ_SIMD", path)


PATHS = _available_paths()


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 2**31
ALL_PATHS = ["scalar", "avx2", "avx512"]


def _scales(fmt, H, gen):
    """Static scales for tensor/head codecs (per head values differ)."""
    out = []
    for c in (fmt.key, fmt.value):
        if not c.static_scale:
            out.append(None)
        elif c.granularity == "tensor":
            out.append(torch.tensor([0.037 if c.encoding == "int" else 0.61]))
        else:
            out.append(0.02 + 0.05 * torch.rand(H, generator=gen) if c.encoding == "int"
                       else 0.3 + torch.rand(H, generator=gen))
    return out


# --- data --------------------------------------------------------------------------------
def make_tokens(kind: str, n: int, H: int, D: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, H, D, generator=gen)
    if kind == "adversarial":
        if n > 0:
            x[0] = 0.75                      # constant token: zero-range groups
        if n > 1:
            x[1, :, : D // 2] = -2.5         # zero-range groups in half the channels
        if n > 2:
            x[2, :, 5] = 1.0e4               # large outlier in one channel
        if n > 3:
            x[3, 0, 7] = float("nan")
            x[3, -1, 0] = float("inf")
        if n > 4:
            x[4, :, 3] = float("-inf")
            x[4, 0, 9] = float("inf")
        if n > 5:
            x[5] = torch.randn(H, D, generator=gen) * 1e-6   # tiny values (fp16 subnormal)
        if n > 6:
            x[6] = torch.randn(H, D, generator=gen) * 1e-40  # fp32 denormals
        if n > 7:
            x[7, :, :] = float("nan")                        # all-NaN token
        x[:, :, 11] *= 300.0                                 # an outlier channel everywhere
    elif kind == "wide":
        mag = torch.exp(torch.empty(n, H, D).uniform_(math.log(1e-9), math.log(3e4),
                                                      generator=gen))
        x = torch.sign(x) * mag
    return x + 0.0  # no -0.0: amin over {-0.0, 0.0} is order-dependent in torch


def _canon_nan16(planes: torch.Tensor, enc: str) -> torch.Tensor:
    v = planes.view(torch.int16).to(torch.int32) & 0xFFFF
    if enc == "bf16":
        nan = ((v & 0x7F80) == 0x7F80) & ((v & 0x7F) != 0)
    else:
        nan = ((v & 0x7C00) == 0x7C00) & ((v & 0x3FF) != 0)
    return torch.where(nan, torch.full_like(v, -1), v)


def assert_same_cache(mine: torch.Tensor, ref: torch.Tensor, fmt) -> None:
    if fmt.key.is_float and fmt.value.is_float:
        a = _canon_nan16(mine.contiguous(), fmt.key.encoding)
        b = _canon_nan16(ref.contiguous(), fmt.key.encoding)
        diff = (a != b).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} fp16 words differ, first at {diff[:5]}"
        return
    diff = (mine != ref).nonzero()
    assert diff.numel() == 0, (
        f"{diff.shape[0]} bytes differ; first (block, head, token, byte): {diff[:8].tolist()}")


# --- write_cache -------------------------------------------------------------------------
def _slots_for(fmt, N, nblocks, B, gen):
    """A shuffled slot mapping with padding; per-channel codecs get whole aligned groups."""
    G = max([c.group for c in (fmt.key, fmt.value) if c.granularity == "channel"] or [1])
    ngroups = N // G
    starts = torch.randperm(nblocks * B // G, generator=gen)[:ngroups] * G
    slots = (starts[:, None] + torch.arange(G)).reshape(-1)
    # padding entries (-1) between groups
    out = []
    for g in range(ngroups):
        out.extend(slots[g * G:(g + 1) * G].tolist())
        if g % 3 == 1:
            out.append(-1)
    return torch.tensor(out, dtype=torch.int64)


WRITE_CASES = [(f, k, torch.float32) for f in WRITE_FORMATS for k in DATA_KINDS] + [
    (f, "adversarial", dt) for f in ("bf16", "fp16", "fp8_e4m3_token", "int4_group32",
                                     "kivi2", "int8_token", "fp8_e5m2")
    for dt in (torch.bfloat16, torch.float16)
]


@pytest.mark.parametrize("name,kind,dtype", WRITE_CASES,
                         ids=[f"{n}-{k}-{str(d)[6:]}" for n, k, d in WRITE_CASES])
def test_write_cache_matches_reference(name, kind, dtype):
    fmt = parse_format(name)
    D, H = (96, 2) if name.startswith("int3") else (64, 2)
    B = max(32, fmt.residual_chunk)
    gen = torch.Generator().manual_seed(_seed(name, kind))
    lay = fmt.layout(D, B)
    nblocks = 6
    slots = _slots_for(fmt, 128, nblocks, B, gen)
    N = slots.numel()
    # (+ 0: no -0.0 from the cast either; see make_tokens)
    x = make_tokens(kind, N, H, D, gen).to(dtype) + 0
    y = make_tokens(kind, N, H, D, gen).flip(0).to(dtype) + 0
    ks, vs = _scales(fmt, H, gen)
    init = torch.randint(0, 256, (nblocks, H, B, lay.token_bytes), dtype=torch.uint8,
                         generator=gen)
    ref = init.clone()
    reference.write_cache(x, y, ref, slots, fmt, lay, ks, vs)
    for path in PATHS:  # scalar rules and the AVX2 write path
        mine = init.clone()
        with simd(path):
            ops.write_cache(x, y, mine, slots, fmt, ks, vs)
        assert_same_cache(mine, ref, fmt)


def test_write_cache_strided_inputs():
    """key/value as views of a fused qkv tensor (vLLM passes such views)."""
    fmt = parse_format("int4_group32")
    D, B, H, N = 64, 16, 2, 20
    gen = torch.Generator().manual_seed(3)
    lay = fmt.layout(D, B)
    qkv = torch.randn(N, 3 * H, D, generator=gen)
    k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]
    slots = torch.randperm(4 * B, generator=gen)[:N]
    ref = torch.zeros(4, H, B, lay.token_bytes, dtype=torch.uint8)
    reference.write_cache(k.contiguous(), v.contiguous(), ref, slots, fmt, lay)
    mine = torch.zeros_like(ref)
    ops.write_cache(k, v, mine, slots, fmt)
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("bad", ["misaligned", "partial", "gap"])
def test_write_cache_channel_group_errors(bad):
    fmt = parse_format("kivi4")
    D, B, H = 64, 128, 1
    lay = fmt.layout(D, B)
    cache = torch.zeros(2, H, B, lay.token_bytes, dtype=torch.uint8)
    if bad == "misaligned":
        slots = torch.arange(5, 37)
    elif bad == "partial":
        slots = torch.arange(0, 20)
    else:
        slots = torch.cat([torch.arange(0, 16), torch.tensor([-1]), torch.arange(16, 32)])
    x = torch.randn(slots.numel(), H, D)
    with pytest.raises(ValueError, match="whole aligned groups of 32"):
        ops.write_cache(x, x, cache, slots, fmt)
    assert cache.count_nonzero() == 0
    # The C++ op checks the same before writing anything.
    with pytest.raises(RuntimeError, match="whole aligned groups of 32"):
        torch.ops.vllm_kvq.write_cache(x, x, cache, slots, fmt.key.as_ints(),
                                       fmt.value.as_ints(), torch.ones(H), torch.ones(H),
                                       torch.empty(0), torch.empty(0))
    assert cache.count_nonzero() == 0


@pytest.mark.parametrize("k_ints,v_ints,match", [
    ([4, 2, 5, 32, 0, 0, 1], [4, 2, 4, 32, 0, 0, 0],
     "k_codec sink=1 and v_codec sink=0 must agree"),
    ([4, 2, 5, 32, 0, 0, 2], [4, 2, 4, 32, 0, 0, 2],
     "k_codec: sink=2 is not allowed; allowed: 0 or 1"),
    ([2, 8, 3, 0, 0, 0, 1], [2, 8, 3, 0, 0, 0, 1], "attention sink applies to int and nuq codecs"),
    ([4, 2, 5, 32, 0, 0], [4, 2, 4, 32, 0, 0], "k_codec must have 7 ints, got 6"),
])
def test_ops_refuse_bad_sink_codecs(k_ints, v_ints, match):
    """The C++ checks of every CPU op (one definition, op_checks.cpp check_codecs)."""
    D, B, H = 64, 128, 1
    cache = torch.zeros(2, H, B, 64, dtype=torch.uint8)
    x = torch.randn(B, H, D)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.vllm_kvq.write_cache(x, x, cache, torch.arange(B), k_ints, v_ints,
                                       torch.ones(H), torch.ones(H), torch.empty(0),
                                       torch.empty(0))
    out = x[:10].transpose(0, 1).clone()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.vllm_kvq.dequantize_pages(cache, torch.zeros(1, dtype=torch.int32), 10,
                                            k_ints, v_ints, torch.ones(H), torch.ones(H),
                                            torch.empty(0), torch.empty(0), out, out.clone())


def test_write_cache_argument_errors():
    fmt = parse_format("int4_token")
    D, B, H = 64, 16, 2
    lay = fmt.layout(D, B)
    cache = torch.zeros(2, H, B, lay.token_bytes, dtype=torch.uint8)
    x = torch.randn(4, H, D)
    s = torch.arange(4)
    with pytest.raises(ValueError, match="C=" + str(lay.token_bytes)):
        ops.write_cache(x, x, torch.zeros(2, H, B, lay.token_bytes + 1, dtype=torch.uint8),
                        s, fmt)
    with pytest.raises(ValueError, match="dtype"):
        ops.write_cache(x.double(), x.double(), cache, s, fmt)
    with pytest.raises(ValueError, match="head_dim"):
        ops.write_cache(torch.randn(4, H, 48), torch.randn(4, H, 48), cache, s, fmt)
    with pytest.raises(ValueError, match="kv heads"):
        ops.write_cache(torch.randn(4, 3, D), torch.randn(4, 3, D), cache, s, fmt)
    with pytest.raises(ValueError, match="k_scale is required"):
        f2 = parse_format("int8_tensor_sym")
        c2 = torch.zeros(2, H, B, f2.layout(D, B).token_bytes, dtype=torch.uint8)
        ops.write_cache(x, x, c2, s, f2)
    fn = parse_format("nuq3_token")
    cn = torch.zeros(2, H, B, fn.layout(D, B).token_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="k_levels is required for the nuq codec"):
        ops.write_cache(x, x, cn, s, fn)
    with pytest.raises(ValueError, match="k_levels: codec int4/token takes no codebook"):
        ops.write_cache(x, x, cache, s, fmt, k_levels=torch.zeros(16))
    with pytest.raises(RuntimeError, match="past the cache"):
        ops.write_cache(x, x, cache, torch.tensor([0, 1, 2, 2 * B]), fmt)


# --- attention -----------------------------------------------------------------------------
# (seq_len, queries this step): prefill; chunk continuing mid-block; no queries; decode;
# chunk crossing R=128 and R=32 boundaries; long decode.
SEQS = [(40, 40), (90, 25), (20, 0), (61, 1), (270, 30), (300, 1)]


def build_case(name, D, B, gq, H, dtype, seqs=SEQS, seed=0, kind="normal", extra_rows=3,
               levels=(None, None), tokens=None, window=0, soft_cap=0.0):
    """The shared case (vllm_kvq.tools.paged_attention_case.attention_case: cache written
    by the reference, byte-identical to ops.write_cache as tested above; staging rows for
    positions >= floor((first+1)/R)*R; shuffled block tables, unused entries past the
    cache), with this file's data kinds and static scales and ops.paged_attention's
    argument names. seqs: (seq_len, queries this step); levels: (k_levels, v_levels) of nuq
    formats; tokens(s, L) -> (k, v) [L, H, D] replaces the generated K/V of sequence s."""
    fmt = parse_format(name) if isinstance(name, str) else name
    gen = torch.Generator().manual_seed(seed)
    scales = _scales(fmt, H, gen)

    def kv(s, L):
        if tokens is not None:
            return tokens(s, L)
        k, v = make_tokens(kind, L, H, D, gen), make_tokens(kind, L, H, D, gen)
        if kind == "adversarial":  # the special tokens land mid-sequence
            k, v = k.roll(L // 3, 0), v.roll(L // 3, 0)
        return k, v

    c = attention_case(fmt, D, H * gq, H, B, qlens=[nq for _, nq in seqs],
                       ctx=[L - nq for L, nq in seqs], dtype=dtype, seed=seed, scales=scales,
                       levels=levels, tokens=kv, extra_rows=extra_rows, unused_block=10**6,
                       expected=False, window=window)
    case = dict(fmt=fmt, lay=c["lay"], query=c["q"], cache=c["cache"], block_table=c["bt"],
                seq_lens=c["sl"], query_start_loc=c["qsl"], softmax_scale=c["scale"],
                k_scale=scales[0], v_scale=scales[1], k_levels=levels[0], v_levels=levels[1],
                window=window, soft_cap=soft_cap)
    if fmt.residual_chunk > 1:
        case.update(staging_k=c["sk"], staging_v=c["sv"], staging_start_loc=c["ssl"],
                    staging_pos0=c["sp0"])
    return case


def run_ref(c):
    return reference.paged_attention(
        c["query"], c["cache"], c["block_table"], c["seq_lens"], c["query_start_loc"],
        c["fmt"], c["lay"], c["softmax_scale"], c["k_scale"], c["v_scale"],
        c.get("staging_k"), c.get("staging_v"), c.get("staging_start_loc"),
        c.get("staging_pos0"), c.get("k_levels"), c.get("v_levels"), c.get("window", 0),
        c.get("soft_cap", 0.0))


# --- the int8 query of int and nuq keys -----------------------------------------------------
# Decode tasks with int keys (8/4/3/2 bits) or nuq keys (4/2 bits) compute Q.K in the integer domain
# (csrc/cpu/attn_body.h "integer Q.K"): the query row x = q * softmax_scale * log2(e) is
# rounded to int8 with one scale per row (qs = max|x|/127). nuq keys read their levels in a
# byte form: u = rint((level - lmin) * 127 / (lmax - lmin)), level^ = lmin + u * delta,
# delta = (lmax - lmin) / 127 (int_levels; attn_body.h kNuqKeyLevelMax). For per-token / per-group / static key scales the
# kernel then computes the exact attention of the rounded query over the keys decoded with
# level^ (outlier slots exact); for per-channel keys (KIVI, nuq4) the channel scales fold
# into the query first (x' = x * s per scale row, rounded the same way; the zero-points and
# the outlier slots' corrections use the exact x). These references reproduce both, so the
# kernels stay under the tight tolerances below; a row passes when it matches the exact
# reference or the int8-query one (whether a task takes the integer path depends on the
# SIMD path's vector width and on the task being a decode).
LOG2E = 1.4426950408889634


def _q8_round(x: torch.Tensor):
    """fp32 rows x -> (q8, qs) exactly as the kernels round them."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / 127.0


def int_query_codec(fmt) -> bool:
    k = fmt.key
    return k.encoding in ("int", "nuq") and k.bits in (8, 4, 3, 2)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def int_qk_reads(fmt, path: str) -> bool:
    """Whether a decode of this format's keys takes the integer Q.K on this SIMD path: nuq3
    keys only where 3-bit codes are read as stored (attn_body.h qk_int3: the scalar path,
    and AVX-512 on a CPU with VBMI and VBMI2; elsewhere they keep the exact Q.K)."""
    k = fmt.key
    if k.encoding == "nuq" and k.bits == 3:
        return path == "scalar" or (path == "avx512" and
                                    {"avx512vbmi", "avx512_vbmi2"} <= _cpu_flags())
    return int_query_codec(fmt)


def int_levels(levels: torch.Tensor, top: int = 127):
    """A nuq codebook's byte form (see above): (level^, lmin, delta), float32 like the kernels."""
    lv = torch.as_tensor(levels, dtype=torch.float32)
    lmin, lmax = lv[0], lv[-1]
    u = torch.round((lv - lmin) * (torch.tensor(float(top)) / (lmax - lmin)))
    delta = (lmax - lmin) / float(top)
    return lmin + u * delta, lmin, delta


def run_ref_int8q(c):
    """Reference attention with the kernels' int8 query (see above)."""
    fmt, lay = c["fmt"], c["lay"]
    sl2 = torch.tensor(c["softmax_scale"] * LOG2E, dtype=torch.float32)
    nuq = fmt.key.encoding == "nuq"
    if nuq:
        lv_hat, lmin, delta = int_levels(c["k_levels"])
        c = dict(c, k_levels=lv_hat)
    if fmt.key.granularity != "channel":
        q8, qs = _q8_round(c["query"].float() * sl2)
        return run_ref(dict(c, query=((q8 * qs).double() / sl2.double()).float()))
    # per-channel keys: logit_j = qs' (q8' . code_j) + x . z  with x' = x * s, per scale row
    #   = q~ . (k_j - z) + x . z,  q~ = qs' q8' / s  (0 where s = 0: then code = 0, k = z);
    # nuq: s, z are s * delta, z + s * lmin; outlier slots: k_j is the dense decode there,
    # and x . (slot value - dense) is added
    query, cache, bt = c["query"], c["cache"], c["block_table"]
    T, Hq, D = query.shape
    H, B, R, G = cache.shape[1], lay.block_size, fmt.residual_chunk, fmt.key.group
    out = torch.zeros(T, Hq, D)
    planes = reference._planes(cache)
    r = lay.k
    n = r["scale_rows"] * r["scale_cols"]
    for s in range(c["seq_lens"].numel()):
        L = int(c["seq_lens"][s])
        q0, q1 = int(c["query_start_loc"][s]), int(c["query_start_loc"][s + 1])
        if q1 == q0:
            continue
        nblk = (L + B - 1) // B
        K, V = torch.zeros(H, nblk * B, D), torch.zeros(H, nblk * B, D)
        Kd = torch.zeros(H, nblk * B, D)  # dense decode (outlier slots not applied)
        Sc, Z = torch.zeros(H, nblk * B // G, D), torch.zeros(H, nblk * B // G, D)
        for j in range(nblk):
            blk = int(bt[s, j])
            for h in range(H):
                k, v = reference.read_block(cache, blk, h, fmt, lay, c["k_scale"], c["v_scale"],
                                            c.get("k_levels"), c.get("v_levels"))
                K[h, j * B:(j + 1) * B], V[h, j * B:(j + 1) * B] = k, v
                Kd[h, j * B:(j + 1) * B] = reference._decode_dense(
                    planes[blk, h], r, fmt.key, D, B, 1.0, c.get("k_levels"))
                sc = reference._fp16_field(planes[blk, h], r["scale_off"], n).reshape(-1, D)
                z = (reference._fp16_field(planes[blk, h], r["zero_off"], n).reshape(-1, D)
                     if r["zero_bytes"] else -(2.0 ** (fmt.key.bits - 1)) * sc)
                if nuq:
                    sc, z = sc * delta, z + sc * lmin
                Sc[h, j * B // G:(j + 1) * B // G], Z[h, j * B // G:(j + 1) * B // G] = sc, z
        # the attention sink: position 0 read exactly (the exact query, like staging rows)
        sink = [reference.read_sink(cache, int(bt[s, 0]), h, lay) for h in range(H)] \
            if fmt.sink else None
        if sink:
            for h in range(H):
                V[h, 0] = sink[h][1][0]
        first = L - (q1 - q0)
        for i in range(q1 - q0):
            p = first + i
            F = (p + 1) // R * R
            Vp = V[:, :p + 1].clone()
            Ks = None
            if F <= p:
                st0, pos0 = int(c["staging_start_loc"][s]), int(c["staging_pos0"][s])
                rows = slice(st0 + F - pos0, st0 + p + 1 - pos0)
                Ks = c["staging_k"][rows].transpose(0, 1).float()
                Vp[:, F:] = c["staging_v"][rows].transpose(0, 1).float()
            for hq in range(Hq):
                h = hq // (Hq // H)
                x = query[q0 + i, hq].float() * sl2
                xs = x * Sc[h]                                  # [rows, D]
                q8, qs = _q8_round(xs)
                qt = torch.where(Sc[h] != 0, q8 * qs / Sc[h], torch.zeros_like(xs))
                rowof = torch.arange(F) // G
                kz = Kd[h, :F] - Z[h][rowof]
                lg = ((qt.double()[rowof] * kz.double()).sum(-1) + (Z[h][rowof].double() @ x.double())
                      + (K[h, :F] - Kd[h, :F]).double() @ x.double())
                if sink and F > 0:
                    lg[0] = sink[h][0][0].double() @ x.double()
                if Ks is not None:
                    lg = torch.cat([lg, Ks[h].double() @ x.double()])
                lo = max(0, p - c["window"] + 1) if c.get("window") else 0  # keys (p - W, p]
                lg = lg[lo:] / LOG2E
                if c.get("soft_cap"):
                    lg = c["soft_cap"] * torch.tanh(lg / c["soft_cap"])
                out[q0 + i, hq] = torch.softmax(lg, 0).float() @ Vp[h, lo:]
    return out.to(query.dtype)


def byte_values(fmt) -> bool:
    """Whether the fused P.V may read this format's values as byte levels (attn_body.h K_B4,
    AVX2 only: nuq 4-bit values, their codebook in int_levels' form, as nuq keys on the
    integer Q.K; KVQ_EXACT_PV=1 keeps the float levels)."""
    return fmt.value.encoding == "nuq" and fmt.value.bits == 4


def pv_byte_runs(path: str, fmt) -> bool:
    return path == "avx2" and byte_values(fmt)


def with_byte_values(c):
    """Case c with its value codebook rounded to the byte form K_B4 reads (levels over
    [0, 255]: attn_body.h kNuqValueLevelMax)."""
    return dict(c, v_levels=int_levels(c["v_levels"], 255)[0])


def run_refs(c):
    """The references a kernel row may match: exact, and with the int8 query for int keys
    (of a format rotating keys: the query rotated in fp32 is what the kernel rounds); for nuq 4-bit values
    each also with the values' byte levels (byte_values)."""
    if byte_values(c["fmt"]) and "bytes" not in c:
        return _as_list(run_refs(dict(c, bytes=False))) + _as_list(
            run_refs(dict(with_byte_values(c), bytes=True)))
    ref = run_ref(c)
    if not int_query_codec(c["fmt"]):
        return ref
    if c["fmt"].rotation == "none":
        return [ref, run_ref_int8q(c)]
    keys = rotation.rotates_keys(c["fmt"].rotation)
    sk, sv = rotation.for_staging(c.get("staging_k"), c.get("staging_v"), keys)
    # the CPU kernel rotates the query row in fp32 as it loads it (not rounded to its dtype)
    q = rotation.rotate(c["query"], torch.float32) if keys else c["query"]
    plain = dict(c, fmt=c["fmt"].with_rotation("none"), query=q, staging_k=sk, staging_v=sv)
    return [ref, rotation.unrotate(run_ref_int8q(plain))]


def _as_list(r):
    return list(r) if isinstance(r, (list, tuple)) else [r]


def run_mine(c, path=None, **over):
    args = dict(c)
    args.update(over)
    sentinel = torch.full_like(args["query"], 7.0)
    with simd(path):
        out = ops.paged_attention(
            args["query"], args["cache"], args["block_table"], args["seq_lens"],
            args["query_start_loc"], args["fmt"], args["softmax_scale"], args["k_scale"],
            args["v_scale"], args.get("staging_k"), args.get("staging_v"),
            args.get("staging_start_loc"), args.get("staging_pos0"), out=sentinel,
            k_levels=args.get("k_levels"), v_levels=args.get("v_levels"),
            sliding_window=args.get("window", 0), logits_soft_cap=args.get("soft_cap", 0.0))
    n = int(args["query_start_loc"][-1])
    assert torch.all(out[n:] == 7.0), "rows past query_start_loc[-1] must be left untouched"
    return out[:n]


def assert_attn_close(mine, ref, dtype, scale=1.0, what=""):
    """fp32: a few ulps of accumulated rounding; fp16/bf16: one ulp of the output dtype.
    ref: a tensor, or a list of candidate references (run_refs): each row (last dim) must
    match one of them."""
    if isinstance(ref, (list, tuple)):
        fails = []
        for r in ref:
            try:
                assert_attn_close(mine, r, dtype, scale, what)
                return
            except AssertionError as e:
                fails.append(e)
        rows = torch.zeros(mine.shape[:-1], dtype=torch.bool)
        for r in ref:
            rows |= _rows_close(mine, r, dtype, scale)
        assert rows.all(), (f"{what}: {int((~rows).sum())} rows match none of the "
                            f"{len(ref)} references; {fails[0]}")
        return
    ref = ref[:mine.shape[0]].float()
    mine = mine.float()
    nan_ref, nan_mine = torch.isnan(ref), torch.isnan(mine)
    assert torch.equal(nan_ref, nan_mine), f"{what}: NaN pattern differs"
    rel = {torch.float32: 2e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    atol = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}[dtype] * scale
    ok = ~nan_ref
    err = (mine[ok] - ref[ok]).abs()
    bound = atol + rel * ref[ok].abs()
    worst = (err - bound).max().item() if err.numel() else -1
    assert worst <= 0, (f"{what}: max err {err.max().item():.3g} exceeds tolerance "
                        f"(atol {atol:.2g}, rtol {rel:.2g})")


def assert_paths_match(c, ref, dtype, what="", scale=1.0):
    """The kernel on every SIMD path against ref (a tensor or run_refs' list) at dtype's
    tolerance. The references do not model the bf16 weights of a bf16 query's decode P.V
    (pv_bf16_runs): there the output with KVQ_EXACT_PV=1 is held to ref, and the output
    as it runs to that one by test_bf16_weights_in_the_decode_pv's bound, 2^-7 relative L2
    per row. (On top of the int8 query, one bf16 rounding of P moved one element near zero
    by 0.0026, past one bf16 ulp's 0.002: nuq3_token_o1, Zen 4.)"""
    D, gq = c["query"].shape[-1], c["query"].shape[-2] // c["cache"].shape[1]
    for path in PATHS:
        out = run_mine(c, path)
        if not (dtype == torch.bfloat16 and pv_bf16_runs(path, D, gq, c["fmt"])):
            assert_attn_close(out, ref, dtype, scale, what=f"{what} {path}")
            continue
        with env_var("KVQ_EXACT_PV", "1"):
            exact = run_mine(c, path)
        assert_attn_close(exact, ref, dtype, scale, what=f"{what} {path} KVQ_EXACT_PV=1")
        diff, norm = (out.float() - exact.float()).norm(dim=-1), exact.float().norm(dim=-1)
        rel = (diff / norm.clamp_min(1e-6)).max().item()
        assert rel <= 2 ** -7, f"{what} {path}: bf16 P.V weights, rel err {rel:.3g}"


def _rows_close(mine, ref, dtype, scale=1.0):
    """Per row (all but the last dim): NaN pattern equal and within assert_attn_close's bound."""
    ref = ref[:mine.shape[0]].float()
    mine = mine.float()
    rel = {torch.float32: 2e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    atol = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}[dtype] * scale
    nan_ok = (torch.isnan(ref) == torch.isnan(mine)).all(-1)
    err = torch.nan_to_num((mine - ref).abs(), nan=0.0)
    bound = atol + rel * torch.nan_to_num(ref.abs(), nan=0.0)
    return nan_ok & (err <= bound).all(-1)


def _geom(name):
    """(D, B) that the format allows for the standard batch."""
    R = parse_format(name).residual_chunk
    return 64, max(32, R)


ATTN_CASES = [(n, dt) for n in ATTN_FORMATS for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", ATTN_CASES,
                         ids=[f"{n}-{str(d)[6:]}" for n, d in ATTN_CASES])
def test_attention_formats(name, dtype):
    D, B = _geom(name)
    c = build_case(name, D, B, gq=3, H=2, dtype=dtype, seed=_seed(name))
    ref = run_refs(c)
    assert_paths_match(c, ref, dtype, what=name)


# Head sizes x block sizes x GQA ratios, spread over a few formats (Latin square).
SHAPES = [(64, 16, 1), (64, 32, 8), (64, 128, 3), (128, 16, 3), (128, 32, 1), (128, 128, 8),
          (256, 16, 8), (256, 32, 3), (256, 128, 1), (80, 32, 3), (96, 16, 8), (192, 32, 1)]
SHAPE_FORMATS = ["bf16", "int4_group{g}", "kivi2{r}", "fp8_e4m3_token", "int8_channel{G}{r}",
                 "int3_token"]


def _shape_format(t, D, B):
    g = 32 if D % 32 == 0 else 16
    if "{r}" in t:
        if B < 32:
            return None
        r = "" if B == 128 else "_r32"
        if t.startswith("kivi"):
            return f"kivi2_g{g}{r}"
        return t.format(G=32, r=r if r else "_r128")
    return t.format(g=g)


SHAPE_CASES = []
for i, (D, B, gq) in enumerate(SHAPES):
    for j, t in enumerate(SHAPE_FORMATS):
        if (i + j) % 2:
            continue  # half of the cross product keeps the file fast
        n = _shape_format(t, D, B)
        if n:
            SHAPE_CASES.append((n, D, B, gq, torch.float16 if (i + j) % 4 == 0 else
                                torch.float32))


@pytest.mark.parametrize("name,D,B,gq,dtype", SHAPE_CASES,
                         ids=[f"{n}-D{D}-B{B}-gq{g}-{str(d)[6:]}" for n, D, B, g, d in
                              SHAPE_CASES])
def test_attention_shapes(name, D, B, gq, dtype):
    seqs = [(33, 33), (70, 9), (129, 1), (290, 1)] if B == 128 else \
        [(33, 33), (70, 9), (129, 1)]
    c = build_case(name, D, B, gq=gq, H=2, dtype=dtype, seqs=seqs, seed=D + B + gq)
    ref = run_refs(c)
    assert_paths_match(c, ref, dtype, what=name)


# Sliding windows (Gemma 2/3, Mistral): a query at p sees keys (p - W, p]; blocks wholly
# before every query's window hold other data (vLLM's null block) and must not be read.
# Decodes far past the window, prefill chunks that cross it, a whole prefill longer than
# it, at Gemma 3's shape (head_dim 256, one kv head, 4 query heads) and SmolLM2's; W equal to
# the residual window R is the smallest allowed.
WINDOW_SEQS = [(900, 1), (700, 1), (420, 100), (600, 600), (130, 1)]
WINDOW_CASES = [("bf16", 256, 4, 1, 512, torch.bfloat16),
                ("int4_group32", 256, 4, 1, 512, torch.float32),
                ("kivi2", 64, 3, 2, 160, torch.float32),
                ("nuq3", 256, 4, 1, 512, torch.bfloat16),
                ("int8_token", 64, 3, 2, 96, torch.float32),
                ("kivi2_k16_g16_r32", 64, 3, 2, 32, torch.bfloat16),
                # 16-token key groups, a window starting mid-group: a tile spans the most
                # per-channel scale rows (kTileChanRows)
                ("kivi2_k16_g16_r32", 64, 3, 2, 208, torch.float32),
                # the attention sink: position 0 in some rows' windows and not in others'
                ("kivi2_sink", 64, 3, 2, 160, torch.float32),
                ("int4_group32_sink", 256, 4, 1, 512, torch.bfloat16)]


@pytest.mark.parametrize("name,D,gq,H,W,dtype", WINDOW_CASES,
                         ids=[f"{c[0]}-D{c[1]}-W{c[4]}" for c in WINDOW_CASES])
def test_sliding_window(name, D, gq, H, W, dtype):
    B = max(64, parse_format(name).residual_chunk)
    fmt = parse_format(name)
    levels = tuple(reference.uniform_levels(x.bits) if x.encoding == "nuq" else None
                   for x in (fmt.key, fmt.value))
    c = build_case(name, D, B, gq=gq, H=H, dtype=dtype, seqs=WINDOW_SEQS, seed=W + D,
                   levels=levels, window=W)
    assert (c["block_table"][0, :2] == 0).all()  # blocks before the window: the "null" one
    ref = run_refs(c)
    full = run_ref(dict(c, window=0, block_table=build_case(
        name, D, B, gq=gq, H=H, dtype=dtype, seqs=WINDOW_SEQS, seed=W + D,
        levels=levels)["block_table"]))
    assert not torch.allclose(ref[0] if isinstance(ref, list) else ref, full, atol=1e-2)
    assert_paths_match(c, ref, dtype, what=f"{name} W={W}")


@pytest.mark.parametrize("name", ["bf16", "int4_group32", "int8_token"])
def test_positions_outside_the_window_change_nothing(name):
    """Two caches that differ only in the K/V of positions before a query's window (in
    whole blocks and in the block the window starts in): the same output, bit for bit, on
    every SIMD path (per-token formats: a token's bytes are its own)."""
    W, seqs = 512, [(900, 1), (700, 1), (560, 60)]
    firsts = [L - nq - W + 1 for L, nq in seqs]  # the first query's first key

    def tokens(perturbed):
        def kv(s, L):
            g = torch.Generator().manual_seed(100 + s)
            k, v = torch.randn(L, 1, 256, generator=g), torch.randn(L, 1, 256, generator=g)
            if perturbed and firsts[s] > 0:
                k[:firsts[s]] = torch.randn(firsts[s], 1, 256) * 9
                v[:firsts[s]] = torch.randn(firsts[s], 1, 256) * 9
            return k, v
        return kv

    a, b = (build_case(name, 256, 64, gq=4, H=1, dtype=torch.float32, seqs=seqs, seed=3,
                       tokens=tokens(p), window=W) for p in (False, True))
    assert not torch.equal(a["cache"], b["cache"])
    for path in PATHS:
        assert torch.equal(run_mine(a, path), run_mine(b, path)), path


# Logit soft-capping (Gemma 2's attn_logit_softcapping = 50): each logit x becomes
# c * tanh(x / c) before the softmax. A small cap (2, 5) bends most logits of these random
# keys, so a kernel that skipped or misplaced it is far off; decodes (fused and int8-query
# paths), prefill tiles, staging rows, a sliding window, a codebook, every SIMD path.
SOFTCAP_CASES = [("bf16", 64, 3, 2, 5.0, 0, torch.float32),
                 ("int4_group32", 128, 4, 2, 2.0, 0, torch.bfloat16),
                 ("kivi2", 64, 3, 2, 5.0, 0, torch.float32),
                 ("int8_token", 256, 4, 1, 2.0, 512, torch.float32),
                 ("nuq3", 256, 4, 1, 5.0, 512, torch.bfloat16),
                 ("fp8_e4m3", 128, 2, 2, 50.0, 0, torch.float32),
                 # the sink's position 0 is left out of the pages' tile after capping
                 ("kivi2_sink", 64, 3, 2, 5.0, 0, torch.float32),
                 ("int4_group32_sink", 128, 4, 2, 2.0, 512, torch.bfloat16)]


@pytest.mark.parametrize("name,D,gq,H,cap,W,dtype", SOFTCAP_CASES,
                         ids=[f"{c[0]}-D{c[1]}-cap{c[4]:g}-W{c[5]}" for c in SOFTCAP_CASES])
def test_logit_soft_capping(name, D, gq, H, cap, W, dtype):
    fmt = parse_format(name)
    B = max(64, fmt.residual_chunk)
    levels = tuple(reference.uniform_levels(x.bits) if x.encoding == "nuq" else None
                   for x in (fmt.key, fmt.value))
    seqs = WINDOW_SEQS if W else SEQS
    c = build_case(name, D, B, gq=gq, H=H, dtype=dtype, seqs=seqs, seed=int(cap) + D,
                   levels=levels, window=W, soft_cap=cap)
    # logits large enough that the cap matters: keys and queries scaled up
    c["query"] = (c["query"].float() * 4).to(dtype)
    ref = run_refs(c)
    plain = run_ref(dict(c, soft_cap=0.0))
    if cap < 50:
        assert not torch.allclose(ref[0] if isinstance(ref, list) else ref, plain, atol=5e-2)
    assert_paths_match(c, ref, dtype, what=f"{name} cap={cap}")


def test_soft_cap_argument_errors():
    c = build_case("int8_token", 64, 64, gq=3, H=2, dtype=torch.float32, seqs=[(70, 1)])
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap=.* is not allowed"):
            run_mine(c, soft_cap=bad)


def test_sliding_window_argument_errors():
    c = build_case("kivi2", 64, 128, gq=3, H=2, dtype=torch.float32, seqs=[(200, 1)])
    with pytest.raises(ValueError, match="sliding_window=64: kvq.method=.* keeps the last 128 tokens.* <= 64"):
        run_mine(c, window=64)
    with pytest.raises(ValueError, match="sliding_window=-1"):
        run_mine(c, window=-1)


# Rotated formats (vllm_kvq.rotation): every head size the rotation allows, prefill chunks
# and decodes, a window, a codebook and outlier slots, on every SIMD path.
ROT_CASES = [("int4_group32_rot", 64, torch.bfloat16), ("kivi2_rot", 64, torch.float32),
             ("int4_token_o1_rot", 128, torch.float32), ("int8_token_rot", 128, torch.bfloat16),
             ("nuq3_rot", 256, torch.float32), ("bf16_rot", 256, torch.bfloat16),
             ("nuq2_rotv", 64, torch.bfloat16), ("kivi2_rotv", 128, torch.float32)]


@pytest.mark.parametrize("name,D,dtype", ROT_CASES, ids=[f"{n}-D{D}" for n, D, _ in ROT_CASES])
def test_rotated_formats(name, D, dtype):
    fmt = parse_format(name)
    B = max(32, fmt.residual_chunk)
    lv = ((reference.uniform_levels(fmt.key.bits), reference.uniform_levels(fmt.value.bits))
          if fmt.needs_levels else (None, None))
    c = build_case(name, D, B, gq=3, H=2, dtype=dtype, seed=_seed(name, D), levels=lv)
    ref = run_refs(c)
    assert_paths_match(c, ref, dtype, what=name)


@pytest.mark.parametrize("D", rotation.HEAD_SIZES)
def test_rotation_is_the_hadamard_matrix(D):
    """rotate / unrotate (the fast transform) are x R and y R^T with R = diag(signs) H / sqrt(D)
    up to fp32 rounding, and R is orthogonal."""
    R = rotation.hadamard_matrix(D)
    assert torch.allclose(R @ R.T, torch.eye(D), atol=1e-6)
    x = torch.randn(40, 3, D, generator=torch.Generator().manual_seed(D))
    assert torch.allclose(rotation.rotate(x), x @ R, atol=1e-5)
    assert torch.allclose(rotation.unrotate(x), x @ R.T, atol=1e-5)
    assert torch.allclose(rotation.unrotate(rotation.rotate(x)), x, atol=1e-5)


HADAMARD_DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                   (torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("D", rotation.HEAD_SIZES)
@pytest.mark.parametrize("dt,odt", HADAMARD_DTYPES, ids=[f"{a}-{b}".replace("torch.", "")
                                                          for a, b in HADAMARD_DTYPES])
def test_hadamard_op_equals_the_reference(D, dt, odt):
    """torch.ops.vllm_kvq.hadamard (ops.rotate on the CPU) is rotation.rotate / unrotate bit
    for bit on every SIMD path: strided rows (a query sliced from a fused qkv), a decode
    step's few rows (one thread) and a prefill's many (OpenMP), in place too."""
    g = torch.Generator().manual_seed(D)
    qkv = (torch.randn(700, 5 * D, generator=g) * 4).to(dt)
    qkv[3, 7] = float("nan")
    for rows in (3, 700):
        x = qkv[:rows, D:4 * D].view(rows, 3, D)  # row stride 5D, head stride D
        for inverse in (False, True):
            want = (rotation.unrotate if inverse else rotation.rotate)(x, odt)
            for path in PATHS:
                with simd(path):
                    got = ops.rotate(x, odt, inverse=inverse)
                    assert torch.equal(got.isnan(), want.isnan()), path
                    assert torch.equal(got.nan_to_num(), want.nan_to_num()), (path, inverse)
                    if odt == dt:
                        y = x.clone()
                        ops.rotate(y, inverse=inverse, out=y)
                        assert torch.equal(y.nan_to_num(), want.nan_to_num()), path


def test_hadamard_op_rejects_bad_arguments():
    sc = rotation.signed_scale(64)
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="head_dim 96 is not allowed"):
        ops._ops().hadamard(torch.randn(4, 96), torch.empty(4, 96), sc, False)
    with pytest.raises(RuntimeError, match="out must have x's shape"):
        ops._ops().hadamard(x, torch.empty(4, 32), sc, False)
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        ops._ops().hadamard(torch.randn(64, 4).T, torch.empty(4, 64), sc, False)
    with pytest.raises(RuntimeError, match="sc must be a contiguous float32"):
        ops._ops().hadamard(x, torch.empty(4, 64), sc.double(), False)
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        ops._ops().hadamard(x.to(torch.int32), torch.empty(4, 64), sc, False)


def test_rotation_preserves_attention():
    """An orthogonal rotation of q, k and v (output rotated back) leaves attention as it
    was: bf16_rot computes bf16's attention up to rounding."""
    outs = {}
    for name in ("bf16", "bf16_rot", "bf16_rotv"):
        c = build_case(name, 64, 32, gq=3, H=2, dtype=torch.float32, seed=3)
        outs[name] = run_mine(c)
    for name in ("bf16_rot", "bf16_rotv"):
        assert (outs["bf16"] - outs[name]).abs().max().item() < 2e-2
        assert not torch.equal(outs["bf16"], outs[name])  # the rotated path did run


def test_values_only_rotation_leaves_the_keys():
    """_rotv stores the keys exactly as the unrotated format does and the values rotated
    (the bytes of each side's region of the pages, written by the kernel)."""
    g = torch.Generator().manual_seed(5)
    N, H, D, B = 64, 2, 64, 32
    k, v = torch.randn(N, H, D, generator=g), torch.randn(N, H, D, generator=g)
    caches = {}
    for name in ("int4_token", "int4_token_rotv", "int4_token_rot"):
        fmt = parse_format(name)
        caches[name] = reference.new_cache(N // B, H, fmt.layout(D, B))
        ops.write_cache(k, v, caches[name], torch.arange(N), fmt)
    kb = parse_format("int4_token").layout(D, B).k["end"]  # a plane's key region (keys first)
    plain, rotv, rot = (caches[n].flatten(2) for n in ("int4_token", "int4_token_rotv",
                                                      "int4_token_rot"))
    assert torch.equal(plain[..., :kb], rotv[..., :kb])
    assert not torch.equal(plain[..., :kb], rot[..., :kb])
    assert not torch.equal(plain[..., kb:], rotv[..., kb:])
    assert torch.equal(rot[..., kb:], rotv[..., kb:])


def test_rotation_spreads_an_outlier_channel():
    """One large channel in every token sets the per-token scale; rotated, the same 4-bit
    codes keep the keys much closer (read back from the cache the kernel wrote, rotated
    back)."""
    g = torch.Generator().manual_seed(4)
    N, H, D, B = 64, 2, 64, 32
    x = torch.randn(N, H, D, generator=g)
    x[:, :, 5] *= 20.0
    err = {}
    for name in ("int4_token", "int4_token_rot"):
        fmt = parse_format(name)
        lay = fmt.layout(D, B)
        cache = reference.new_cache(N // B, H, lay)
        ops.write_cache(x, x, cache, torch.arange(N), fmt)
        back = torch.cat([torch.stack([reference.read_block(cache, b, h, fmt, lay)[0]
                                       for h in range(H)], 1) for b in range(N // B)])
        if fmt.rotation != "none":
            back = rotation.unrotate(back)
        err[name] = ((back - x).norm() / x.norm()).item()
    assert err["int4_token_rot"] < 0.5 * err["int4_token"], err


@pytest.mark.parametrize("name", ["int4_group32", "kivi4", "fp8_e4m3", "bf16", "int2_token"])
def test_attention_adversarial(name):
    """Constant tokens, outliers of 1e4, NaN/Inf tokens, denormals. Logits reach ~1e3, so
    fp32 summation order alone moves outputs by ~1e-3 of |V|: tolerance relative to max|V|.
    """
    D, B = _geom(name)
    c = build_case(name, D, B, gq=2, H=2, dtype=torch.float32, kind="adversarial", seed=5)
    refs = run_refs(c)
    refs = refs if isinstance(refs, list) else [refs]
    ref = refs[0]
    fmt = c["fmt"]
    for path in PATHS:
        out = run_mine(c, path)
        if not fmt.key.is_float and fmt.residual_chunk == 1:
            # (with R > 1 the window is full precision: NaN there reaches the queries that
            # attend it, like the reference, checked just below)
            assert torch.isfinite(out).all(), f"{path}: quantized formats never give NaN/Inf"
        finite = torch.isfinite(ref[:out.shape[0]])
        assert torch.equal(finite, torch.isfinite(out))
        tol = 2e-3 * max(1.0, ref[:out.shape[0]][finite].abs().max().item())
        row_ok = torch.zeros(out.shape[:-1], dtype=torch.bool)
        for r in refs:  # each row matches the exact or the int8-query reference
            err = torch.where(finite, (out - r[:out.shape[0]]).abs(), torch.zeros_like(out))
            row_ok |= (err <= tol).all(-1)
        assert row_ok.all(), f"{path}: {int((~row_ok).sum())} rows beyond {tol:.3g}"


@pytest.mark.parametrize("name", ["int8_token", "int4_group32_r128", "bf16", "fp8_e4m3"])
def test_attention_nan_token_isolated(name):
    """A NaN in one token's K and V (prefill of 64 tokens, token 20)."""
    fmt = parse_format(name)
    D, B, H, gq, L = 64, max(32, fmt.residual_chunk), 1, 2, 64
    c = build_case(name, D, B, gq=gq, H=H, dtype=torch.float32, seqs=[(L, L)], seed=11)
    # Rebuild the sequence with a NaN token 20 in both pages and staging.
    gen = torch.Generator().manual_seed(12)
    k, v = torch.randn(L, H, D, generator=gen), torch.randn(L, H, D, generator=gen)
    k[20, 0, 3] = float("nan")
    v[20, 0, 5] = float("nan")
    R = fmt.residual_chunk
    Fp = L // R * R
    bt = c["block_table"][0]
    if Fp:
        pos = torch.arange(Fp)
        ops.write_cache(k[:Fp], v[:Fp], c["cache"], bt[pos // B].long() * B + pos % B, fmt)
    if R > 1:
        c["staging_k"], c["staging_v"] = k.clone(), v.clone()
    ref = run_refs(c)
    for path in PATHS:
        out = run_mine(c, path)
        if fmt.key.is_float:
            # The float baseline keeps the NaN: exactly the queries that see token 20 are NaN.
            assert torch.isnan(out[20:]).all() and torch.isfinite(out[:20]).all()
        elif R > 1:
            # Token 20 is in the full-precision window for all 64 queries (R=128 > 64).
            assert torch.isnan(out[20:]).all() and torch.isfinite(out[:20]).all()
        else:
            assert torch.isfinite(out).all(), "NaN is stored as code 0: no NaN output"
        assert_attn_close(out, ref, torch.float32, what=f"{name} {path}")


@pytest.mark.parametrize("name", ["int4_group32", "int4_group32_sink", "int4_group32_rot",
                                  "int4_group32_rotv"])
def test_attention_split_long_context(name):
    """Few (sequence, head) tasks and long contexts: the flash-decoding split + log-sum-exp
    reduction (the attention sink in the first part only; a rotated format's output rows
    rotated back after it); also a decode whose last block is partially filled."""
    c = build_case(name, 128, 32, gq=4, H=1, dtype=torch.float32,
                   seqs=[(2113, 1), (1500, 2)], seed=21)
    ref = run_refs(c)
    old = torch.get_num_threads()
    torch.set_num_threads(4)  # 2 tasks < 2 * threads: each context is split into 4 parts
    try:
        for path in PATHS:
            assert_attn_close(run_mine(c, path), ref, torch.float32, what=path)
    finally:
        torch.set_num_threads(old)


# Speculative verification steps put 1 + k query tokens of a sequence in one call: chunks of
# up to 8 (csrc/cpu/attention.cpp kDecodeRowsMax) run as one decode task per token, so each
# row is, bit for bit, the decode step at its position (the same fused body and int8 query,
# the same staging rows and window). Contexts < 512: no flash-decoding split (it depends on
# how many tasks a call has, so a long context split in one call and not in the other sums
# in another order). The 9-token chunk is a prefill tile: checked against the reference.
VERIFY_SEQS = [(300, 5), (97, 3), (500, 8), (130, 1), (450, 9)]
VERIFY_CASES = [("int4_group32", 64, 3, 3, 0, torch.float32),
                ("int4_group32", 128, 4, 2, 0, torch.bfloat16),
                ("kivi2", 64, 3, 3, 0, torch.float32),
                ("nuq3", 256, 4, 1, 512, torch.bfloat16),
                ("int8_token", 64, 3, 2, 96, torch.float32),
                ("bf16", 128, 4, 2, 0, torch.float32)]


@pytest.mark.parametrize("name,D,gq,H,W,dtype", VERIFY_CASES,
                         ids=[f"{c[0]}-D{c[1]}-W{c[4]}-{str(c[5])[6:]}" for c in VERIFY_CASES])
def test_short_chunks_equal_decode_steps(name, D, gq, H, W, dtype):
    fmt = parse_format(name)
    levels = tuple(reference.uniform_levels(x.bits) if x.encoding == "nuq" else None
                   for x in (fmt.key, fmt.value))
    c = build_case(name, D, max(64, fmt.residual_chunk), gq=gq, H=H, dtype=dtype,
                   seqs=VERIFY_SEQS, seed=D + W, levels=levels, window=W)
    qsl = c["query_start_loc"].tolist()
    ref = run_refs(c)
    for path in PATHS:
        chunk = run_mine(c, path)
        assert_attn_close(chunk, ref, dtype, what=f"{name} {path}")
        for s, (L, nq) in enumerate(VERIFY_SEQS[:-1]):
            for i in range(nq):
                row = qsl[s] + i
                one = dict(c, query=c["query"][row:row + 1].contiguous(),
                           block_table=c["block_table"][s:s + 1],
                           seq_lens=torch.tensor([L - nq + i + 1], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
                if "staging_k" in c:
                    one.update(staging_start_loc=c["staging_start_loc"][s:s + 1],
                               staging_pos0=c["staging_pos0"][s:s + 1])
                assert torch.equal(run_mine(one, path), chunk[row:row + 1]), (path, s, i)


def test_attention_detects_wrong_scale():
    """The tolerances are tight: a 1% static scale error or one corrupted stored scale is
    caught."""
    name = "fp8_e4m3"
    c = build_case(name, 64, 32, gq=2, H=2, dtype=torch.float32, seed=31)
    ref = run_ref(c)
    assert_attn_close(run_mine(c), ref, torch.float32)
    with pytest.raises(AssertionError):
        assert_attn_close(run_mine(c, v_scale=c["v_scale"] * 1.01), ref, torch.float32)
    c2 = build_case("int4_token", 64, 32, gq=2, H=2, dtype=torch.float32, seed=32)
    ref2 = run_refs(c2)
    lay = c2["lay"]
    blk = int(c2["block_table"][4, 0])
    plane = c2["cache"].view(c2["cache"].shape[0], 2, -1)[blk, 1]
    plane[lay.k["scale_off"] + 2 * 3 + 1] ^= 0x04  # token 3's key scale, one exponent bit
    with pytest.raises(AssertionError):
        assert_attn_close(run_mine(c2), ref2, torch.float32)


def test_attention_every_path_listed():
    """Which SIMD paths ran here (others are skipped on this CPU); scalar always exists."""
    assert "scalar" in PATHS
    assert ops.simd_path() == PATHS[-1]
    with simd("scalar"):
        assert ops.simd_path() == "scalar"


@pytest.mark.parametrize("path", ALL_PATHS)
def test_attention_path_smoke(path):
    if path not in PATHS:
        pytest.skip(f"this CPU has no {path}")
    c = build_case("kivi2", 128, 128, gq=8, H=1, dtype=torch.bfloat16,
                   seqs=[(150, 150), (300, 1)], seed=41)
    assert_attn_close(run_mine(c, path), run_refs(c), torch.bfloat16, what=path)


def test_attention_argument_errors():
    c = build_case("int4_token", 64, 32, gq=2, H=2, dtype=torch.float32,
                   seqs=[(40, 1)], seed=51)
    with pytest.raises(ValueError, match="multiple of the cache's kv heads"):
        run_mine(c, query=torch.randn(2, 3, 64))
    with pytest.raises(ValueError, match="head_dim"):
        run_mine(c, query=torch.randn(2, 4, 48))
    with pytest.raises(ValueError, match="C="):
        run_mine(c, fmt=parse_format("int8_token"))
    with pytest.raises(ValueError, match="query_start_loc must have"):
        run_mine(c, query_start_loc=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        run_mine(c, query=c["query"].double())
    fr = parse_format("int4_token_r32")
    lay = fr.layout(64, 32)
    with pytest.raises(ValueError, match="staging_k"):
        run_mine(c, fmt=fr, cache=torch.zeros(4, 2, 32, lay.token_bytes, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="block_table"):
        bt = c["block_table"].clone()
        bt[0, 0] = 10**6
        run_mine(c, block_table=bt)


INT_QK_FORMATS = ["int8_token", "int4_group32", "int2_group32", "int4_token_sym",
                  "int8_tensor_sym", "int2_token", "kivi4", "kivi2_k16_g16_r32",
                  "int8_channel32_r128", "int4_channel32_sym_r32"]
# (format, head_dim, gq): every format at 128 / 4, and the token-lane kernel's other shapes
# (a row of 32 or 64 bytes, 1..8 query rows per kv head, 1 to 16 words per scale group)
INT_QK_CASES = [(n, 128, 4) for n in INT_QK_FORMATS] + [
    ("int4_group32", 64, 3), ("kivi2", 64, 3), ("int2_group16", 64, 1), ("int8_token", 64, 2),
    ("int8_group16", 256, 8), ("kivi4", 256, 4), ("int4_group64", 256, 1),
    # nuq levels through their byte table, 3-bit codes repacked, outlier slots corrected
    ("nuq4", 64, 3), ("nuq4", 128, 4), ("nuq2", 64, 3), ("nuq4_token_o1", 64, 3),
    ("nuq4_group32_o2", 128, 2), ("nuq2_group16", 256, 4), ("int3_group32", 128, 4),
    ("int3_channel32_r32", 64, 3), ("int4_token_o1", 64, 3), ("int8_group32_o2", 128, 8),
    # 3-bit codes read as stored (qk_int3) where the path can, else repacked (int3) / exact
    ("nuq3", 64, 3), ("nuq3", 256, 1), ("nuq3_group32", 128, 4), ("int3_token_o1", 64, 3),
    ("int3_group64", 192, 2)]


def skewed_levels(bits: int) -> torch.Tensor:
    """A non-uniform codebook (levels crowded near 0): the byte form rounds them."""
    u = reference.uniform_levels(bits).double()
    return (u.sign() * u.abs() ** 1.6).float()


@pytest.mark.parametrize("name,D,gq", INT_QK_CASES, ids=[f"{n}-D{D}-gq{g}" for n, D, g in INT_QK_CASES])
def test_attention_int8_query(name, D, gq):
    """Decodes of int keys take the integer Q.K on every path (nuq3 keys: int_qk_reads):
    each row matches the int8-query reference at the tight tolerance and differs from the
    exact one (so the integer path really ran); KVQ_EXACT_QK=1 gives the exact attention.
    The int8 query's error vs the exact kernel, relative L2 per row, stays within twice
    what benchmarks/int8_query_error.py measured on random data (max 1.4e-2 per-token/group
    keys, 3.1e-2 per-channel keys: the folded query x * s has a wider range than x)."""
    fmt = parse_format(name)
    B = max(32, fmt.residual_chunk)
    levels = tuple(skewed_levels(x.bits) if x.encoding == "nuq" else None
                   for x in (fmt.key, fmt.value))
    c = build_case(name, D, B, gq=gq, H=2, dtype=torch.float32,
                   seqs=[(300, 1), (97, 1), (B + 5, 1)], seed=_seed(name, "iq"), levels=levels)
    n = int(c["query_start_loc"][-1])
    exact, approx = run_ref(c)[:n], run_ref_int8q(c)[:n]
    for path in PATHS:
        out = run_mine(c, path)
        if not int_qk_reads(fmt, path):
            assert_attn_close(out, exact, torch.float32, what=f"{name} {path}")
            continue
        want = run_ref_int8q(with_byte_values(c))[:n] if pv_byte_runs(path, fmt) else approx
        assert _rows_close(out, want, torch.float32).all(), f"{name} {path}"
        assert not _rows_close(out, exact, torch.float32).all(), f"{name} {path}: exact?"
        rel = (out - exact).norm(dim=-1) / exact.norm(dim=-1)
        bound = 3.1e-2 if fmt.key.granularity == "channel" else 1.4e-2
        assert rel.max().item() <= 2 * bound, f"{name} {path}: rel err {rel.max():.3g}"
        with env_var("KVQ_EXACT_QK", "1"):
            exact_qk = run_ref(with_byte_values(c))[:n] if pv_byte_runs(path, fmt) else exact
            assert_attn_close(run_mine(c, path), exact_qk, torch.float32, what=f"{name} {path}")


@pytest.mark.skipif("avx2" not in PATHS, reason="this CPU has no avx2")
@pytest.mark.parametrize("D", [128, 96])
def test_3bit_key_repack_with_and_without_pdep(D, monkeypatch):
    """The AVX2 path repacks 3-bit keys to 4 bits for the integer Q.K, 64 codes at a time
    in one register (cvt3to4_64), the rest of a row (D = 96: 32 codes) 16 at a time with
    BMI2 pdep where pdep is fast, else with vector shuffles (AMD Zen 1/2; KVQ_NO_PDEP=1
    forces them): the same bytes, so the same attention bit for bit, and the int8-query
    reference's."""
    c = build_case("int3_group32", D, 32, gq=4, H=2, dtype=torch.float32,
                   seqs=[(300, 1), (97, 1), (45, 1)], seed=_seed("pdep"))
    fast = run_mine(c, "avx2")
    monkeypatch.setenv("KVQ_NO_PDEP", "1")
    shuffled = run_mine(c, "avx2")
    assert torch.equal(fast, shuffled)
    assert_attn_close(shuffled, run_refs(c), torch.float32)


def fast_and_exact(c, path, exact_var, ref, monkeypatch, what):
    """A bf16 case's output on one path as it runs and with exact_var=1 (that approximation
    off), each matched against ref (a tensor or run_refs' list) at bf16's tolerance."""
    out = run_mine(c, path)
    assert_attn_close(out, ref, torch.bfloat16, what=what)
    monkeypatch.setenv(exact_var, "1")
    exact = run_mine(c, path)
    monkeypatch.delenv(exact_var)
    assert_attn_close(exact, ref, torch.bfloat16, what=f"{what} exact")
    return out, exact


# (head_dim, gq): vdpbf16ps reads 32 channels a step (80: not a multiple, the fp32 FMAs stay);
# 1 to 16 query rows per kv head (qk_bf16's row blocks 1, 3, 4, 8, 16)
BF16DP_CASES = [(64, 3), (96, 8), (128, 4), (256, 1), (128, 16), (80, 3)]


@pytest.mark.parametrize("D,gq", BF16DP_CASES, ids=[f"D{D}-gq{g}" for D, g in BF16DP_CASES])
def test_bf16_query_on_bf16_keys(D, gq, monkeypatch):
    """A bf16 query's decode on bf16 keys takes vdpbf16ps (attn_body.h qk_bf16) on the
    AVX-512 path of a CPU with AVX512-BF16: the raw bf16 pairs multiplied exactly, the
    softmax scale applied to the logit. Every path matches the exact reference at bf16's
    tolerance, with and without KVQ_EXACT_QK=1 (fp32 FMAs). (The two differ by fp32
    rounding in the logits, which a bf16 output almost never shows, so this test cannot
    tell which ran: that qk_bf16 runs shows in benchmarks/bench_cpu_attention.py's bf16 row,
    KVQ_EXACT_QK=1 against unset.)"""
    c = build_case("bf16", D, 32, gq=gq, H=2, dtype=torch.bfloat16,
                   seqs=[(300, 1), (97, 1), (45, 1)], seed=_seed("bf16dp", D, gq))
    ref = run_ref(c)
    for path in PATHS:
        fast_and_exact(c, path, "KVQ_EXACT_QK", ref, monkeypatch, f"D{D} gq{gq} {path}")


# (format, head_dim, gq): 4/3/2-bit int and nuq values with per-token / per-group scales
# (pv_bf16), 8-bit int ones (pv_i16); the row blocks they run (1 to 4, 8) and 16 rows, which
# keep the fp32 weights
PV_BF16_CASES = [("int4_group32", 64, 3), ("kivi2", 128, 4), ("int2_token", 128, 8),
                 ("nuq4", 256, 1), ("nuq2", 64, 2), ("kivi4", 128, 16), ("bf16", 128, 4),
                 ("bf16", 256, 1), ("bf16", 80, 3), ("nuq3", 128, 4), ("int3_group32", 64, 3),
                 ("int3_group32", 96, 2), ("int8_token", 128, 4), ("int8_group32", 64, 3),
                 ("int8_token", 256, 8), ("int8_token", 64, 16)]


def pv_bf16_runs(path: str, D: int, gq: int, fmt=None) -> bool:
    """Whether a bf16 query's decode P.V of such values takes rounded weights (attn_body.h
    pv_bf16: bf16 weights of 4/3/2-bit and bf16 values; pv_i16: int16 weights of 8-bit int
    values, fmt given, which also needs VNNI): the AVX-512 path of a CPU with AVX512-BF16 and
    VBMI, up to 8 rows per kv head, 32 channels a step."""
    int8 = fmt is not None and fmt.value.encoding == "int" and fmt.value.bits == 8
    need = {"avx512_bf16", "avx512vbmi"} | ({"avx512_vnni"} if int8 else set())
    return path == "avx512" and need <= _cpu_flags() and gq <= 8 and D % 32 == 0


@pytest.mark.parametrize("name,D,gq", PV_BF16_CASES,
                         ids=[f"{n}-D{D}-gq{g}" for n, D, g in PV_BF16_CASES])
def test_bf16_weights_in_the_decode_pv(name, D, gq, monkeypatch):
    """A bf16 query's decode P.V of 4/3/2-bit values may take bf16 weights P * s (attn_body.h
    pv_bf16: two tokens per vdpbf16ps, the values centred on their range), and of bf16
    values bf16 weights P (as flash attention rounds P to the value dtype); KVQ_EXACT_PV=1
    keeps the fp32 weights. Every path matches the references at bf16's tolerance either
    way; where pv_bf16 runs the two outputs differ (so it ran), by at most 2^-7 relative L2
    per row (measured 2.9e-3 to 3.8e-3 on these cases; one bf16 rounding of the output is
    ~1e-3), and elsewhere they are equal. 8-bit int values take int16 weights instead
    (pv_i16, each within 2^-16 of the tile's largest weight), held to the same bound.
    KVQ_EXACT_PV=1 also turns off the AVX2 path's byte levels of nuq 4-bit values
    (pv_byte_runs), held to the same bound."""
    fmt = parse_format(name)
    B = max(32, fmt.residual_chunk)
    levels = tuple(skewed_levels(x.bits) if x.encoding == "nuq" else None
                   for x in (fmt.key, fmt.value))
    c = build_case(name, D, B, gq=gq, H=2, dtype=torch.bfloat16, levels=levels,
                   seqs=[(300, 1), (97, 1), (B + 5, 1), (1000, 1)],
                   seed=_seed("pvbf16", name, D, gq))
    refs = run_refs(c)
    for path in PATHS:
        out, exact = fast_and_exact(c, path, "KVQ_EXACT_PV", refs, monkeypatch, f"{name} {path}")
        if not (pv_bf16_runs(path, D, gq, fmt) or pv_byte_runs(path, fmt)):
            assert torch.equal(out, exact), f"{name} {path}"
            continue
        assert not torch.equal(out, exact), f"{name} {path}: the approximation did not run"
        rel = (out.float() - exact.float()).norm(dim=-1) / exact.float().norm(dim=-1)
        print(name, D, gq, path, f"{rel.max().item():.3g}")
        assert rel.max().item() <= 2 ** -7, f"{name} {path}: rel err {rel.max():.3g}"


@pytest.mark.parametrize("name", ["int4_group32", "kivi2_k16_g16_r32"])
def test_prefill_chunks_take_the_exact_qk(name):
    """Only decodes (a sequence's single query this step) take the int8 query: the rows of
    a prefill chunk compute what a whole prefill computes. 64 queries at gq=3 used to leave
    a one-row tile (21+21+21+1) that ran the decode body, and an e2e chunked prefill then
    stored other codes than a whole one for the rows after it."""
    B = max(32, parse_format(name).residual_chunk)
    c = build_case(name, 64, B, gq=3, H=3, dtype=torch.float32,
                   seqs=[(300, 64), (300, 1), (200, 22)], seed=_seed(name, "chunk"))
    n = int(c["query_start_loc"][-1])
    exact, approx = run_ref(c)[:n], run_ref_int8q(c)[:n]
    prefill = torch.ones(n, dtype=torch.bool)
    prefill[64] = False  # the decode row
    for path in PATHS:
        out = run_mine(c, path)
        assert_attn_close(out[prefill], exact[prefill], torch.float32, what=f"{name} {path}")
        assert _rows_close(out[64:65], approx[64:65], torch.float32).all(), f"{name} {path}"
