// kvq_cpu::write_cache: quantize K/V rows [N, H, D] into their (block, kv_head) planes.
//
// Every number goes through the scalar rules of kvq_numeric.h (or a bit-exact fast
// equivalent checked against them in tests), so the planes are byte-identical to the
// PyTorch reference (vllm_kvq/reference.py::write_cache).
#include <immintrin.h>
#include <omp.h>

#include <string>
#include <vector>

#include "cpu_ops.h"
#include "kvq_layout.h"
#include "kvq_torch_codec.h"
#include "kvq_numeric.h"

namespace kvq_cpu {
namespace {

using kvq::Codec;
using kvq::Region;

// ---- input rows ----------------------------------------------------------------------
enum InDType { IN_F32 = 0, IN_F16 = 1, IN_BF16 = 2 };

InDType in_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return IN_F32;
    case at::kHalf: return IN_F16;
    case at::kBFloat16: return IN_BF16;
    default:
      TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

struct RowSrc {
  const uint8_t* base;
  int64_t stride_n, stride_h;  // bytes
  InDType dt;
  int esize;
};

inline void load_row(const RowSrc& s, int64_t i, int h, int D, float* out) {
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

// fp8 of a finite value already clamped to +-fp8_max (same contract as kvq::float_to_fp8).
inline uint8_t float_to_e4m3_fast(float x) {
  const uint32_t u = kvq::float_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a < 0x3c800000u) {  // below 2^-6: subnormal, quantum 2^-9
    return sign | (uint8_t)rintf(kvq::bits_float(a) * 512.0f);
  }
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return sign | (uint8_t)((r >> 20) - (120u << 3));
}
inline uint8_t float_to_e5m2_fast(float x) {
  const uint32_t u = kvq::float_bits(x);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a < 0x38800000u) {  // below 2^-14: subnormal, quantum 2^-16
    return sign | (uint8_t)rintf(kvq::bits_float(a) * 65536.0f);
  }
  const uint32_t r = a + 0xfffffu + ((a >> 21) & 1u);
  return sign | (uint8_t)((r >> 21) - (112u << 2));
}
inline uint8_t quantize_fp8_fast(float x, float scale, int32_t enc) {
  x = kvq::sanitize(x);
  if (!(scale > 0.0f)) return 0;
  const float m = kvq::fp8_max(enc);
  const float y = fminf(fmaxf(x / scale, -m), m);
  return enc == kvq::ENC_FP8_E4M3 ? float_to_e4m3_fast(y) : float_to_e5m2_fast(y);
}

// ---- one scale group -------------------------------------------------------------------
// x: n values (stride `xs` floats) sharing one scale; codes go to row(s) via put(i, code).
struct GroupStats {
  float lo, hi, amax;
  bool any;
};
inline GroupStats stats(const float* x, int n, int xs) {
  GroupStats g{INFINITY, -INFINITY, 0.0f, false};
  for (int i = 0; i < n; ++i) {
    const float v = x[(int64_t)i * xs];
    if (!isfinite(v)) continue;
    g.any = true;
    g.lo = fminf(g.lo, v);
    g.hi = fmaxf(g.hi, v);
    g.amax = fmaxf(g.amax, fabsf(v));
  }
  if (!g.any) { g.lo = 0.0f; g.hi = 0.0f; }
  return g;
}

// What a side's quantizer needs besides its codec: the nuq codebook's midpoints.
struct SideQ {
  Codec c;
  float mids[kvq::kMaxNuqLevels];  // nuq: (level[k] + level[k+1]) * 0.5, 2^bits - 1 of them
};

// Dynamic parameters of a group (INT asym/sym, nuq, fp8) from its values.
inline kvq::QParams dyn_params(const Codec& c, const float* x, int n, int xs) {
  const GroupStats g = stats(x, n, xs);
  if (c.encoding == kvq::ENC_NUQ) return kvq::nuq_params(g.lo, g.hi);
  if (c.encoding == kvq::ENC_INT) {
    if (c.symmetric) return kvq::absmax_params(g.amax, (float)kvq::int_half(c.bits));
    return kvq::int_asym_params(g.lo, g.hi, c.bits);
  }
  return kvq::absmax_params(g.amax, kvq::fp8_max(c.encoding));  // fp8 dynamic
}

inline uint32_t encode_value(const SideQ& q, float x, const kvq::QParams& p) {
  const Codec& c = q.c;
  if (c.encoding == kvq::ENC_INT) return kvq::quantize_int(x, p, c.bits, c.symmetric != 0);
  if (c.encoding == kvq::ENC_NUQ) return kvq::quantize_nuq(x, p, q.mids, 1 << c.bits);
  return quantize_fp8_fast(x, p.scale, c.encoding);
}

// v is already fp16-rounded (QParams); -0.0 keeps its sign, as torch stores it.
inline void store_fp16(uint8_t* plane, int32_t off, int idx, float v) {
  const uint16_t h = kvq::float_to_fp16_sat(v);
  memcpy(plane + off + 2 * idx, &h, 2);
}

// Outlier slots of token t (kvq::select_outliers): writes the slots and returns in sx the
// values the dense scales are computed from (x with the outliers replaced by NaN, which
// every statistic skips). The plane may be unaligned: the slots are written bytewise.
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
      slot.value_fp16 = kvq::float_to_fp16_sat(x[ch[j]]);
      sx[ch[j]] = NAN;
    }
    memcpy(o + j * sizeof(kvq::Outlier), &slot, sizeof(slot));
  }
}

