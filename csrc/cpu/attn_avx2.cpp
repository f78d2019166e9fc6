// Paged attention, AVX2 + FMA + F16C path (8 float lanes). See attn_body.h.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attn_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

namespace kvq_cpu {
namespace kvq_avx2 {

constexpr int W = 8;
typedef __m256 VF;

static inline VF vzero() { return _mm256_setzero_ps(); }
static inline VF vset(float x) { return _mm256_set1_ps(x); }
static inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline VF vmin(VF a, VF b) { return _mm256_min_ps(a, b); }
static inline float vhsum(VF v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
static inline float vhmax(VF v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
// 2^x, rel. error ~2e-7; x < -125 (and -inf) -> 0; NaN stays NaN.
static inline VF vexp2(VF x) {
  const VF t = vmin(vset(127.0f), vmax(vset(-125.0f), x));
  const VF n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VF f = vsub(t, n);
  VF p = vset(1.535336188319500e-4f);
  p = vfma(p, f, vset(1.339887440266574e-3f));
  p = vfma(p, f, vset(9.618437357674640e-3f));
  p = vfma(p, f, vset(5.550332471162809e-2f));
  p = vfma(p, f, vset(2.402264791363012e-1f));
  p = vfma(p, f, vset(6.931472028550421e-1f));
  p = vfma(p, f, vset(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  const VF r = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, vset(-125.0f), _CMP_LT_OQ), r);
}
// lane k = sum of a[k]'s lanes.
static inline VF vreduce(const VF* a) {
  VF x[4], z[2];
  for (int k = 0; k < 4; ++k)
    x[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                         _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)
    z[k] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                         _mm256_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(z[0], z[1], 0x20),
                       _mm256_permute2f128_ps(z[0], z[1], 0x31));
}
static inline VF ld_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
static inline VF ld_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// W floats -> bf16, round to nearest even, NaN -> 0x7FC0 (torch's cast).
static inline void st_bf16(uint16_t* p, VF x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0),
                         _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                 _mm256_extracti128_si256(r, 1)));
}
// W floats -> fp16, round to nearest even (overflow -> Inf), NaN -> sign | 0x7E00 (torch's).
static inline void st_f16(uint16_t* p, VF x) {
  const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i n32 = _mm256_or_si256(
      _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32((int)0x80000000u)), 16),
      _mm256_set1_epi32(0x7e00));
  const __m128i nan = _mm_packus_epi32(_mm256_castsi256_si128(n32), _mm256_extracti128_si256(n32, 1));
  const __m256i m32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m128i m = _mm_packs_epi32(_mm256_castsi256_si128(m32), _mm256_extracti128_si256(m32, 1));
  _mm_storeu_si128((__m128i*)p, _mm_blendv_epi8(h, nan, m));
}
static inline VF ld_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline VF ld_u4(const uint8_t* p) {
  int32_t w;
  memcpy(&w, p, 4);
  const __m128i x = _mm_cvtsi32_si128(w);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(15)));
}
static inline VF ld_u2(const uint8_t* p) {
  uint16_t w;
  memcpy(&w, p, 2);
  const __m128i x = _mm_cvtsi32_si128(w);
  const __m128i dup = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0,
                                                        0, 0));
  const __m256i v = _mm256_cvtepu8_epi32(dup);
  const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(3)));
}
// Two chunks from W bytes of int4: a = low nibbles (even channels), b = high (odd).
static inline void ld_u4x2(const uint8_t* p, VF& a, VF& b) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  a = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
  b = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
}
// Two chunks from W/2 bytes of int2: lanes [0, W/2) take byte i, lanes [W/2, W) byte i - W/2;
// a = bit pairs 0 | 1, b = bit pairs 2 | 3; through tab (8 entries, entry i that of i & 3:
// vpermps reads the low 3 bits, the bit above a code, the next pair's or byte's, lands in
// bit 2): int2 the codes themselves, nuq2 its levels. The 4 bytes are broadcast as one
// word (a load, no shuffle) and each lane shifts its byte's pair down: 4 vector ops per
// 16 values instead of 6 (vmovd, vpunpckldq, vpmovzxbd before the two shifts): 2-bit
// values' kernel 10.6 -> 9.3 ms (AVX2 Zen 3, 1 thread, 32/8/128 b4 8k, int4 keys).
static inline void ld_x2x2(const uint8_t* p, __m256 tab, VF& a, VF& b) {
  int32_t w;
  memcpy(&w, p, 4);
  const __m256i v = _mm256_set1_epi32(w);
  a = _mm256_permutevar8x32_ps(tab, _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26)));
  b = _mm256_permutevar8x32_ps(tab, _mm256_srlv_epi32(v, _mm256_setr_epi32(4, 12, 20, 28, 6, 14, 22, 30)));
}
static inline void ld_u2x2(const uint8_t* p, VF& a, VF& b) {
  ld_x2x2(p, _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3), a, b);
}
// e4m3 byte s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value * 2^-8, subnormals included:
// put the byte in the high half of a 16-bit lane, shift right by one (arithmetic: the sign
// lands in bits 15 and 14), clear bit 14.
static inline VF ld_e4m3(const uint8_t* p) {
  const __m128i w = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i*)p));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(w, 1), _mm_set1_epi16((short)0xBFFF)));
}
// e5m2 is the high byte of an fp16.
static inline VF ld_e5m2(const uint8_t* p) {
  return _mm256_cvtph_ps(
      _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i*)p)));
}

