"""Plain-PyTorch reference of every format and of paged attention: the oracle for kernels.

Float32 math, loops over tokens and groups where that is clearest; slow by design.
The rules are those of csrc/kvq_numeric.h (non-finite policy, fp16 scales, RNE rounding);
byte offsets come from the layout (csrc/kvq_layout.h via `KVFormat.layout`).

Residual semantics (shared with the kernels and the vLLM backend): tokens are quantized in
aligned chunks of R = fmt.residual_chunk tokens. A query at position p reads positions
< F(p+1) = floor((p+1)/R)*R from the quantized pages and positions in [F(p+1), p] in full
precision from a staging tensor. So prefill, chunked prefill and decode of the same token
all see exactly the same K/V. With R = 1 every position is read from the pages.

nuq codecs take a codebook `levels` (float32 [2^bits], ascending in [-1, 1]; one per layer
and side); outlier slots follow kvq::select_outliers (csrc/kvq_numeric.h).

Rotated formats (vllm_kvq.rotation): write_cache stores K R and V R; paged_attention rotates
the staging rows (in their dtype, as vllm_kvq.ops does) and the query (in fp32, as the CPU
kernel does) and returns the output rotated back in fp32, rounded once.

Attention sink (_sink formats, codec.sink = 1): a block's first token is also stored as an
int8 row with a float32 scale (vllm_kvq.residual.quantize_window_rows) in each region's
sink field; paged_attention reads a sequence's position 0 from its first block's sink row,
as float32 (codes * scale), wherever it would read it from the pages.
"""
from __future__ import annotations

import math

import torch

from vllm_kvq import rotation
from vllm_kvq.formats import Codec, KVFormat, Layout
from vllm_kvq.residual import dequantize_window_rows, quantize_window_rows

FP16_MAX = 65504.0
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    """Store-and-reload through a saturated fp16, as scales and zeros are stored."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=3.0e38, neginf=-3.0e38)


def _finite_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, fill))


# --- one group of values sharing a scale ---------------------------------------------------
def check_levels(levels, codec: Codec, what: str = "levels") -> torch.Tensor | None:
    """The codebook of a nuq codec as float32 [2^bits] (ascending, finite, in [-1, 1]);
    None for other codecs (which must not get one)."""
    if codec.encoding != "nuq":
        if levels is not None and torch.as_tensor(levels).numel():
            raise ValueError(f"{what}: codec {codec.describe()} takes no codebook")
        return None
    if levels is None:
        raise ValueError(f"{what} is required for the nuq codec {codec.describe()}: "
                         f"{2 ** codec.bits} float32 levels (from the calibration file)")
    t = torch.as_tensor(levels).detach().to(torch.float32).cpu().reshape(-1)
    n = 2 ** codec.bits
    if t.numel() != n:
        raise ValueError(f"{what} has {t.numel()} levels; codec {codec.describe()} needs {n}")
    if not bool(torch.isfinite(t).all()) or bool((t.abs() > 1).any()):
        raise ValueError(f"{what} must be finite and within [-1, 1], got {t.tolist()}")
    if bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{what} must be sorted ascending, got {t.tolist()}")
    return t


def uniform_levels(bits: int) -> torch.Tensor:
    """The uniform codebook -1 + 2k/(2^b - 1): nuq with it is int asymmetric (up to the fp16
    rounding of scale and zero)."""
    n = 2 ** bits
    return (torch.arange(n, dtype=torch.float64) * 2 / (n - 1) - 1).to(torch.float32)


def uniform_codebooks(fmt) -> dict:
    """k_levels / v_levels for a format's nuq sides (the uniform codebook), None for its other
    sides: the keyword arguments of ops / LayerOps / read_block in tests and benchmarks,
    where a codebook's levels do not matter (speed, kernel-vs-reference agreement)."""
    return {f"{s}_levels": uniform_levels(c.bits) if c.encoding == "nuq" else None
            for s, c in (("k", fmt.key), ("v", fmt.value))}


def nuq_midpoints(levels: torch.Tensor) -> torch.Tensor:
    """fp32 (level[k] + level[k+1]) * 0.5: a value above mid[k] takes a code > k."""
    return (levels[:-1] + levels[1:]) * 0.5