// Quantize one token row x[D] (non-channel codecs) into row t of a region; sxbuf: D floats
// of scratch (outlier codecs).
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
    case kvq::GRAN_GROUP: {
      const int g = c.group, ng = D / g;
      for (int j = 0; j < ng; ++j) {
        const kvq::QParams p = dyn_params(c, sx + j * g, g, 1);
        put_all(j * g, g, p);
        store_fp16(plane, r.scale_off, t * ng + j, p.scale);
        if (r.zero_bytes) store_fp16(plane, r.zero_off, t * ng + j, p.zero);
      }
      break;
    }
    default: TORCH_CHECK(false, "encode_token_row: bad granularity ", c.granularity);
  }
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
}


// ---- AVX2 path (bit-identical to the scalar rules above: IEEE division, RNE rounding,
// the same clamps and non-finite policy) -----------------------------------------------
}  // namespace
}  // namespace kvq_cpu

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace kvq_cpu {
namespace write_avx2 {

typedef __m256 V;
typedef __m256i VI;

static inline VI abs_bits(V x) { return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)); }
static inline V finite_mask(V x) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), abs_bits(x)));
}
// NaN -> 0, +-Inf -> +-3e38 (kvq::sanitize)
static inline V sanitize8(V x) {
  const VI a = abs_bits(x);
  const V isinf = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32(0x7f800000)));
  const V isnan = _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  const V big = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(3.0e38f));
  x = _mm256_blendv_ps(x, big, isinf);
  return _mm256_andnot_ps(isnan, x);
}

static void load_row(const RowSrc& s, int64_t i, int h, int D, float* out) {
  const uint8_t* p = s.base + i * s.stride_n + (int64_t)h * s.stride_h;
  if (s.dt == IN_F32) {
    memcpy(out, p, sizeof(float) * D);
  } else if (s.dt == IN_F16) {
    for (int d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 2 * d))));
  } else {
    for (int d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 2 * d))), 16)));
  }
}

