// The cache writer's AVX2 + F16C path (8 float lanes; also the path on AVX-512 machines:
// writing is a few rows per layer per decode step). Bit-identical to write_scalar.cpp's
// rules: IEEE division, RNE rounding, the same clamps and non-finite policy.
#include <immintrin.h>

#include "write_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace kvq_cpu {
namespace write_avx2 {

using kvq::Codec;
using kvq::Region;

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

void load_row(const RowSrc& s, int64_t i, int h, int D, float* out) {
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
  return group_params(c, L, Hh, A, any);
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

void encode_token_row(const SideQ& q, const Region& r, uint8_t* plane, int t,
                      const float* x, int D, float static_scale, uint8_t* codes, float* sxbuf) {
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
  if (c.outliers) finish_outliers(q, r, plane, t, x, D, static_scale);
}

void encode_channel_group(const SideQ& q, const Region& r, uint8_t* plane, int t0,
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
      const kvq::QParams p = group_params(c, lo[k], hi[k], am[k], an[k] != 0.0f);
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
  if (c.outliers)
    for (int i = 0; i < G; ++i)
      finish_outliers(q, r, plane, t0 + i, x + (int64_t)i * D, D, 0.0f);
}

}  // namespace write_avx2
}  // namespace kvq_cpu