def quantize_groups(x: torch.Tensor, codec: Codec, static_scale: float | None = None,
                    levels: torch.Tensor | None = None, stats: torch.Tensor | None = None):
    """Quantize along the last dim (each row of x is one scale group).

    stats: the values the group's scale is computed from (x with its outliers set to NaN,
    so they are left out); defaults to x.
    Returns (codes int32 [..., n], scale f32 [...], zero f32 [...]); for fp8 the codes are
    the fp8 bit patterns, for float formats the 16-bit patterns.
    """
    x = x.to(torch.float32)
    st = x if stats is None else stats.to(torch.float32)
    if codec.is_float:
        dt = FLOAT_DTYPES[codec.encoding]
        codes = x.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
        return codes, torch.zeros(x.shape[:-1]), torch.zeros(x.shape[:-1])
    finite = torch.isfinite(st)
    if codec.encoding.startswith("fp8"):
        m = FP8_MAX[codec.encoding]
        if static_scale is not None:
            scale = torch.full(x.shape[:-1], float(static_scale))
        else:
            amax = _finite_or(st.abs(), 0.0).amax(-1)
            scale = _fp16_round(amax / m)
        xs = _sanitize(x)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        y = (xs / safe).clamp(-m, m)
        y = torch.where(scale.unsqueeze(-1) > 0, y, torch.zeros_like(y))
        codes = y.to(FP8_DTYPES[codec.encoding]).view(torch.uint8).to(torch.int32)
        return codes, scale, torch.zeros_like(scale)
    assert codec.encoding in ("int", "nuq"), codec
    b = codec.bits
    xs = _sanitize(x)
    if codec.symmetric:
        half = 2 ** (b - 1) - 1
        if static_scale is not None:
            scale = torch.full(x.shape[:-1], float(static_scale))
        else:
            scale = _fp16_round(_finite_or(st.abs(), 0.0).amax(-1) / half)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        q = torch.round(xs / safe).clamp(-half, half)
        q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
        return (q + 2 ** (b - 1)).to(torch.int32), scale, torch.zeros_like(scale)
    any_finite = finite.any(-1)
    lo = torch.where(any_finite, _finite_or(st, math.inf).amin(-1), torch.zeros(x.shape[:-1]))
    hi = torch.where(any_finite, _finite_or(st, -math.inf).amax(-1), torch.zeros(x.shape[:-1]))
    if codec.encoding == "nuq":
        lv = check_levels(levels, codec)
        scale = _fp16_round((hi - lo) / 2)
        zero = _fp16_round((hi + lo) / 2)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        y = (xs - zero.unsqueeze(-1)) / safe
        q = (y.unsqueeze(-1) > nuq_midpoints(lv)).sum(-1)
        q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
        return q.to(torch.int32), scale, zero
    nlev = 2 ** b - 1
    scale = _fp16_round((hi - lo) / nlev)
    zero = _fp16_round(lo)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.round((xs - zero.unsqueeze(-1)) / safe).clamp(0, nlev)
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.to(torch.int32), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      codec: Codec, levels: torch.Tensor | None = None) -> torch.Tensor:
    if codec.is_float:
        dt = FLOAT_DTYPES[codec.encoding]
        return codes.to(torch.int16).view(dt).to(torch.float32)
    if codec.encoding.startswith("fp8"):
        v = codes.to(torch.uint8).view(FP8_DTYPES[codec.encoding]).to(torch.float32)
        return v * scale.unsqueeze(-1)
    if codec.encoding == "nuq":
        lv = check_levels(levels, codec)
        return lv[codes.long()] * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    if codec.symmetric:
        return (codes.to(torch.float32) - 2 ** (codec.bits - 1)) * scale.unsqueeze(-1)
    return codes.to(torch.float32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)


# --- sparse outliers (kvq::select_outliers) ------------------------------------------------
def select_outliers(x: torch.Tensor, n: int) -> torch.Tensor:
    """Channels [T, n] (int64, -1 = empty slot) of the n finite values of largest |x| of
    each row of x [T, D]; equal |x|: the lower channel first; in that order."""
    x = x.to(torch.float32)
    key = torch.where(torch.isfinite(x), x.abs(), torch.full_like(x, -1.0))
    vals, idx = torch.sort(key, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :n], idx[:, :n]
    return torch.where(vals >= 0, idx, torch.full_like(idx, -1))


def outlier_stats(x: torch.Tensor, chans: torch.Tensor) -> torch.Tensor:
    """x [T, D] with its outliers set to NaN: what the dense scales are computed from."""
    st = x.to(torch.float32).clone()
    rows, cols = (chans >= 0).nonzero(as_tuple=True)
    st[rows, chans[rows, cols]] = float("nan")
    return st