// nuq codes through an in-register table: W codes -> tab[code]. tab holds 16 floats with
// tab[i] = level[i mod 2^bits]; vpermps reads the low 3 bits, so 4-bit codes take two
// 8-entry halves and a blend on bit 3.
static inline VF ld_t4(const uint8_t* p, const float* tab) {  // W/2 bytes
  int32_t w;
  memcpy(&w, p, 4);
  const __m128i x = _mm_cvtsi32_si128(w);
  const __m256i v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x)),
                                      _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  const VF lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), v);
  const VF hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 8), v);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}
// 3 bytes; reads 4 (a code row is always followed by more of its plane: the nuq codec's
// scales); the junk byte only reaches index bits the table ignores.
static inline VF ld_t3(const uint8_t* p, const float* tab) {
  uint32_t w;
  memcpy(&w, p, 4);
  const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                      _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21));
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), v);
}
static inline VF ld_t2(const uint8_t* p, const float* tab) {  // 2 bytes
  uint16_t w;
  memcpy(&w, p, 2);
  const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(w),
                                       _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m256i v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup),
                                      _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), v);
}

// even / odd lanes of the 2W floats a:b (a's first): even = a0 a2 .. b0 b2 .., odd = a1 a3 ..
static inline void vdeint(VF a, VF b, VF& even, VF& odd) {
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

// the inverse of vdeint: a:b = e0 o0 e1 o1 .. (2W floats)
static inline void vinter(VF e, VF o, VF& a, VF& b) {
  const VF l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);  // per 128-bit lane
  a = _mm256_permute2f128_ps(l, h, 0x20);
  b = _mm256_permute2f128_ps(l, h, 0x31);
}

// round to the nearest integer, ties to even (as vq8_store's conversion)
static inline VF vround(VF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// lane l = base[l * stride]
static inline VF vgather(const float* base, int stride) {
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(stride));
  return _mm256_i32gather_ps(base, idx, 4);
}

