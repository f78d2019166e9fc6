// The cache writer's scalar path: every number through the scalar rules of kvq_numeric.h
// (or a bit-exact fast equivalent checked against them in tests), so the planes are
// byte-identical to the PyTorch reference (vllm_kvq/reference.py::write_cache). The outlier
// slots, which both paths write, are here too.
#include "write_common.h"

namespace kvq_cpu {
namespace {

using kvq::Codec;
using kvq::Region;

// ---- bit-exact fast encoders -------------------------------------------------------------
// IEEE fp16 (not saturating: the fp16 baseline stores Inf as Inf), RNE, NaN -> sign|0x7e00
// like torch's cast.
inline uint16_t float_to_fp16_ieee(float x) {
  const uint32_t u = kvq::float_bits(x);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;
  if (a >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal, quantum 2^-24
    return sign | (uint16_t)rintf(kvq::bits_float(a) * 16777216.0f);
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return sign | (uint16_t)((r >> 13) - (112u << 10));
}

// fp8 of a finite value already clamped to +-fp8_max (same contract as kvq::float_to_fp8):
// MAN = 3 is e4m3 (normal from 2^-6, subnormal quantum 2^-9), MAN = 2 is e5m2 (2^-14, 2^-16).
template <int MAN>
inline uint8_t float_to_fp8_fast(float x) {
  constexpr bool e4 = MAN == 3;
  constexpr int drop = 23 - MAN;                                   // mantissa bits dropped
  constexpr uint32_t min_normal = e4 ? 0x3c800000u : 0x38800000u;  // 2^-6 / 2^-14
  constexpr float sub_per_quantum = e4 ? 512.0f : 65536.0f;        // 2^9 / 2^16
  constexpr uint32_t rebias = (e4 ? 120u : 112u) << MAN;           // float bias - fp8 bias
  const uint32_t u = kvq::float_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a < min_normal) return sign | (uint8_t)rintf(kvq::bits_float(a) * sub_per_quantum);
  const uint32_t r = a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);  // RNE
  return sign | (uint8_t)((r >> drop) - rebias);
}
inline uint8_t quantize_fp8_fast(float x, float scale, int32_t enc) {
  x = kvq::sanitize(x);
  if (!(scale > 0.0f)) return 0;
  const float m = kvq::fp8_max(enc);
  const float y = fminf(fmaxf(x / scale, -m), m);
  return enc == kvq::ENC_FP8_E4M3 ? float_to_fp8_fast<3>(y) : float_to_fp8_fast<2>(y);
}

// ---- one scale group -------------------------------------------------------------------
// x: n values (stride `xs` floats) sharing one scale.
inline kvq::QParams dyn_params(const Codec& c, const float* x, int n, int xs) {
  float lo = INFINITY, hi = -INFINITY, amax = 0.0f;
  bool any = false;
  for (int i = 0; i < n; ++i) {
    const float v = x[(int64_t)i * xs];
    if (!isfinite(v)) continue;
    any = true;
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
    amax = fmaxf(amax, fabsf(v));
  }
  return group_params(c, lo, hi, amax, any);
}

inline uint32_t encode_value(const SideQ& q, float x, const kvq::QParams& p) {
  const Codec& c = q.c;
  if (c.encoding == kvq::ENC_INT) return kvq::quantize_int(x, p, c.bits, c.symmetric != 0);
  if (c.encoding == kvq::ENC_NUQ) return kvq::quantize_nuq(x, p, q.mids, 1 << c.bits);
  return quantize_fp8_fast(x, p.scale, c.encoding);
}

}  // namespace

// The plane may be unaligned: the slots are written bytewise.
void encode_outliers(const Codec& c, const Region& r, uint8_t* plane, int t, const float* x,
                     int D, float* sx) {
  int32_t ch[64];
  const int n = kvq::select_outliers(x, D, c.outliers, ch);
  memcpy(sx, x, sizeof(float) * D);
  uint8_t* o = plane + r.outlier_off + (int64_t)t * c.outliers * (int64_t)sizeof(kvq::Outlier);
  for (int j = 0; j < c.outliers; ++j) {
    kvq::Outlier slot{kvq::kNoOutlier, 0};
    if (j < n) {
      slot.channel = (uint16_t)ch[j];
      sx[ch[j]] = NAN;
    }
    memcpy(o + j * sizeof(kvq::Outlier), &slot, sizeof(slot));
  }
}

// The dense decode at a slot's channel is the reference's dequantize_groups: the stored
// code with the stored (fp16) scale and zero, or the static scale.
void finish_outliers(const SideQ& q, const Region& r, uint8_t* plane, int t, const float* x,
                     int D, float static_scale) {
  const Codec& c = q.c;
  uint8_t* o = plane + r.outlier_off + (int64_t)t * c.outliers * (int64_t)sizeof(kvq::Outlier);
  const uint8_t* row = plane + r.data_off + (int64_t)t * r.row_bytes;
  auto fp16_at = [&](int32_t off, int64_t idx) {
    uint16_t h;
    memcpy(&h, plane + off + 2 * idx, 2);
    return kvq::fp16_to_float(h);
  };
  for (int j = 0; j < c.outliers; ++j) {
    kvq::Outlier slot;
    memcpy(&slot, o + j * sizeof(slot), sizeof(slot));
    if (slot.channel >= D) continue;  // empty
    const int ch = slot.channel;
    int64_t si = -1;  // the scale's index, -1: static
    if (c.granularity == kvq::GRAN_TOKEN) si = t;
    else if (c.granularity == kvq::GRAN_GROUP) si = (int64_t)t * (D / c.group) + ch / c.group;
    else if (c.granularity == kvq::GRAN_CHANNEL) si = (int64_t)(t / c.group) * D + ch;
    const float s = si < 0 ? static_scale : fp16_at(r.scale_off, si);
    const float z = si >= 0 && r.zero_bytes ? fp16_at(r.zero_off, si) : 0.0f;
    const uint32_t code = c.bits == 8 ? row[ch] : kvq::get_code(row, ch, c.bits);
    const float dense = c.encoding == kvq::ENC_NUQ
                            ? kvq::dequantize_nuq(code, s, z, q.levels)
                            : kvq::dequantize_int(code, s, z, c.bits, c.symmetric != 0);
    slot.value_fp16 = kvq::float_to_fp16_sat(x[ch] - dense);
    memcpy(o + j * sizeof(slot), &slot, sizeof(slot));
  }
}