// Finite min / max / |max| of lanes, accumulated over rows.
struct St8 {
  V lo, hi, am, any;
};
static inline St8 st_init() {
  return St8{_mm256_set1_ps(INFINITY), _mm256_set1_ps(-INFINITY), _mm256_setzero_ps(),
             _mm256_setzero_ps()};
}
static inline void st_add(St8& g, V x) {
  const V f = finite_mask(x);
  g.lo = _mm256_min_ps(g.lo, _mm256_blendv_ps(_mm256_set1_ps(INFINITY), x, f));
  g.hi = _mm256_max_ps(g.hi, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, f));
  g.am = _mm256_max_ps(g.am, _mm256_and_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), f));
  g.any = _mm256_or_ps(g.any, f);
}
static inline kvq::QParams params_of(const Codec& c, float lo, float hi, float am, bool any) {
  if (!any) { lo = 0.0f; hi = 0.0f; }
  if (c.encoding == kvq::ENC_NUQ) return kvq::nuq_params(lo, hi);
  if (c.encoding == kvq::ENC_INT) {
    if (c.symmetric) return kvq::absmax_params(am, (float)kvq::int_half(c.bits));
    return kvq::int_asym_params(lo, hi, c.bits);
  }
  return kvq::absmax_params(am, kvq::fp8_max(c.encoding));
}
// One group: the 8 lanes of g reduced.
static inline kvq::QParams params_reduced(const Codec& c, const St8& g) {
  alignas(32) float lo[8], hi[8], am[8], an[8];
  _mm256_store_ps(lo, g.lo); _mm256_store_ps(hi, g.hi);
  _mm256_store_ps(am, g.am); _mm256_store_ps(an, g.any);
  float L = INFINITY, Hh = -INFINITY, A = 0.0f;
  bool any = false;
  for (int k = 0; k < 8; ++k) {
    L = fminf(L, lo[k]); Hh = fmaxf(Hh, hi[k]); A = fmaxf(A, am[k]);
    any = any || an[k] != 0.0f;
  }
  return params_of(c, L, Hh, A, any);
}

// 8 values -> 8 codes (bytes) with per-lane scale/zero.
static inline void quant8(const SideQ& sq, V x, V s, V z, uint8_t* out) {
  const Codec& c = sq.c;
  x = sanitize8(x);
  const V pos = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);
  VI code;
  if (c.encoding == kvq::ENC_NUQ) {  // kvq::quantize_nuq: count the midpoints below
    const V y = _mm256_div_ps(_mm256_sub_ps(x, z), s);
    VI n = _mm256_setzero_si256();
    const int nm = (1 << c.bits) - 1;
    for (int k = 0; k < nm; ++k)
      n = _mm256_sub_epi32(n, _mm256_castps_si256(
                                  _mm256_cmp_ps(y, _mm256_set1_ps(sq.mids[k]), _CMP_GT_OQ)));
    code = _mm256_and_si256(n, _mm256_castps_si256(pos));
  } else if (c.encoding == kvq::ENC_INT) {
    V q;
    if (c.symmetric) {
      const float half = (float)kvq::int_half(c.bits);
      q = _mm256_round_ps(_mm256_div_ps(x, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-half)), _mm256_set1_ps(half));
      q = _mm256_and_ps(q, pos);
      code = _mm256_add_epi32(_mm256_cvtps_epi32(q), _mm256_set1_epi32(1 << (c.bits - 1)));
    } else {
      q = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(x, z), s),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()),
                        _mm256_set1_ps((float)kvq::int_levels(c.bits)));
      q = _mm256_and_ps(q, pos);
      code = _mm256_cvtps_epi32(q);
    }
  } else {  // fp8
    const float m = kvq::fp8_max(c.encoding);
    V y = _mm256_div_ps(x, s);
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-m)), _mm256_set1_ps(m));
    const VI u = _mm256_castps_si256(y);
    const VI sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    const VI a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const bool e4 = c.encoding == kvq::ENC_FP8_E4M3;
    const int man = e4 ? 3 : 2, drop = 23 - man;
    const int32_t min_normal = e4 ? 0x3c800000 : 0x38800000;
    const float sub_mul = e4 ? 512.0f : 65536.0f;
    const int32_t bias_sh = (e4 ? 120 : 112) << man;
    const VI sub = _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(sub_mul)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const VI r = _mm256_add_epi32(
        _mm256_add_epi32(a, _mm256_set1_epi32((1 << (drop - 1)) - 1)),
        _mm256_and_si256(_mm256_srli_epi32(a, drop), _mm256_set1_epi32(1)));
    const VI nor = _mm256_sub_epi32(_mm256_srli_epi32(r, drop), _mm256_set1_epi32(bias_sh));
    const VI mag = _mm256_blendv_epi8(nor, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(min_normal), a));
    code = _mm256_and_si256(_mm256_or_si256(mag, sign), _mm256_castps_si256(pos));
  }
  const __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64((__m128i*)out, _mm_packus_epi16(p16, p16));
}