// Rows of ng floats (token-major, [t][g]) -> out[g * kTileTokens + t] for tokens [0, nt)
// rounded up to W (the same reads as a gather). Zen 2 runs an 8-lane vpgatherdps in ~20
// cycles, so the two- and four-group cases (head_dim 64 / 128 in groups of 32) use in-lane
// shuffles and the rest a scalar copy; true when handled.
static inline bool vtranspose_groups(const float* src, int nt, int ng, float* out) {
  constexpr int TTs = kTileTokens;  // out's row stride
  if (ng == 2) {
    for (int t = 0; t < nt; t += W) {
      const VF a = vload(src + 2 * t), b = vload(src + 2 * t + W);
      // in each 128-bit half: t t+1 | t+4 t+5 (low half), t+2 t+3 | t+6 t+7 (high half)
      const VF e = _mm256_shuffle_ps(a, b, 0x88), o = _mm256_shuffle_ps(a, b, 0xDD);
      vstore(out + t, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
      vstore(out + TTs + t, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
    }
    return true;
  }
  if (ng == 4) {
    const __m256i ord = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int t = 0; t < nt; t += W) {
      const float* s = src + 4 * t;  // row k holds tokens t+2k (low half), t+2k+1 (high)
      const VF r0 = vload(s), r1 = vload(s + W), r2 = vload(s + 2 * W), r3 = vload(s + 3 * W);
      const VF l01 = _mm256_unpacklo_ps(r0, r1), h01 = _mm256_unpackhi_ps(r0, r1);
      const VF l23 = _mm256_unpacklo_ps(r2, r3), h23 = _mm256_unpackhi_ps(r2, r3);
      // group g: tokens t, t+2, t+4, t+6 | t+1, t+3, t+5, t+7 -> natural order
      vstore(out + t, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(l01, l23, 0x44), ord));
      vstore(out + TTs + t, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(l01, l23, 0xEE), ord));
      vstore(out + 2 * TTs + t, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(h01, h23, 0x44), ord));
      vstore(out + 3 * TTs + t, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(h01, h23, 0xEE), ord));
    }
    return true;
  }
  const int n = (nt + W - 1) / W * W;
  for (int t = 0; t < n; ++t)
    for (int g = 0; g < ng; ++g) out[g * TTs + t] = src[(int64_t)t * ng + g];
  return true;
}