namespace write_scalar {

void load_row(const RowSrc& s, int64_t i, int h, int D, float* out) {
  const uint8_t* p = s.base + i * s.stride_n + (int64_t)h * s.stride_h;
  switch (s.dt) {
    case IN_F32: memcpy(out, p, sizeof(float) * D); break;
    case IN_F16: {
      const uint16_t* q = (const uint16_t*)p;
      for (int d = 0; d < D; ++d) out[d] = kvq::fp16_to_float(q[d]);
      break;
    }
    case IN_BF16: {
      const uint16_t* q = (const uint16_t*)p;
      for (int d = 0; d < D; ++d) out[d] = kvq::bf16_to_float(q[d]);
      break;
    }
  }
}

void encode_token_row(const SideQ& q, const Region& r, uint8_t* plane, int t, const float* x,
                      int D, float static_scale, float* sxbuf) {
  const Codec& c = q.c;
  const float* sx = x;  // what the scales are computed from
  if (c.outliers) {
    encode_outliers(c, r, plane, t, x, D, sxbuf);
    sx = sxbuf;
  }
  uint8_t* row = plane + r.data_off + (int64_t)t * r.row_bytes;
  if (c.encoding == kvq::ENC_FP16 || c.encoding == kvq::ENC_BF16) {
    uint16_t* o = (uint16_t*)row;
    if (c.encoding == kvq::ENC_FP16)
      for (int d = 0; d < D; ++d) o[d] = float_to_fp16_ieee(x[d]);
    else
      for (int d = 0; d < D; ++d) o[d] = kvq::float_to_bf16(x[d]);
    return;
  }
  if (c.bits < 8) memset(row, 0, r.row_bytes);  // put_code read-modify-writes
  auto put_all = [&](int d0, int n, const kvq::QParams& p) {
    if (c.bits == 8) {
      for (int d = d0; d < d0 + n; ++d) row[d] = (uint8_t)encode_value(q, x[d], p);
    } else {
      for (int d = d0; d < d0 + n; ++d) kvq::put_code(row, d, c.bits, encode_value(q, x[d], p));
    }
  };
  switch (c.granularity) {
    case kvq::GRAN_TENSOR:
    case kvq::GRAN_HEAD: {
      kvq::QParams p{static_scale, 0.0f};
      put_all(0, D, p);
      break;
    }
    case kvq::GRAN_TOKEN: {
      const kvq::QParams p = dyn_params(c, sx, D, 1);
      put_all(0, D, p);
      store_fp16(plane, r.scale_off, t, p.scale);
      if (r.zero_bytes) store_fp16(plane, r.zero_off, t, p.zero);
      break;
    }
    default: {  // group (check_codec allows no other granularity here)
      const int g = c.group, ng = D / g;
      for (int j = 0; j < ng; ++j) {
        const kvq::QParams p = dyn_params(c, sx + j * g, g, 1);
        put_all(j * g, g, p);
        store_fp16(plane, r.scale_off, t * ng + j, p.scale);
        if (r.zero_bytes) store_fp16(plane, r.zero_off, t * ng + j, p.zero);
      }
    }
  }
  if (c.outliers) finish_outliers(q, r, plane, t, x, D, static_scale);
}

// Quantize G whole tokens x[G][D] (per-channel codec) into rows t0..t0+G-1 of a region;
// sxbuf: G*D floats of scratch (outlier codecs).
void encode_channel_group(const SideQ& q, const Region& r, uint8_t* plane, int t0,
                          const float* x, int D, float* sxbuf) {
  const Codec& c = q.c;
  const int G = c.group;
  const float* sx = x;
  if (c.outliers) {
    for (int i = 0; i < G; ++i)
      encode_outliers(c, r, plane, t0 + i, x + (int64_t)i * D, D, sxbuf + (int64_t)i * D);
    sx = sxbuf;
  }
  for (int i = 0; i < G; ++i) {
    uint8_t* row = plane + r.data_off + (int64_t)(t0 + i) * r.row_bytes;
    if (c.bits < 8) memset(row, 0, r.row_bytes);
  }
  const int srow = t0 / G;
  for (int d = 0; d < D; ++d) {
    const kvq::QParams p = dyn_params(c, sx + d, G, D);
    for (int i = 0; i < G; ++i) {
      uint8_t* row = plane + r.data_off + (int64_t)(t0 + i) * r.row_bytes;
      const uint32_t code = encode_value(q, x[(int64_t)i * D + d], p);
      if (c.bits == 8) row[d] = (uint8_t)code; else kvq::put_code(row, d, c.bits, code);
    }
    store_fp16(plane, r.scale_off, srow * D + d, p.scale);
    if (r.zero_bytes) store_fp16(plane, r.zero_off, srow * D + d, p.zero);
  }
  if (c.outliers)
    for (int i = 0; i < G; ++i)
      finish_outliers(q, r, plane, t0 + i, x + (int64_t)i * D, D, 0.0f);
}


}  // namespace write_scalar
}  // namespace kvq_cpu