static void pack_row(const uint8_t* codes, int D, int bits, uint8_t* row, int row_bytes) {
  if (bits == 8) { memcpy(row, codes, D); return; }
  if (bits == 4) { for (int j = 0; j < D / 2; ++j) row[j] = codes[2 * j] | (codes[2 * j + 1] << 4); return; }
  if (bits == 2) {
    for (int j = 0; j < D / 4; ++j)
      row[j] = codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) | (codes[4 * j + 3] << 6);
    return;
  }
  memset(row, 0, row_bytes);
  for (int d = 0; d < D; ++d) kvq::put_code(row, d, bits, codes[d]);
}

static void encode_token_row(const SideQ& q, const Region& r, uint8_t* plane, int t,
                             const float* x, int D, float static_scale, uint8_t* codes,
                             float* sxbuf) {
  const Codec& c = q.c;
  const float* sx = x;  // what the scales are computed from
  if (c.outliers) {
    encode_outliers(c, r, plane, t, x, D, sxbuf);
    sx = sxbuf;
  }
  uint8_t* row = plane + r.data_off + (int64_t)t * r.row_bytes;
  if (c.encoding == kvq::ENC_FP16) {
    for (int d = 0; d < D; d += 8)
      _mm_storeu_si128((__m128i*)(row + 2 * d),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
    return;
  }
  if (c.encoding == kvq::ENC_BF16) {
    uint16_t* o = (uint16_t*)row;
    for (int d = 0; d < D; ++d) o[d] = kvq::float_to_bf16(x[d]);
    return;
  }
  auto quant_range = [&](int d0, int n, const kvq::QParams& p) {
    const V s = _mm256_set1_ps(p.scale), z = _mm256_set1_ps(p.zero);
    for (int d = d0; d < d0 + n; d += 8) quant8(q, _mm256_loadu_ps(x + d), s, z, codes + d);
  };
  auto stats_range = [&](int d0, int n) {
    St8 g = st_init();
    for (int d = d0; d < d0 + n; d += 8) st_add(g, _mm256_loadu_ps(sx + d));
    return params_reduced(c, g);
  };
  switch (c.granularity) {
    case kvq::GRAN_TENSOR:
    case kvq::GRAN_HEAD: quant_range(0, D, kvq::QParams{static_scale, 0.0f}); break;
    case kvq::GRAN_TOKEN: {
      const kvq::QParams p = stats_range(0, D);
      quant_range(0, D, p);
      store_fp16(plane, r.scale_off, t, p.scale);
      if (r.zero_bytes) store_fp16(plane, r.zero_off, t, p.zero);
      break;
    }
    default: {  // group
      const int g = c.group, ng = D / g;
      for (int j = 0; j < ng; ++j) {
        const kvq::QParams p = stats_range(j * g, g);
        quant_range(j * g, g, p);
        store_fp16(plane, r.scale_off, t * ng + j, p.scale);
        if (r.zero_bytes) store_fp16(plane, r.zero_off, t * ng + j, p.zero);
      }
    }
  }
  pack_row(codes, D, c.bits, row, r.row_bytes);
}

static void encode_channel_group(const SideQ& q, const Region& r, uint8_t* plane, int t0,
                                 const float* x, int D, uint8_t* codes, float* sxbuf) {
  const Codec& c = q.c;
  const int G = c.group, srow = t0 / G;
  const float* sx = x;
  if (c.outliers) {
    for (int i = 0; i < G; ++i)
      encode_outliers(c, r, plane, t0 + i, x + (int64_t)i * D, D, sxbuf + (int64_t)i * D);
    sx = sxbuf;
  }
  for (int d = 0; d < D; d += 8) {
    St8 g = st_init();
    for (int i = 0; i < G; ++i) st_add(g, _mm256_loadu_ps(sx + (int64_t)i * D + d));
    alignas(32) float lo[8], hi[8], am[8], an[8], sc[8], ze[8];
    _mm256_store_ps(lo, g.lo); _mm256_store_ps(hi, g.hi);
    _mm256_store_ps(am, g.am); _mm256_store_ps(an, g.any);
    for (int k = 0; k < 8; ++k) {
      const kvq::QParams p = params_of(c, lo[k], hi[k], am[k], an[k] != 0.0f);
      sc[k] = p.scale;
      ze[k] = p.zero;
      store_fp16(plane, r.scale_off, srow * D + d + k, p.scale);
      if (r.zero_bytes) store_fp16(plane, r.zero_off, srow * D + d + k, p.zero);
    }
    const V s = _mm256_load_ps(sc), z = _mm256_load_ps(ze);
    for (int i = 0; i < G; ++i)
      quant8(q, _mm256_loadu_ps(x + (int64_t)i * D + d), s, z, codes + (int64_t)i * D + d);
  }
  for (int i = 0; i < G; ++i)
    pack_row(codes + (int64_t)i * D, D, c.bits, plane + r.data_off + (int64_t)(t0 + i) * r.row_bytes,
             r.row_bytes);
}

}  // namespace write_avx2
}  // namespace kvq_cpu
#pragma GCC pop_options