// ---- integer vectors for the int8-query Q.K (see attn_body.h "integer Q.K") -------------
// VI: 4W = 32 bytes (u8 codes or s8 query) or W int32 lanes.
typedef __m256i VI;
static inline VI ci_zero() { return _mm256_setzero_si256(); }
static inline VI ci_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
// acc lane l += sum_{k<4} c[4l+k] * q[4l+k] (u8 x s8), exactly (like vpdpbusd).
// SMALL (codes < 16 or nuq byte levels <= 127): vpmaddubsw cannot saturate
// (|2 * 127 * 127| < 2^15).
// Otherwise (8-bit codes) even and odd bytes go through vpmaddwd as 16-bit words.
template <bool SMALL>
static inline VI ci_dot(VI acc, VI c, VI q) {
  if (SMALL)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c, q),
                                                   _mm256_set1_epi16(1)));
  const __m256i ce = _mm256_and_si256(c, _mm256_set1_epi16(0x00FF));
  const __m256i co = _mm256_srli_epi16(c, 8);
  const __m256i qe = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8);
  const __m256i qo = _mm256_srai_epi16(q, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ce, qe),
                                                _mm256_madd_epi16(co, qo)));
}
// 8-bit codes (ci_dot<false> above costs 9 instructions): a code vector is prepared once
// for every query row that multiplies it as c' = c - 128 (signed: |c'| and c' itself), then
// per row vpmaddubsw(|c'|, sign(q, c')) = c' * q in pairs, which cannot saturate
// (|2 * 128 * 127| < 2^15): 4 instructions. Each lane's sum lacks kCiWideBias * (its
// query bytes' sum), which qk_int adds once per scale group: the same integers as
// vpdpbusd.
constexpr int kCiWideBias = 128;
struct CiWide {
  VI mag, sgn;
};
static inline CiWide ci_wide(VI c) {
  const VI s = _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
  return {_mm256_abs_epi8(s), s};
}
static inline VI ci_dot_wide(VI acc, const CiWide& c, VI q) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(
      _mm256_maddubs_epi16(c.mag, _mm256_sign_epi8(q, c.sgn)), _mm256_set1_epi16(1)));
}
static inline VF ci_tof(VI a) { return _mm256_cvtepi32_ps(a); }
// lane l = the 4 bytes at p (one dword of the int8 query, multiplied into every token lane).
static inline VI ci_bcast4(const int8_t* p) {
  int32_t x;
  memcpy(&x, p, 4);
  return _mm256_set1_epi32(x);
}
// (x >> SH) & mask in every byte: one bit field of every packed code byte.
template <int SH>
static inline VI ci_field(VI x, int mask) {
  return _mm256_and_si256(_mm256_srli_epi32(x, SH), _mm256_set1_epi8((char)mask));
}
// out[j] lane i = dword j of rows[i] + off, for j < nd <= 8 (out[nd..8) undefined): the
// 32-byte column block of W = 8 code rows, transposed (8x8 dwords: two unpack stages in
// 128-bit lanes, then vperm2i128). Masked loads never touch bytes past nd dwords.
static inline void ci_tr8(const uint8_t* const* rows, int off, int nd, VI* out) {
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nd), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i a[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm256_maskload_epi32((const int*)(rows[k] + off), m);
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(a[2 * k], a[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi32(a[2 * k], a[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + e]: per 128-bit lane, element e of rows 4h..4h+3
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm256_permute2x128_si256(u[e], u[e + 4], 0x20);
    out[e + 4] = _mm256_permute2x128_si256(u[e], u[e + 4], 0x31);
  }
}
// Lane masks and gathers for the outlier slots (attn_body.h "outlier slots"): VM lanes are
// all ones or zero; masked-off lanes of a gather read nothing and give 0.
typedef __m256i VM;
static inline VI ci_set1(int x) { return _mm256_set1_epi32(x); }
static inline VI ci_iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline VI ci_mullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
static inline VI ci_and(VI a, VI b) { return _mm256_and_si256(a, b); }
static inline VI ci_srlv(VI a, VI n) { return _mm256_srlv_epi32(a, n); }  // n >= 32: 0
static inline VM ci_lt(VI a, VI b) { return _mm256_cmpgt_epi32(b, a); }
static inline VM vm_and(VM a, VM b) { return _mm256_and_si256(a, b); }
static inline VM vm_first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), ci_iota()); }
static inline VI ci_sel0(VM m, VI a) { return _mm256_and_si256(m, a); }
static inline VF vsel0(VM m, VF a) { return _mm256_and_ps(_mm256_castsi256_ps(m), a); }
// lane l = the 4 bytes at base + off[l]
static inline VI ci_gather(const void* base, VI off, VM m) {
  return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int*)base, off, m, 1);
}
static inline VF vgather_idx(const float* base, VI idx, VM m) {
  return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, idx, _mm256_castsi256_ps(m), 4);
}
static inline VI ci_load(const void* p, VM m) { return _mm256_maskload_epi32((const int*)p, m); }
static inline VF vload_m(const float* p, VM m) { return _mm256_maskload_ps(p, m); }
// lane l = tab[idx[l] & 15] (16 floats; two vpermps and a blend on bit 3)
static inline VF vlut16(VI idx, const float* tab) {
  const VF lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), idx);
  const VF hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 8), idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
