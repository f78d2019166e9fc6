"""Plain-PyTorch reference of every format and of paged attention: the oracle for kernels.

Float32 math, loops over tokens and groups where that is clearest; slow by design.
The rules are those of csrc/kvq_numeric.h (non-finite policy, fp16 scales, RNE rounding);
byte offsets come from the layout (csrc/kvq_layout.h via `KVFormat.layout`).

Residual semantics (shared with the kernels and the vLLM backend): tokens are quantized in
aligned chunks of R = fmt.residual_chunk tokens. A query at position p reads positions
< F(p+1) = floor((p+1)/R)*R from the quantized pages and positions in [F(p+1), p] in full
precision from a staging tensor. So prefill, chunked prefill and decode of the same token
all see exactly the same K/V. With R = 1 every position is read from the pages.
"""
from __future__ import annotations

import math

import torch

from vllm_kvq.formats import Codec, KVFormat, Layout

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
def quantize_groups(x: torch.Tensor, codec: Codec, static_scale: float | None = None):
    """Quantize along the last dim (each row of x is one scale group).

    Returns (codes int32 [..., n], scale f32 [...], zero f32 [...]); for fp8 the codes are
    the fp8 bit patterns, for float formats the 16-bit patterns.
    """
    x = x.to(torch.float32)
    if codec.is_float:
        dt = FLOAT_DTYPES[codec.encoding]
        codes = x.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
        return codes, torch.zeros(x.shape[:-1]), torch.zeros(x.shape[:-1])
    finite = torch.isfinite(x)
    if codec.encoding.startswith("fp8"):
        m = FP8_MAX[codec.encoding]
        if static_scale is not None:
            scale = torch.full(x.shape[:-1], float(static_scale))
        else:
            amax = _finite_or(x.abs(), 0.0).amax(-1)
            scale = _fp16_round(amax / m)
        xs = _sanitize(x)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        y = (xs / safe).clamp(-m, m)
        y = torch.where(scale.unsqueeze(-1) > 0, y, torch.zeros_like(y))
        codes = y.to(FP8_DTYPES[codec.encoding]).view(torch.uint8).to(torch.int32)
        return codes, scale, torch.zeros_like(scale)
    assert codec.encoding == "int", codec
    b = codec.bits
    xs = _sanitize(x)
    if codec.symmetric:
        half = 2 ** (b - 1) - 1
        if static_scale is not None:
            scale = torch.full(x.shape[:-1], float(static_scale))
        else:
            scale = _fp16_round(_finite_or(x.abs(), 0.0).amax(-1) / half)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        q = torch.round(xs / safe).clamp(-half, half)
        q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
        return (q + 2 ** (b - 1)).to(torch.int32), scale, torch.zeros_like(scale)
    levels = 2 ** b - 1
    any_finite = finite.any(-1)
    lo = torch.where(any_finite, _finite_or(x, math.inf).amin(-1), torch.zeros(x.shape[:-1]))
    hi = torch.where(any_finite, _finite_or(x, -math.inf).amax(-1), torch.zeros(x.shape[:-1]))
    scale = _fp16_round((hi - lo) / levels)
    zero = _fp16_round(lo)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = torch.round((xs - zero.unsqueeze(-1)) / safe).clamp(0, levels)
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.to(torch.int32), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      codec: Codec) -> torch.Tensor:
    if codec.is_float:
        dt = FLOAT_DTYPES[codec.encoding]
        return codes.to(torch.int16).view(dt).to(torch.float32)
    if codec.encoding.startswith("fp8"):
        v = codes.to(torch.uint8).view(FP8_DTYPES[codec.encoding]).to(torch.float32)
        return v * scale.unsqueeze(-1)
    if codec.symmetric:
        return (codes.to(torch.float32) - 2 ** (codec.bits - 1)) * scale.unsqueeze(-1)
    return codes.to(torch.float32) * scale.unsqueeze(-1) + zero.unsqueeze(-1)