namespace kvq_cpu {
namespace {

using kvq::to_codec;

}  // namespace

int simd_level();  // attention.cpp: 0 scalar, 1 avx2, 2 avx512 (KVQ_SIMD lowers it)

// Shared with attention.cpp: the codec checks every CPU op does.
void check_codec(const Codec& c, int D, int B, const char* what) {
  TORCH_CHECK(c.outliers >= 0 && c.outliers <= 64 && c.outliers <= D, what, ": outliers=",
              c.outliers, " slots per token is not allowed; allowed: 0..64");
  TORCH_CHECK(c.outliers == 0 || c.encoding == kvq::ENC_INT || c.encoding == kvq::ENC_NUQ,
              what, ": outlier slots apply to int and nuq codecs only");
  TORCH_CHECK(c.outliers == 0 || D <= 512, what, ": outlier slots need head_dim <= 512");
  switch (c.encoding) {
    case kvq::ENC_FP16:
    case kvq::ENC_BF16:
      TORCH_CHECK(c.bits == 16 && c.granularity == kvq::GRAN_NONE, what,
                  ": fp16/bf16 codec must be 16 bits with granularity none");
      break;
    case kvq::ENC_FP8_E4M3:
    case kvq::ENC_FP8_E5M2:
      TORCH_CHECK(c.bits == 8, what, ": fp8 codec must be 8 bits");
      TORCH_CHECK(c.granularity == kvq::GRAN_TENSOR || c.granularity == kvq::GRAN_HEAD ||
                      c.granularity == kvq::GRAN_TOKEN,
                  what, ": fp8 granularity must be tensor, head or token, got ",
                  c.granularity);
      break;
    case kvq::ENC_INT:
      TORCH_CHECK(c.bits == 2 || c.bits == 3 || c.bits == 4 || c.bits == 8, what,
                  ": int bits must be 2, 3, 4 or 8, got ", c.bits);
      TORCH_CHECK(c.granularity >= kvq::GRAN_TENSOR && c.granularity <= kvq::GRAN_CHANNEL,
                  what, ": int granularity must be tensor, head, token, group or channel");
      TORCH_CHECK(!(c.granularity <= kvq::GRAN_HEAD) || c.symmetric, what,
                  ": static (tensor/head) int scales must be symmetric");
      break;
    case kvq::ENC_NUQ:
      TORCH_CHECK(c.bits == 2 || c.bits == 3 || c.bits == 4, what,
                  ": nuq bits must be 2, 3 or 4, got ", c.bits);
      TORCH_CHECK(c.granularity >= kvq::GRAN_TOKEN && c.granularity <= kvq::GRAN_CHANNEL &&
                      !c.symmetric,
                  what, ": nuq granularity must be token, group or channel (asymmetric)");
      break;
    default: TORCH_CHECK(false, what, ": unknown encoding ", c.encoding);
  }
  if (c.granularity == kvq::GRAN_GROUP)
    TORCH_CHECK(c.group >= 16 && c.group % 16 == 0 && D % c.group == 0, what,
                ": channel group ", c.group, " must be a multiple of 16 dividing head_dim ",
                D);
  if (c.granularity == kvq::GRAN_CHANNEL)
    TORCH_CHECK(c.group >= 1 && B % c.group == 0, what, ": token group ", c.group,
                " must divide block_size ", B);
}

// Shared with attention.cpp: a nuq codec's codebook (float32 [2^bits], ascending, finite,
// in [-1, 1]) copied out of its tensor; empty for other codecs.
std::vector<float> codebook(const Codec& c, const at::Tensor& levels, const char* what) {
  if (c.encoding != kvq::ENC_NUQ) return {};
  const int n = 1 << c.bits;
  TORCH_CHECK(levels.defined() && levels.dim() == 1 && levels.numel() == n &&
                  levels.scalar_type() == at::kFloat && levels.device().is_cpu(),
              what, " must be a float32 CPU tensor of 2^bits=", n, " levels for codec nuq",
              c.bits, ", got ", levels.defined() ? levels.sizes() : at::IntArrayRef{});
  at::Tensor l = levels.contiguous();
  std::vector<float> out(l.data_ptr<float>(), l.data_ptr<float>() + n);
  for (int k = 0; k < n; ++k) {
    TORCH_CHECK(std::isfinite(out[k]) && out[k] >= -1.0f && out[k] <= 1.0f, what, "[", k,
                "] = ", out[k], " must be finite and within [-1, 1]");
    TORCH_CHECK(k == 0 || out[k] >= out[k - 1], what, " must be sorted ascending (level ",
                k, ")");
  }
  return out;
}

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                 const at::Tensor& slot_mapping, const std::vector<int64_t>& k_codec,
                 const std::vector<int64_t>& v_codec, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& k_levels,
                 const at::Tensor& v_levels) {
  const Codec kc = to_codec(k_codec, "k_codec"), vc = to_codec(v_codec, "v_codec");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [N, H, D]");
  TORCH_CHECK(key.sizes() == value.sizes(), "key ", key.sizes(), " and value ",
              value.sizes(), " must have the same shape");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && cache.device().is_cpu(),
              "write_cache (CPU) needs CPU tensors");
  const int64_t N = key.size(0);
  const int H = (int)key.size(1), D = (int)key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4,
              "cache must be uint8 [num_blocks, H, block_size, C]");
  TORCH_CHECK(cache.size(1) == H, "cache has ", cache.size(1), " kv heads, key has ", H);
  const int B = (int)cache.size(2);
  const int64_t C = cache.size(3);
  check_codec(kc, D, B, "k_codec");
  check_codec(vc, D, B, "v_codec");
  SideQ kq{kc, {}}, vq{vc, {}};
  {
    const std::vector<float> kl = codebook(kc, k_levels, "k_levels");
    const std::vector<float> vl = codebook(vc, v_levels, "v_levels");
    if (!kl.empty()) kvq::nuq_midpoints(kl.data(), (int)kl.size(), kq.mids);
    if (!vl.empty()) kvq::nuq_midpoints(vl.data(), (int)vl.size(), vq.mids);
  }
  const kvq::Layout lay = kvq::make_layout(kc, vc, D, B);
  TORCH_CHECK(C == lay.token_bytes, "cache last dim is ", C, " bytes but this format needs ",
              lay.token_bytes, " bytes per token (head_dim ", D, ", block_size ", B, ")");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == C && cache.stride(1) >= (int64_t)B * C,
              "each (block, kv_head) plane of the cache must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) >= N,
              "slot_mapping must be 1-D with at least N=", N, " entries");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 or int32");
  const int64_t num_slots = cache.size(0) * B;

  std::vector<int64_t> slots(N);
  {
    at::Tensor sm = slot_mapping.to(at::kLong).contiguous();
    const int64_t* p = sm.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      slots[i] = p[i];
      TORCH_CHECK(p[i] < num_slots, "slot_mapping entry ", i, " = ", p[i],
                  " is past the cache's ", num_slots, " slots");
    }
  }
  const std::vector<float> ks = kvq::static_scales(kc, k_scale, H, "k_scale");
  const std::vector<float> vs = kvq::static_scales(vc, v_scale, H, "v_scale");

  const RowSrc ksrc{(const uint8_t*)key.data_ptr(), key.stride(0) * key.element_size(),
                    key.stride(1) * key.element_size(), in_dtype(key, "key"),
                    (int)key.element_size()};
  const RowSrc vsrc{(const uint8_t*)value.data_ptr(), value.stride(0) * value.element_size(),
                    value.stride(1) * value.element_size(), in_dtype(value, "value"),
                    (int)value.element_size()};
  uint8_t* cbase = cache.data_ptr<uint8_t>();
  const int64_t sb = cache.stride(0), sh = cache.stride(1);

  constexpr int64_t kParallelWriteValues = 16384;  // below this, one thread writes
  // Work items per side: entry index (token codecs) or first entry of a group (channel).
  auto items_for = [&](const Codec& c, const char* side) {
    std::vector<int64_t> items;
    if (c.granularity != kvq::GRAN_CHANNEL) {
      for (int64_t i = 0; i < N; ++i)
        if (slots[i] >= 0) items.push_back(i);
      return items;
    }
    const int G = c.group;
    int64_t i = 0;
    while (i < N) {
      const int64_t s = slots[i];
      if (s < 0) { ++i; continue; }
      bool ok = s % G == 0 && i + G <= N;
      for (int j = 1; ok && j < G; ++j) ok = slots[i + j] == s + j;
      TORCH_CHECK(ok, "per-channel ", side, " codec needs whole aligned groups of ", G,
                  " slots; entry ", i, " (slot ", s, ") starts none");
      items.push_back(i);
      i += G;
    }
    return items;
  };
  const std::vector<int64_t> kitems = items_for(kc, "key"), vitems = items_for(vc, "value");

  auto run_side = [&](const SideQ& q, const Region& r, const RowSrc& src,
                      const std::vector<int64_t>& items, const std::vector<float>& st) {
    const Codec& c = q.c;
    const int64_t n = (int64_t)items.size() * H;
    if (n == 0) return;
    const int rows = c.granularity == kvq::GRAN_CHANNEL ? c.group : 1;
    const bool vec = simd_level() >= 1 && D % 8 == 0;
    // A decode step writes a few rows per layer: microseconds of work, less than waking the
    // thread team (and far less than waiting for a descheduled thread on a busy machine).
    const bool parallel = n * rows * D >= kParallelWriteValues;
#pragma omp parallel if (parallel)
    {
      std::vector<float> buf((size_t)rows * D), sbuf((size_t)rows * D);
      std::vector<uint8_t> codes((size_t)rows * D);
#pragma omp for schedule(static)
      for (int64_t w = 0; w < n; ++w) {
        const int64_t i = items[w / H];
        const int h = (int)(w % H);
        const int64_t s = slots[i];
        uint8_t* plane = cbase + (s / B) * sb + h * sh;
        const int t = (int)(s % B);
        if (vec) {
          for (int j = 0; j < rows; ++j)
            write_avx2::load_row(src, i + j, h, D, buf.data() + (size_t)j * D);
          if (rows == 1)
            write_avx2::encode_token_row(q, r, plane, t, buf.data(), D, st[h], codes.data(),
                                         sbuf.data());
          else
            write_avx2::encode_channel_group(q, r, plane, t, buf.data(), D, codes.data(),
                                             sbuf.data());
          continue;
        }
        for (int j = 0; j < rows; ++j) load_row(src, i + j, h, D, buf.data() + (size_t)j * D);
        if (rows == 1) encode_token_row(q, r, plane, t, buf.data(), D, st[h], sbuf.data());
        else encode_channel_group(q, r, plane, t, buf.data(), D, sbuf.data());
      }
    }
  };
  run_side(kq, lay.k, ksrc, kitems, ks);
  run_side(vq, lay.v, vsrc, vitems, vs);
}

}  // namespace kvq_cpu