// nuq: two chunks of 4-bit codes (a = low nibbles, b = high; see ld_u4x2) / 2-bit codes
// (see ld_u2x2) through the codebook table tab (16 floats, tab[i] = level[i mod 2^bits]).
static inline void ld_t4x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  a = vlut16(x, tab);
  b = vlut16(_mm256_srli_epi32(x, 4), tab);
}
static inline void ld_t2x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  ld_x2x2(p, _mm256_loadu_ps(tab), a, b);
}
// nuq 4-bit codes through a byte table btab (16 bytes, btab[0] == 0: the codebook ascends,
// so code 0 is its lowest level, byte 0): each code, alone in the low byte of its 32-bit
// lane, indexes btab with vpshufb; the lane's other bytes index entry 0 and stay 0. Per
// 16 values 7 instructions instead of ld_t4x2's 11 (two vpermps and a blend per 8).
static inline VF ld_b4(const uint8_t* p, const uint8_t* btab) {  // ld_u4's order
  int32_t w;
  memcpy(&w, p, 4);
  const __m128i x = _mm_cvtsi32_si128(w);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(15));
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)btab));
  return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(tab, c));
}
static inline void ld_b4x2(const uint8_t* p, const uint8_t* btab, VF& a, VF& b) {  // ld_u4x2's
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)btab));
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  a = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(tab, _mm256_and_si256(x, _mm256_set1_epi32(15))));
  b = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(tab, _mm256_srli_epi32(x, 4)));
}
// lane l = tab[idx[l]] for idx < n (a gather); masked-off lanes are 0.
static inline VF vtab(const float* tab, int, VI idx, VM m) { return vgather_idx(tab, idx, m); }
// the fp16 in the low half of each lane -> float
static inline VF ci_f16lo(VI a) {
  const __m256i w = _mm256_shuffle_epi8(a, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1,
                                                            -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                                                            12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)));
}
static inline void ci_store(int32_t* p, VI a) { _mm256_storeu_si256((__m256i*)p, a); }
// Four rows of W floats <-> W quads: out[4t + k] = r[k][t] (see the AVX-512 path): a 4x4
// transpose inside each 128-bit lane, then the lanes regrouped.
static inline void vtr4_store(const VF r[4], float* out) {
  const VF a = _mm256_unpacklo_ps(r[0], r[1]), b = _mm256_unpackhi_ps(r[0], r[1]);
  const VF c = _mm256_unpacklo_ps(r[2], r[3]), d = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256d ad = _mm256_castps_pd(a), bd = _mm256_castps_pd(b), cd = _mm256_castps_pd(c),
                dd = _mm256_castps_pd(d);
  const VF t0 = _mm256_castpd_ps(_mm256_unpacklo_pd(ad, cd));  // tokens 0 | 4
  const VF t1 = _mm256_castpd_ps(_mm256_unpackhi_pd(ad, cd));  // 1 | 5
  const VF t2 = _mm256_castpd_ps(_mm256_unpacklo_pd(bd, dd));  // 2 | 6
  const VF t3 = _mm256_castpd_ps(_mm256_unpackhi_pd(bd, dd));  // 3 | 7
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(t0, t1, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(t2, t3, 0x20));
  _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(t0, t1, 0x31));
  _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(t2, t3, 0x31));
}
static inline void vtr4_load(const float* in, VF r[4]) {  // the inverse of vtr4_store
  const VF o0 = _mm256_loadu_ps(in), o1 = _mm256_loadu_ps(in + 8);
  const VF o2 = _mm256_loadu_ps(in + 16), o3 = _mm256_loadu_ps(in + 24);
  const VF t0 = _mm256_permute2f128_ps(o0, o2, 0x20), t1 = _mm256_permute2f128_ps(o0, o2, 0x31);
  const VF t2 = _mm256_permute2f128_ps(o1, o3, 0x20), t3 = _mm256_permute2f128_ps(o1, o3, 0x31);
  const VF a = _mm256_unpacklo_ps(t0, t1), b = _mm256_unpackhi_ps(t0, t1);
  const VF c = _mm256_unpacklo_ps(t2, t3), d = _mm256_unpackhi_ps(t2, t3);
  const __m256d ad = _mm256_castps_pd(a), bd = _mm256_castps_pd(b), cd = _mm256_castps_pd(c),
                dd = _mm256_castps_pd(d);
  r[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(ad, cd));
  r[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(ad, cd));
  r[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(bd, dd));
  r[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(bd, dd));
}
// dst[0..4) += src[0..4)
static inline void vadd4(float* dst, const float* src) {
  _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), _mm_loadu_ps(src)));
}