def fake_quantize(x: torch.Tensor, codec: Codec, static_scale: float | None = None):
    """Round trip of rows of x [T, D] through the codec (per-channel: T a multiple of G)."""
    T, D = x.shape
    if codec.granularity == "group":
        g = x.reshape(T, D // codec.group, codec.group)
        return dequantize_groups(*quantize_groups(g, codec), codec).reshape(T, D)
    if codec.granularity == "channel":
        G = codec.group
        g = x.reshape(T // G, G, D).transpose(1, 2)  # [T/G, D, G]: a channel over G tokens
        out = dequantize_groups(*quantize_groups(g, codec), codec)
        return out.transpose(1, 2).reshape(T, D)
    return dequantize_groups(*quantize_groups(x, codec, static_scale), codec)


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


def encode_rows_into_plane(plane: torch.Tensor, region: dict, codec: Codec, D: int,
                           t0: int, x: torch.Tensor, static_scale: float) -> None:
    """Write tokens t0..t0+T-1 of x [T, D] into one tensor region of a plane (uint8 [P]).

    Per-channel codecs need whole aligned groups: t0 % G == 0 and T % G == 0.
    """
    T = x.shape[0]
    rb = region["row_bytes"]
    cols = region["scale_cols"]
    if codec.granularity == "channel":
        G = codec.group
        if t0 % G or T % G:
            raise ValueError(f"per-channel groups need whole aligned groups of {G} tokens, "
                             f"got tokens {t0}..{t0 + T - 1}")
        g = x.to(torch.float32).reshape(T // G, G, D).transpose(1, 2)
        codes, scale, zero = quantize_groups(g, codec)
        codes = codes.transpose(1, 2).reshape(T, D)
        srow0, scales, zeros = t0 // G, scale.reshape(-1), zero.reshape(-1)
    elif codec.granularity == "group":
        g = x.to(torch.float32).reshape(T, D // codec.group, codec.group)
        codes, scale, zero = quantize_groups(g, codec)
        codes = codes.reshape(T, D)
        srow0, scales, zeros = t0, scale.reshape(-1), zero.reshape(-1)
    else:
        st = static_scale if codec.static_scale else None
        codes, scale, zero = quantize_groups(x, codec, st)
        srow0, scales, zeros = t0, scale.reshape(-1), zero.reshape(-1)
    plane[region["data_off"] + t0 * rb: region["data_off"] + (t0 + T) * rb] = \
        pack_rows(codes, codec.bits).reshape(-1)
    if region["scale_bytes"]:
        n = scales.numel()
        s_off = region["scale_off"] + srow0 * cols * 2
        plane[s_off:s_off + 2 * n] = scales.to(torch.float16).view(torch.uint8)
        if region["zero_bytes"]:
            z_off = region["zero_off"] + srow0 * cols * 2
            plane[z_off:z_off + 2 * n] = zeros.to(torch.float16).view(torch.uint8)


def decode_plane_region(plane: torch.Tensor, region: dict, codec: Codec, D: int, B: int,
                        static_scale: float) -> torch.Tensor:
    """All B tokens of one tensor region of a plane -> float32 [B, D]."""
    rows = _field(plane, region["data_off"], region["data_bytes"]).reshape(B, region["row_bytes"])
    codes = unpack_rows(rows, codec.bits, D)
    if codec.is_float:
        return dequantize_groups(codes, None, None, codec)
    n = region["scale_rows"] * region["scale_cols"]
    if codec.static_scale:
        scale = torch.full((B,), float(static_scale))
        zero = torch.zeros(B)
        return dequantize_groups(codes, scale, zero, codec)
    scale = _fp16_field(plane, region["scale_off"], n).reshape(region["scale_rows"], -1)
    zero = (_fp16_field(plane, region["zero_off"], n).reshape(region["scale_rows"], -1)
            if region["zero_bytes"] else torch.zeros_like(scale))
    if codec.granularity == "token":
        return dequantize_groups(codes, scale[:, 0], zero[:, 0], codec)
    if codec.granularity == "group":
        g = codec.group
        c = codes.reshape(B, D // g, g)
        return dequantize_groups(c, scale, zero, codec).reshape(B, D)
    G = codec.group  # channel: scale [B/G, D]
    c = codes.reshape(B // G, G, D).transpose(1, 2)
    return dequantize_groups(c, scale, zero, codec).transpose(1, 2).reshape(B, D)


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
                k_scale=None, v_scale=None) -> None:
    """Quantize tokens [N, H, D] into their slots (slot -1 = padding, skipped).

    Per-channel codecs quantize consecutive entries that fill an aligned group of G slots;
    any entry of such a codec outside a whole group is an error.
    """
    N, H, D = key.shape
    B = layout.block_size
    planes = _planes(cache)
    slots = slot_mapping.tolist()
    ks, vs = _scales(k_scale, H), _scales(v_scale, H)
    for x, codec, region, st in ((key, fmt.key, layout.k, ks), (value, fmt.value, layout.v, vs)):
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
            blk, off = divmod(s, B)
            for h in range(H):
                encode_rows_into_plane(planes[blk, h], region, codec, D, off,
                                       x[i:i + step, h], st[h])
            i += step


def read_block(cache: torch.Tensor, block: int, head: int, fmt: KVFormat, layout: Layout,
               k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    H = cache.shape[1]
    plane = _planes(cache)[block, head]
    D, B = layout.head_dim, layout.block_size
    k = decode_plane_region(plane, layout.k, fmt.key, D, B, _scales(k_scale, H)[head])
    v = decode_plane_region(plane, layout.v, fmt.value, D, B, _scales(v_scale, H)[head])
    return k, v


def paged_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, fmt: KVFormat,
                    layout: Layout, softmax_scale: float, k_scale=None, v_scale=None,
                    staging_k: torch.Tensor | None = None,
                    staging_v: torch.Tensor | None = None,
                    staging_start_loc: torch.Tensor | None = None,
                    staging_pos0: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch (prefills, chunks, decodes) over a paged cache.

    query [T, Hq, D]; block_table [S, max_blocks]; seq_lens [S] (including this step's
    tokens); query_start_loc [S+1]. Staging (full-precision recent tokens, see module doc):
    staging_k/v [Ns, Hk, D], request s's rows start at staging_start_loc[s] and hold
    positions staging_pos0[s].. seq_lens[s]-1.
    """
    T, Hq, D = query.shape
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
        for j in range(nblk):
            for h in range(H):
                k, v = read_block(cache, int(block_table[s, j]), h, fmt, layout, k_scale, v_scale)
                K[h, j * B:(j + 1) * B], V[h, j * B:(j + 1) * B] = k, v
        first = L - (q1 - q0)
        for i in range(q1 - q0):
            p = first + i
            F = (p + 1) // R * R
            Kp, Vp = K[:, :p + 1].clone(), V[:, :p + 1].clone()
            if F <= p:
                st0, pos0 = int(staging_start_loc[s]), int(staging_pos0[s])
                rows = slice(st0 + F - pos0, st0 + p + 1 - pos0)
                Kp[:, F:] = staging_k[rows].transpose(0, 1).to(torch.float32)
                Vp[:, F:] = staging_v[rows].transpose(0, 1).to(torch.float32)
            for hq in range(Hq):
                h = hq // (Hq // H)
                logits = (Kp[h] @ query[q0 + i, hq].to(torch.float32)) * softmax_scale
                out[q0 + i, hq] = torch.softmax(logits, 0) @ Vp[h]
    return out.to(query.dtype)