def outlier_corrections(x: torch.Tensor, dense: torch.Tensor, chans: torch.Tensor) -> torch.Tensor:
    """The stored (fp16, saturated) corrections of the slots: x - dense at each slot's
    channel, dense the codec's decode of the codes written there; 0 for empty slots."""
    c = chans.clamp(min=0)
    v = x.to(torch.float32).gather(1, c) - dense.gather(1, c)
    return _fp16_round(torch.where(chans >= 0, v, torch.zeros_like(v)))


def apply_outliers(dense: torch.Tensor, chans: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """dense [T, D] plus the stored corrections at their channels (slots whose channel is
    empty or not below D are ignored)."""
    out = dense.clone()
    D = dense.shape[-1]
    ok = (chans >= 0) & (chans < D)
    rows, cols = ok.nonzero(as_tuple=True)
    out[rows, chans[rows, cols]] += deltas[rows, cols].to(torch.float32)
    return out


def outlier_overflow(x: torch.Tensor, n: int, threshold: float) -> int:
    """How many finite values of rows x [T, D] have |x| > threshold but did not fit in the
    n slots of their token (they fall back to the dense path)."""
    x = x.to(torch.float32)
    big = torch.isfinite(x) & (x.abs() > threshold)
    if n:
        chans = select_outliers(x, n)
        rows, cols = (chans >= 0).nonzero(as_tuple=True)
        big[rows, chans[rows, cols]] = False
    return int(big.sum())


def quantize_rows(x: torch.Tensor, codec: Codec, static_scale: float | None = None,
                  levels: torch.Tensor | None = None, decode: bool = True):
    """Rows x [T, D] through the codec's scale groups (per-channel: T a multiple of G, the
    groups aligned to row 0), outlier slots included: (codes [T, D] int32, scale, zero
    (flat, in the order of the page's scale rows), slot channels [T, n] (None without
    slots), their corrections, the decode [T, D] with the corrections added (None when
    decode is False and the codec has no slots)). static_scale: per-token codecs only."""
    T, D = x.shape
    x = x.to(torch.float32)
    st, chans = x, None
    if codec.outliers:
        chans = select_outliers(x, codec.outliers)
        st = outlier_stats(x, chans)
    if codec.granularity == "channel":
        G = codec.group
        if T % G:
            raise ValueError(f"per-channel groups need whole groups of {G} tokens, got {T}")
        groups = lambda t: t.reshape(T // G, G, D).transpose(1, 2)  # a channel over G tokens
        rows = lambda t: t.transpose(1, 2).reshape(T, D)
    elif codec.granularity == "group":
        groups = lambda t: t.reshape(T, D // codec.group, codec.group)
        rows = lambda t: t.reshape(T, D)
    else:
        groups = rows = lambda t: t
    ss = static_scale if codec.granularity not in ("channel", "group") else None
    codes, scale, zero = quantize_groups(groups(x), codec, ss, levels, groups(st))
    dense = corrections = None
    if decode or chans is not None:
        dense = rows(dequantize_groups(codes, scale, zero, codec, levels))
    if chans is not None:
        # after the dense codes: each slot stores x - (their decode) at its channel
        corrections = outlier_corrections(x, dense, chans)
        dense = apply_outliers(dense, chans, corrections)
    return rows(codes), scale.reshape(-1), zero.reshape(-1), chans, corrections, dense


def fake_quantize(x: torch.Tensor, codec: Codec, static_scale: float | None = None,
                  levels: torch.Tensor | None = None):
    """Round trip of rows of x [T, D] through the codec (per-channel: T a multiple of G),
    outlier slots included."""
    return quantize_rows(x, codec, static_scale, levels)[-1]


# --- bit packing (kvq::put_code / get_code) -------------------------------------------------
def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[T, D] codes -> [T, ceil(D*bits/8)] uint8, value i at bits [i*b, i*b+b) little-endian."""
    T, D = codes.shape
    if bits == 16:
        return codes.to(torch.int16).contiguous().view(torch.uint8).reshape(T, 2 * D)
    if bits == 8:
        return codes.to(torch.uint8)
    nbytes = (D * bits + 7) // 8
    bitpos = torch.arange(D) * bits
    out = torch.zeros(T, nbytes + 1, dtype=torch.int64)
    c = codes.to(torch.int64)
    lo = (c << (bitpos % 8)) & 0xFF
    hi = (c << (bitpos % 8)) >> 8
    out.index_add_(1, bitpos // 8, lo)
    out.index_add_(1, bitpos // 8 + 1, hi)
    return out[:, :nbytes].to(torch.uint8)


def unpack_rows(rows: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    T = rows.shape[0]
    if bits == 16:
        return rows.contiguous().view(torch.int16).reshape(T, D).to(torch.int32) & 0xFFFF
    if bits == 8:
        return rows.to(torch.int32)
    r = torch.cat([rows.to(torch.int64), torch.zeros(T, 1, dtype=torch.int64)], 1)
    bitpos = torch.arange(D) * bits
    w = r[:, bitpos // 8] | (r[:, bitpos // 8 + 1] << 8)
    return ((w >> (bitpos % 8)) & ((1 << bits) - 1)).to(torch.int32)


# --- one (block, kv_head) plane -------------------------------------------------------------
def _field(plane: torch.Tensor, off: int, nbytes: int) -> torch.Tensor:
    return plane[off:off + nbytes]


def _fp16_field(plane, off, n) -> torch.Tensor:
    return _field(plane, off, 2 * n).view(torch.float16).to(torch.float32)


def encode_rows_into_plane(plane: torch.Tensor, region: dict, codec: Codec, t0: int,
                           x: torch.Tensor, static_scale: float,
                           levels: torch.Tensor | None = None) -> None:
    """Write tokens t0..t0+T-1 of x [T, D] into one tensor region of a plane (uint8 [P]).

    Per-channel codecs need whole aligned groups: t0 % G == 0 and T % G == 0.
    """
    T = x.shape[0]
    rb = region["row_bytes"]
    cols = region["scale_cols"]
    if codec.granularity == "channel" and t0 % codec.group:
        raise ValueError(f"per-channel groups need whole aligned groups of {codec.group} "
                         f"tokens, got tokens {t0}..{t0 + T - 1}")
    if t0 < codec.sink:  # the block's first tokens again, as int8 rows
        n = min(codec.sink, t0 + T) - t0
        rows = quantize_window_rows(x[:n]).reshape(-1)
        off = region["sink_off"] + t0 * (region["sink_bytes"] // codec.sink)
        plane[off:off + rows.numel()] = rows
    codes, scales, zeros, chans, corrections, _ = quantize_rows(
        x, codec, static_scale if codec.static_scale else None, levels, decode=False)
    srow0 = t0 // codec.group if codec.granularity == "channel" else t0
    if chans is not None:
        n = codec.outliers
        slots = torch.empty(T, n, 2, dtype=torch.int16)
        slots[..., 0] = torch.where(chans >= 0, chans, torch.full_like(chans, 0xFFFF)).to(
            torch.int32).to(torch.int16)
        slots[..., 1] = corrections.to(torch.float16).view(torch.int16)
        o_off = region["outlier_off"] + t0 * n * 4
        plane[o_off:o_off + T * n * 4] = slots.view(torch.uint8).reshape(-1)
    plane[region["data_off"] + t0 * rb: region["data_off"] + (t0 + T) * rb] = \
        pack_rows(codes, codec.bits).reshape(-1)
    if region["scale_bytes"]:
        n = scales.numel()
        s_off = region["scale_off"] + srow0 * cols * 2
        plane[s_off:s_off + 2 * n] = scales.to(torch.float16).view(torch.uint8)
        if region["zero_bytes"]:
            z_off = region["zero_off"] + srow0 * cols * 2
            plane[z_off:z_off + 2 * n] = zeros.to(torch.float16).view(torch.uint8)


def read_outliers(plane: torch.Tensor, region: dict, codec: Codec, B: int):
    """The outlier slots of all B tokens: channels [B, n] int64 (-1 = empty), corrections
    [B, n] float32."""
    n = codec.outliers
    raw = _field(plane, region["outlier_off"], B * n * 4).view(torch.int16).reshape(B, n, 2)
    chans = raw[..., 0].to(torch.int64) & 0xFFFF
    chans = torch.where(chans == 0xFFFF, torch.full_like(chans, -1), chans)
    return chans, raw[..., 1].view(torch.float16).to(torch.float32)


def decode_plane_region(plane: torch.Tensor, region: dict, codec: Codec, D: int, B: int,
                        static_scale: float, levels: torch.Tensor | None = None) -> torch.Tensor:
    """All B tokens of one tensor region of a plane -> float32 [B, D]."""
    out = _decode_dense(plane, region, codec, D, B, static_scale, levels)
    if codec.outliers:
        out = apply_outliers(out, *read_outliers(plane, region, codec, B))
    return out


def _decode_dense(plane, region, codec, D, B, static_scale, levels):
    rows = _field(plane, region["data_off"], region["data_bytes"]).reshape(B, region["row_bytes"])
    codes = unpack_rows(rows, codec.bits, D)
    if codec.is_float:
        return dequantize_groups(codes, None, None, codec)
    n = region["scale_rows"] * region["scale_cols"]
    if codec.static_scale:
        scale = torch.full((B,), float(static_scale))
        zero = torch.zeros(B)
        return dequantize_groups(codes, scale, zero, codec, levels)
    scale = _fp16_field(plane, region["scale_off"], n).reshape(region["scale_rows"], -1)
    zero = (_fp16_field(plane, region["zero_off"], n).reshape(region["scale_rows"], -1)
            if region["zero_bytes"] else torch.zeros_like(scale))
    if codec.granularity == "token":
        return dequantize_groups(codes, scale[:, 0], zero[:, 0], codec, levels)
    if codec.granularity == "group":
        g = codec.group
        c = codes.reshape(B, D // g, g)
        return dequantize_groups(c, scale, zero, codec, levels).reshape(B, D)
    G = codec.group  # channel: scale [B/G, D]
    c = codes.reshape(B // G, G, D).transpose(1, 2)
    return dequantize_groups(c, scale, zero, codec, levels).transpose(1, 2).reshape(B, D)


# --- paged cache ---------------------------------------------------------------------------
def new_cache(num_blocks: int, num_kv_heads: int, layout: Layout) -> torch.Tensor:
    """The byte tensor vLLM hands a layer: [num_blocks, num_kv_heads, block_size, C]."""
    return torch.zeros(num_blocks, num_kv_heads, layout.block_size, layout.token_bytes,
                       dtype=torch.uint8)


def _planes(cache: torch.Tensor) -> torch.Tensor:
    nb, H = cache.shape[:2]
    return cache.view(nb, H, -1)


def _scales(s, H) -> list[float]:
    if s is None:
        return [1.0] * H
    s = torch.as_tensor(s, dtype=torch.float32).reshape(-1)
    return (s.expand(H) if s.numel() == 1 else s).tolist()


def write_cache(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                slot_mapping: torch.Tensor, fmt: KVFormat, layout: Layout,
                k_scale=None, v_scale=None, k_levels=None, v_levels=None) -> None:
    """Quantize tokens [N, H, D] into their slots (slot -1 = padding, skipped).
    k_levels/v_levels: the codebooks of nuq codecs (float32 [2^bits]).

    Per-channel codecs quantize consecutive entries that fill an aligned group of G slots;
    any entry of such a codec outside a whole group is an error.
    """
    N, H = key.shape[:2]
    if fmt.rotation != "none":
        key, value = rotation.for_cache(key, value, rotation.rotates_keys(fmt.rotation))
    B = layout.block_size
    planes = _planes(cache)
    slots = slot_mapping.tolist()
    ks, vs = _scales(k_scale, H), _scales(v_scale, H)
    kl = check_levels(k_levels, fmt.key, "k_levels")
    vl = check_levels(v_levels, fmt.value, "v_levels")
    for x, codec, region, st, lv in ((key, fmt.key, layout.k, ks, kl),
                                     (value, fmt.value, layout.v, vs, vl)):
        step = codec.group if codec.granularity == "channel" else 1
        i = 0
        while i < N:
            s = slots[i]
            if s < 0:
                i += 1
                continue
            run = slots[i:i + step]
            if step > 1 and (s % step or run != list(range(s, s + step))):
                raise ValueError(f"per-channel codec needs whole aligned groups of {step} "
                                 f"slots; entry {i} (slot {s}) starts none")
            # then every following step of consecutive slots in the same block: one encode
            # per run (tokens and scale groups are independent, so the same bytes)
            blk, off = divmod(s, B)
            n = step
            while (i + n + step <= N and off + n + step <= B
                   and slots[i + n:i + n + step] == list(range(s + n, s + n + step))):
                n += step
            for h in range(H):
                encode_rows_into_plane(planes[blk, h], region, codec, off,
                                       x[i:i + n, h], st[h], lv)
            i += n


def read_block(cache: torch.Tensor, block: int, head: int, fmt: KVFormat, layout: Layout,
               k_scale=None, v_scale=None, k_levels=None,
               v_levels=None) -> tuple[torch.Tensor, torch.Tensor]:
    H = cache.shape[1]
    plane = _planes(cache)[block, head]
    D, B = layout.head_dim, layout.block_size
    k = decode_plane_region(plane, layout.k, fmt.key, D, B, _scales(k_scale, H)[head],
                            check_levels(k_levels, fmt.key, "k_levels"))
    v = decode_plane_region(plane, layout.v, fmt.value, D, B, _scales(v_scale, H)[head],
                            check_levels(v_levels, fmt.value, "v_levels"))
    return k, v


def read_sink(cache: torch.Tensor, block: int, head: int, layout: Layout) -> tuple:
    """The sink rows (K, V) of one plane as float32 [sink, D]: codes * scale."""
    plane = _planes(cache)[block, head]

    def rows(r):
        raw = _field(plane, r["sink_off"], r["sink_bytes"]).reshape(1, r["sink_bytes"])
        return dequantize_window_rows(raw, torch.float32)
    return rows(layout.k), rows(layout.v)


def paged_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, fmt: KVFormat,
                    layout: Layout, softmax_scale: float, k_scale=None, v_scale=None,
                    staging_k: torch.Tensor | None = None,
                    staging_v: torch.Tensor | None = None,
                    staging_start_loc: torch.Tensor | None = None,
                    staging_pos0: torch.Tensor | None = None,
                    k_levels=None, v_levels=None, sliding_window: int = 0,
                    logits_soft_cap: float = 0.0) -> torch.Tensor:
    """Causal attention of a mixed batch (prefills, chunks, decodes) over a paged cache.

    query [T, Hq, D]; block_table [S, max_blocks]; seq_lens [S] (including this step's
    tokens); query_start_loc [S+1]. Staging (full-precision recent tokens, see module doc):
    staging_k/v [Ns, Hk, D], request s's rows start at staging_start_loc[s] and hold
    positions staging_pos0[s].. seq_lens[s]-1. sliding_window W > 0: a query at position p
    sees keys (p - W, p] only (vLLM's convention); blocks wholly before every query's window
    are not read (vLLM puts its null block there). logits_soft_cap c > 0 (Gemma 2): each
    logit x = softmax_scale * q.k becomes c * tanh(x / c) before the softmax.
    """
    T, Hq, D = query.shape
    rot = fmt.rotation != "none"
    dtype = query.dtype
    if rot:  # the query in fp32 (the CPU kernel rotates it as it loads it, not rounded)
        keys = rotation.rotates_keys(fmt.rotation)
        staging_k, staging_v = rotation.for_staging(staging_k, staging_v, keys)
        query = rotation.rotate(query, torch.float32) if keys else query
    H = cache.shape[1]
    B = layout.block_size
    R = fmt.residual_chunk
    out = torch.zeros(T, Hq, D, dtype=torch.float32)
    for s in range(seq_lens.numel()):
        L = int(seq_lens[s])
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if q1 == q0:
            continue
        nblk = (L + B - 1) // B
        K = torch.zeros(H, nblk * B, D)
        V = torch.zeros(H, nblk * B, D)
        first = L - (q1 - q0)
        lo_blk = max(0, first - sliding_window + 1) // B if sliding_window else 0
        for j in range(lo_blk, nblk):
            for h in range(H):
                k, v = read_block(cache, int(block_table[s, j]), h, fmt, layout, k_scale, v_scale,
                                  k_levels, v_levels)
                K[h, j * B:(j + 1) * B], V[h, j * B:(j + 1) * B] = k, v
                if j == 0 and fmt.sink:  # position 0 from the sink (staging still wins)
                    sk, sv = read_sink(cache, int(block_table[s, 0]), h, layout)
                    K[h, :fmt.sink], V[h, :fmt.sink] = sk, sv
        for i in range(q1 - q0):
            p = first + i
            F = (p + 1) // R * R
            Kp, Vp = K[:, :p + 1].clone(), V[:, :p + 1].clone()
            if F <= p:
                st0, pos0 = int(staging_start_loc[s]), int(staging_pos0[s])
                rows = slice(st0 + F - pos0, st0 + p + 1 - pos0)
                Kp[:, F:] = staging_k[rows].transpose(0, 1).to(torch.float32)
                Vp[:, F:] = staging_v[rows].transpose(0, 1).to(torch.float32)
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            for hq in range(Hq):
                h = hq // (Hq // H)
                logits = (Kp[h, lo:] @ query[q0 + i, hq].to(torch.float32)) * softmax_scale
                if logits_soft_cap:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                out[q0 + i, hq] = torch.softmax(logits, 0) @ Vp[h, lo:]
    if rot:  # rotated back in fp32 and rounded once (as the CPU kernel does)
        return rotation.unrotate(out, dtype)
    return out.to(dtype)