// No qk_int3 on this path (AttnParams::qk3 is 0): int3 rows are repacked to 4 bits,
// nuq3 keys stay on the fp32 Q.K.
#define KVQ_HAS_QK3 0
// A 16-byte table in both 128-bit lanes: ci_lut16's operand.
static inline VI ci_tab16(const uint8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)t));
}
// Every byte x (a code < 16, ci_field's output) -> tab[x] (vpshufb).
static inline VI ci_lut16(VI x, VI tab) { return _mm256_shuffle_epi8(tab, x); }
// (x & keep) | (x & move) << SHIFT
template <int SHIFT>
static inline __m256i keep_or_move(__m256i x, int keep, int move) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(keep)),
                         _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(move)), SHIFT));
}
// 64 packed 3-bit codes (24 bytes, 8 codes per 3) -> 32 bytes of 4-bit codes (code i in
// nibble i) in one register: a masked load (no read past the 24 bytes), vpermd + vpshufb
// put bytes 3i..3i+2 (codes 8i..8i+7) in dword i, and three shift-and-mask steps spread
// each dword's 24 bits into 8 nibbles (codes 0-3 | 4-7 to 16-bit halves, then pairs to
// bytes, then each code to its nibble). ~16 instructions a row of 64 codes where the
// 16-code steps below take ~24 (pdep) to ~40: int3_group32 on this path, 9/3/64, 4 x 512,
// one thread (Zen 4), 150-153 -> 139-141 us a call.
static inline void cvt3to4_64(const uint8_t* src, uint8_t* dst) {
  const __m256i six = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
  const __m256i perm = _mm256_setr_epi32(0, 1, 2, 3, 3, 4, 5, 6);
  const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  __m256i x = _mm256_maskload_epi32((const int*)src, six);
  x = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(x, perm), spread);
  x = keep_or_move<4>(x, 0x00000FFF, 0x00FFF000);  // codes 0-3 | 4-7 to 16-bit halves
  x = keep_or_move<2>(x, 0x003F003F, 0x0FC00FC0);  // pairs to bytes
  x = keep_or_move<1>(x, 0x07070707, 0x38383838);  // each code to its nibble
  _mm256_storeu_si256((__m256i*)dst, x);
}
// D packed 3-bit codes (8 per 3 bytes) -> D/2 bytes of 4-bit codes (code i in nibble i),
// D % 16 == 0: 64 codes at a time (cvt3to4_64), the rest 16 at a time: their 6 bytes in
// both 128-bit lanes, vpshufb puts the two bytes holding code 8L + w in word w of lane L;
// (x << (13 - s)) >> 13 with s = 3w mod 8 (vpmullw by a power of two: AVX2 has no per-word
// shift) leaves the code; each dword's two codes become one byte (w | w >> 12), and the
// lanes' four bytes are stored.
static inline void cvt3to4_row(const uint8_t* src, int D, uint8_t* dst) {
  alignas(32) static const struct Tabs {
    uint8_t idx[32];
    uint16_t mul[16];
    Tabs() {
      for (int L = 0; L < 2; ++L)
        for (int w = 0; w < 8; ++w) {
          idx[16 * L + 2 * w] = (uint8_t)(3 * L + 3 * w / 8);
          idx[16 * L + 2 * w + 1] = (uint8_t)(3 * L + 3 * w / 8 + 1);
          mul[8 * L + w] = (uint16_t)(1u << (13 - 3 * w % 8));
        }
    }
  } tabs;
  const __m256i idx = _mm256_load_si256((const __m256i*)tabs.idx);
  const __m256i mul = _mm256_load_si256((const __m256i*)tabs.mul);
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1, -1, -1);
  int d = 0;
  for (; d + 64 <= D; d += 64) cvt3to4_64(src + d / 8 * 3, dst + d / 2);
  for (; d < D; d += 16) {
    // the 6 bytes assembled in a register: a 6-byte memcpy into a stack qword made the
    // broadcast wait for a failed store forward (~40% of nuq3's decode on Zen 4)
    uint32_t lo4;
    uint16_t hi2;
    memcpy(&lo4, src + d / 8 * 3, 4);
    memcpy(&hi2, src + d / 8 * 3 + 4, 2);
    const uint64_t w = (uint64_t)lo4 | ((uint64_t)hi2 << 32);
    __m256i y = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)w), idx);
    y = _mm256_srli_epi16(_mm256_mullo_epi16(y, mul), 13);
    y = _mm256_shuffle_epi8(_mm256_or_si256(y, _mm256_srli_epi32(y, 12)), pick);
    const uint32_t lo = (uint32_t)_mm256_extract_epi32(y, 0), hi = (uint32_t)_mm256_extract_epi32(y, 4);
    memcpy(dst + d / 2, &lo, 4);
    memcpy(dst + d / 2 + 4, &hi, 4);
  }
}
// cvt3to4_row with its 16-code steps by BMI2 pdep: 16 codes (48 bits) deposited into the
// low 3 bits of 16 nibbles by one instruction (AVX2 Zen 3, 1 thread, 32/8/128 b4 8k, int4
// values, before cvt3to4_64: int3_channel32_r32 keys 14.5 -> 13.2 ms, int3_token 12.2 ->
// 11.9). Only where pdep is fast (AttnParams::fast_pdep): Zen 1/2 microcode it.
#define KVQ_HAS_PDEP 1
static inline void cvt3to4_row_pdep(const uint8_t* src, int D, uint8_t* dst) {
  int d = 0;
  for (; d + 64 <= D; d += 64) cvt3to4_64(src + d / 8 * 3, dst + d / 2);
  for (; d < D; d += 16) {
    uint32_t lo4;
    uint16_t hi2;
    memcpy(&lo4, src + d / 8 * 3, 4);
    memcpy(&hi2, src + d / 8 * 3 + 4, 2);
    const uint64_t x = _pdep_u64((uint64_t)lo4 | ((uint64_t)hi2 << 32), 0x7777777777777777ull);
    memcpy(dst + d / 2, &x, 8);
  }
}
// dst[0..W) = (int8) rint(x * inv); |x * inv| <= 127.
static inline void vq8_store(VF x, VF inv, int8_t* dst) {
  const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64((__m128i*)dst, _mm_packs_epi16(w, w));
}

// Butterfly of lanes l and l + h (bit h of l clear) for h < W: (x_l + x_{l+h}, x_l - x_{l+h})
// (hadamard_body.h).
static inline VF vbfly(VF x, int h) {
  VF t;
  switch (h) {
    case 1:
      t = _mm256_permute_ps(x, 0xB1);
      return _mm256_blend_ps(_mm256_add_ps(x, t), _mm256_sub_ps(t, x), 0xAA);
    case 2:
      t = _mm256_permute_ps(x, 0x4E);
      return _mm256_blend_ps(_mm256_add_ps(x, t), _mm256_sub_ps(t, x), 0xCC);
    default:
      t = _mm256_permute2f128_ps(x, x, 0x01);
      return _mm256_blend_ps(_mm256_add_ps(x, t), _mm256_sub_ps(t, x), 0xF0);
  }
}

#define KVQ_HAS_BF16DP 0  // no vdpbf16ps: bf16 keys take the fp32 Q.K (qk_fused)
#define KVQ_HAS_PV_BF16 0  // and the decode P.V keeps fp32 weights (pv_fused)
#define KVQ_HAS_PV_BYTE 1  // nuq 4-bit values: levels as bytes (ld_b4 / ld_b4x2)
// Per-channel keys on the fp32 Q.K with each scale row folded into the query
// (qk_fused's FOLD): one FMA and two loads a chunk and token less. nuq3 keys, 1 thread,
// Zen 4: 9/3/64 4 x 8k 2.42 -> 2.23 ms, 4 x 512 159-160 -> 149-157 us, 32/8/128 4 x 512
// 0.700 -> 0.650 ms. The AVX-512 body measured the same or slower with it (KVQ_EXACT_QK=1,
// 4 x 4k: 9/3/64 kivi4 0.71-0.72 -> 0.73 ms, nuq3 0.86 -> 0.87-0.91; 32/8/128 kivi4
// within 1%): its decode, not its FMAs, bounds that loop.
#define KVQ_FOLD_QK 1
#include "attn_body.h"

const TaskFn run_task = &run_task_impl;
const DecodeRowsFn decode_rows = &decode_rows_impl;
const HadamardFn hadamard_rows = &hadamard_rows_impl;

}  // namespace kvq_avx2
}  // namespace kvq_cpu

#pragma GCC pop_options
