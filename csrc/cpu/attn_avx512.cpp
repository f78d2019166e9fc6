// Paged attention, AVX-512 (F/BW/DQ/VL, + VNNI for the integer Q.K of int keys) path (16
// float lanes). See attn_body.h. The driver only sets AttnParams::int_qk on this path when
// the CPU has AVX512-VNNI, so vpdpbusd never runs on a CPU without it.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attn_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")
// GCC 12 warns about _mm512_undefined_* inside its own intrinsics (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace kvq_cpu {
namespace kvq_avx512 {

constexpr int W = 16;
typedef __m512 VF;

static inline VF vzero() { return _mm512_setzero_ps(); }
static inline VF vset(float x) { return _mm512_set1_ps(x); }
static inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline VF vmin(VF a, VF b) { return _mm512_min_ps(a, b); }
static inline float vhsum(VF v) {
  __m256 y = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
static inline float vhmax(VF v) {
  __m256 y = _mm256_max_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
// 2^x, rel. error ~2e-7; x < -125 (and -inf) -> 0; NaN stays NaN.
static inline VF vexp2(VF x) {
  const VF t = vmin(vset(127.0f), vmax(vset(-125.0f), x));
  const VF n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VF f = vsub(t, n);
  VF p = vset(1.535336188319500e-4f);
  p = vfma(p, f, vset(1.339887440266574e-3f));
  p = vfma(p, f, vset(9.618437357674640e-3f));
  p = vfma(p, f, vset(5.550332471162809e-2f));
  p = vfma(p, f, vset(2.402264791363012e-1f));
  p = vfma(p, f, vset(6.931472028550421e-1f));
  p = vfma(p, f, vset(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  const VF r = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  const __mmask16 small = _mm512_cmp_ps_mask(x, vset(-125.0f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(r, small, vzero());
}
// lane k = sum of a[k]'s lanes.
static inline VF vreduce(const VF* a) {
  VF x[8], z[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                         _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane q: [a, b, c, d] partial sums of lane q
    z[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  // z[k] holds inputs 4k..4k+3 in each 128-bit lane; sum the four 128-bit lanes.
  const VF s01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const VF s23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline VF ld_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline VF ld_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline VF ld_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline VF ld_u4(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64((const __m128i*)p);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, sh), _mm512_set1_epi32(15)));
}
static inline VF ld_u2(const uint8_t* p) {
  int32_t w;
  memcpy(&w, p, 4);
  const __m128i x = _mm_cvtsi32_si128(w);
  const __m128i dup = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3,
                                                        3, 3));
  const __m512i v = _mm512_cvtepu8_epi32(dup);
  const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, sh), _mm512_set1_epi32(3)));
}
// Two chunks from W bytes of 4-bit codes: a = low nibbles (even channels), b = high (odd),
// each through the 16-entry table tab (vpermps reads an index's low 4 bits, so the high
// nibble needs no mask): one op per chunk. int4: the codes themselves; nuq4: its levels.
static inline void ld_x4x2(const uint8_t* p, __m512 tab, VF& a, VF& b) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  a = _mm512_permutexvar_ps(x, tab);
  b = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), tab);
}
// Two chunks from W/2 bytes of 2-bit codes: lanes [0, W/2) take byte i, lanes [W/2, W) byte
// i - W/2; a = bit pairs 0 | 1, b = bit pairs 2 | 3; through tab, whose entry i is that of
// i & 3 (the pair above a code lands in index bits 2-3).
static inline void ld_x2x2(const uint8_t* p, __m512 tab, VF& a, VF& b) {
  const __m128i x = _mm_loadl_epi64((const __m128i*)p);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x, x));
  a = _mm512_permutexvar_ps(
      _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)), tab);
  b = _mm512_permutexvar_ps(
      _mm512_srlv_epi32(v, _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6)), tab);
}
static inline void ld_u4x2(const uint8_t* p, VF& a, VF& b) {
  ld_x4x2(p, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), a, b);
}
static inline void ld_u2x2(const uint8_t* p, VF& a, VF& b) {
  ld_x2x2(p, _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), a, b);
}
// nuq: tab holds 16 floats, tab[i] = level[i mod 2^bits] (set_levels)
static inline void ld_t4x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  ld_x4x2(p, _mm512_loadu_ps(tab), a, b);
}
static inline void ld_t2x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  ld_x2x2(p, _mm512_loadu_ps(tab), a, b);
}
// W floats -> bf16, round to nearest even, NaN -> 0x7FC0 (torch's cast).
static inline void st_bf16(uint16_t* p, VF x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}
// W floats -> fp16, round to nearest even (overflow -> Inf), NaN -> sign | 0x7E00 (torch's).
static inline void st_f16(uint16_t* p, VF x) {
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i nan = _mm512_cvtepi32_epi16(_mm512_or_si512(
      _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)), 16),
      _mm512_set1_epi32(0x7e00)));
  h = _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
  _mm256_storeu_si256((__m256i*)p, h);
}
// e4m3 byte s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value * 2^-8, subnormals included:
// put the byte in the high half of a 16-bit lane, shift right by one (arithmetic: the sign
// lands in bits 15 and 14), clear bit 14.
static inline VF ld_e4m3(const uint8_t* p) {
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBFFF)));
}
// e5m2 is the high byte of an fp16.
static inline VF ld_e5m2(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}

// nuq codes through an in-register table: W codes -> tab[code]. tab holds 16 floats with
// tab[i] = level[i mod 2^bits], so the index may keep junk bits above the code (vpermps
// reads the low 4 bits).
static inline VF ld_t4(const uint8_t* p, const float* tab) {  // W/2 bytes
  const __m128i x = _mm_loadl_epi64((const __m128i*)p);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh), _mm512_loadu_ps(tab));
}
// 3W/8 = 6 bytes; reads 8 (a code row is always followed by more of its plane: the nuq
// codec's scales), so the load is one 8-byte load (a 6-byte memcpy would make the vector
// load wait for a failed store forward).
static inline VF ld_t3(const uint8_t* p, const float* tab) {
  uint64_t w;
  memcpy(&w, p, 8);
  // qword k: codes 2k, 2k+1 at its bits 0..5; its low dword copied to both halves, the odd
  // lane shifted by 3 more
  const __m512i y = _mm512_srlv_epi64(_mm512_set1_epi64((long long)w),
                                      _mm512_setr_epi64(0, 6, 12, 18, 24, 30, 36, 42));
  const __m512i z = _mm512_srlv_epi32(_mm512_shuffle_epi32(y, _MM_PERM_CCAA),
                                      _mm512_setr_epi32(0, 3, 0, 3, 0, 3, 0, 3, 0, 3, 0, 3, 0,
                                                        3, 0, 3));
  return _mm512_permutexvar_ps(z, _mm512_loadu_ps(tab));
}
static inline VF ld_t2(const uint8_t* p, const float* tab) {  // W/4 bytes
  int32_t w;
  memcpy(&w, p, 4);
  const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(w),
                                       _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup), sh),
                               _mm512_loadu_ps(tab));
}

// even / odd lanes of the 2W floats a:b (a's first): even = a0 a2 .. b0 b2 .., odd = a1 a3 ..
static inline void vdeint(VF a, VF b, VF& even, VF& odd) {
  const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  even = _mm512_permutex2var_ps(a, e, b);
  odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
}

// the inverse of vdeint: a:b = e0 o0 e1 o1 .. (2W floats)
static inline void vinter(VF e, VF o, VF& a, VF& b) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  a = _mm512_permutex2var_ps(e, lo, o);
  b = _mm512_permutex2var_ps(e, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), o);
}

// round to the nearest integer, ties to even (as vq8_store's conversion)
static inline VF vround(VF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// lane l = base[l * stride]
static inline VF vgather(const float* base, int stride) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                           12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  return _mm512_i32gather_ps(idx, base, 4);
}

// attn_body.h transpose_tile: [t][g] rows of ng floats -> out[g * kTileTokens + t], tokens
// rounded up to W (the same reads as a gather). For ng = 2^k <= 16 (head_dim / group: 2, 4,
// 8 for groups of 32) each W tokens' ng vectors are split into even and odd lanes k times
// (vpermt2ps): one split moves flat index i of the N = W * ng values to i / 2 (even i) or
// N / 2 + i / 2 (odd i), a right rotation of i's bits, so after k splits t * ng + g sits at
// g * W + t. On Zen 4 this replaced the gathers: int4_group32 / kivi2 decode at 4k tokens
// 9% / 13% faster (9/3/64, batch 4, one thread). true when handled, else the gather runs.
template <int NG>
static inline void vtranspose_pow2(const float* src, int nt, float* out) {
  constexpr int TTs = kTileTokens;  // out's row stride
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int t = 0; t < nt; t += W) {
    VF v[NG], w[NG];
    for (int j = 0; j < NG; ++j) v[j] = vload(src + (int64_t)t * NG + j * W);
    for (int s = NG; s > 1; s >>= 1) {
      for (int j = 0; j < NG / 2; ++j) {
        w[j] = _mm512_permutex2var_ps(v[2 * j], even, v[2 * j + 1]);
        w[j + NG / 2] = _mm512_permutex2var_ps(v[2 * j], odd, v[2 * j + 1]);
      }
      for (int j = 0; j < NG; ++j) v[j] = w[j];
    }
    for (int g = 0; g < NG; ++g) vstore(out + g * TTs + t, v[g]);
  }
}
static inline bool vtranspose_groups(const float* src, int nt, int ng, float* out) {
  switch (ng) {
    case 2: vtranspose_pow2<2>(src, nt, out); return true;
    case 4: vtranspose_pow2<4>(src, nt, out); return true;
    case 8: vtranspose_pow2<8>(src, nt, out); return true;
    case 16: vtranspose_pow2<16>(src, nt, out); return true;
    default: return false;
  }
}

// ---- integer vectors for the int8-query Q.K (see attn_body.h "integer Q.K") -------------
// VI: 4W = 64 bytes (u8 codes or s8 query) or W int32 lanes.
typedef __m512i VI;
static inline VI ci_zero() { return _mm512_setzero_si512(); }
static inline VI ci_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
// acc lane l += sum_{k<4} c[4l+k] * q[4l+k] (u8 x s8), vpdpbusd; SMALL: codes < 16 (unused here)
template <bool SMALL>
static inline VI ci_dot(VI acc, VI c, VI q) { return _mm512_dpbusd_epi32(acc, c, q); }
// 8-bit codes go straight to vpdpbusd (no bias, see attn_avx2.cpp ci_wide).
constexpr int kCiWideBias = 0;
struct CiWide {
  VI c;
};
static inline CiWide ci_wide(VI c) { return {c}; }
static inline VI ci_dot_wide(VI acc, const CiWide& c, VI q) { return _mm512_dpbusd_epi32(acc, c.c, q); }
static inline VF ci_tof(VI a) { return _mm512_cvtepi32_ps(a); }
// lane l = the 4 bytes at p (one dword of the int8 query, multiplied into every token lane).
static inline VI ci_bcast4(const int8_t* p) {
  int32_t x;
  memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}
// (x >> SH) & mask in every byte: one bit field of every packed code byte.
template <int SH>
static inline VI ci_field(VI x, int mask) {
  return _mm512_and_si512(_mm512_srli_epi32(x, SH), _mm512_set1_epi8((char)mask));
}
// out[j] lane i = dword j of rows[i] + off, for j < nd <= 8 (out[nd..8) undefined): the
// 32-byte column block of W code rows, transposed. Rows i and i+8 share a register (one
// 256-bit half each), an 8x8 dword transpose runs in both halves, and vpermt2q puts each
// column's four 4-row pieces in row order. Masked loads never touch bytes past nd dwords.
static inline void ci_tr8(const uint8_t* const* rows, int off, int nd, VI* out) {
  const __mmask8 m = (__mmask8)((1u << nd) - 1);
  __m512i a[8], t[8], u[8];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_maskz_loadu_epi32(m, rows[k] + off)),
        _mm256_maskz_loadu_epi32(m, rows[k + 8] + off), 1);
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: [r0 e0, r1 e0, r0 e1, r1 e1] / e2, e3
    t[2 * k] = _mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + e]: per 128-bit lane, element e of rows 4h..4h+3
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm512_permutex2var_epi64(u[e], lo, u[e + 4]);
    out[e + 4] = _mm512_permutex2var_epi64(u[e], hi, u[e + 4]);
  }
}
// Lane masks and gathers for the outlier slots (attn_body.h "outlier slots"): VM has one
// bit per lane; masked-off lanes of a gather read nothing and give 0.
typedef __mmask16 VM;
static inline VI ci_set1(int x) { return _mm512_set1_epi32(x); }
static inline VI ci_iota() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline VI ci_mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
static inline VI ci_and(VI a, VI b) { return _mm512_and_si512(a, b); }
static inline VI ci_srlv(VI a, VI n) { return _mm512_srlv_epi32(a, n); }  // n >= 32: 0
static inline VM ci_lt(VI a, VI b) { return _mm512_cmplt_epi32_mask(a, b); }
static inline VM vm_and(VM a, VM b) { return (VM)(a & b); }
static inline VM vm_first(int n) { return (VM)(n >= 16 ? 0xFFFF : (1u << n) - 1); }
static inline VI ci_sel0(VM m, VI a) { return _mm512_maskz_mov_epi32(m, a); }
static inline VF vsel0(VM m, VF a) { return _mm512_maskz_mov_ps(m, a); }
// lane l = the 4 bytes at base + off[l]
static inline VI ci_gather(const void* base, VI off, VM m) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, off, base, 1);
}
static inline VF vgather_idx(const float* base, VI idx, VM m) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, base, 4);
}
static inline VI ci_load(const void* p, VM m) { return _mm512_maskz_loadu_epi32(m, p); }
static inline VF vload_m(const float* p, VM m) { return _mm512_maskz_loadu_ps(m, p); }
// lane l = tab[idx[l]] for idx < n (n % 16 == 0), masked-off lanes 0. Up to 256 entries
// from the table's registers: vpermt2ps picks within 32 entries, blends on index bits 5, 6
// and 7 pick the 32-entry block; more entries by a gather. A 16-lane gather costs ~24
// cycles on Zen 5 (microbenchmark, session 22), the permutes and blends of 128 entries ~4.
// tab32 / tab64 / tab128 (k): entries [32k, 32k + 32), [64k, ...), [128k, ...); a half past
// n repeats the loaded one (its indexes never set the bit that picks it). Straight-line
// code: a loop over the chunks (an x[8] array, pairs merged per bit) measured 0.91-0.95x on
// the slot corrections (session 22).
static inline __attribute__((always_inline)) VF tab32(const float* tab, int k, int n, VI idx) {
  const VF a = _mm512_loadu_ps(tab + 32 * k);
  const VF b = n > 32 * k + 16 ? _mm512_loadu_ps(tab + 32 * k + 16) : a;
  return _mm512_permutex2var_ps(a, idx, b);
}
static inline __attribute__((always_inline)) VF tab64(const float* tab, int k, int n, VI idx) {
  const VF lo = tab32(tab, 2 * k, n, idx);
  if (n <= 64 * k + 32) return lo;
  const __mmask16 hi = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
  return _mm512_mask_blend_ps(hi, lo, tab32(tab, 2 * k + 1, n, idx));
}
static inline __attribute__((always_inline)) VF tab128(const float* tab, int k, int n, VI idx) {
  const VF lo = tab64(tab, 2 * k, n, idx);
  if (n <= 128 * k + 64) return lo;
  const __mmask16 hi = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
  return _mm512_mask_blend_ps(hi, lo, tab64(tab, 2 * k + 1, n, idx));
}
static inline __attribute__((always_inline)) VF vtab(const float* tab, int n, VI idx, VM m) {
  if (n > 256) return vgather_idx(tab, idx, m);
  VF x = tab128(tab, 0, n, idx);
  if (n > 128)
    x = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(128)), x,
                             tab128(tab, 1, n, idx));
  return _mm512_maskz_mov_ps(m, x);
}
// the fp16 in the low half of each lane -> float
static inline VF ci_f16lo(VI a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }
static inline void ci_store(int32_t* p, VI a) { _mm512_storeu_si512((void*)p, a); }
// Four rows of W floats <-> W quads: out[4t + k] = r[k][t] (the outlier slots' V
// corrections, accumulated per channel as quads of rows): a 4x4 transpose inside each
// 128-bit lane (token 4j+k's quad lands in lane j of vector k), then of the 128-bit blocks.
static inline void vtr4_store(const VF r[4], float* out) {
  const VF a = _mm512_unpacklo_ps(r[0], r[1]), b = _mm512_unpackhi_ps(r[0], r[1]);
  const VF c = _mm512_unpacklo_ps(r[2], r[3]), d = _mm512_unpackhi_ps(r[2], r[3]);
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b), cd = _mm512_castps_pd(c),
                dd = _mm512_castps_pd(d);
  const VF t0 = _mm512_castpd_ps(_mm512_unpacklo_pd(ad, cd));
  const VF t1 = _mm512_castpd_ps(_mm512_unpackhi_pd(ad, cd));
  const VF t2 = _mm512_castpd_ps(_mm512_unpacklo_pd(bd, dd));
  const VF t3 = _mm512_castpd_ps(_mm512_unpackhi_pd(bd, dd));
  const VF u0 = _mm512_shuffle_f32x4(t0, t1, 0x44), u1 = _mm512_shuffle_f32x4(t0, t1, 0xEE);
  const VF u2 = _mm512_shuffle_f32x4(t2, t3, 0x44), u3 = _mm512_shuffle_f32x4(t2, t3, 0xEE);
  _mm512_storeu_ps(out, _mm512_shuffle_f32x4(u0, u2, 0x88));
  _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(u0, u2, 0xDD));
  _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(u1, u3, 0x88));
  _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(u1, u3, 0xDD));
}
static inline void vtr4_load(const float* in, VF r[4]) {  // the inverse of vtr4_store
  const VF o0 = _mm512_loadu_ps(in), o1 = _mm512_loadu_ps(in + 16);
  const VF o2 = _mm512_loadu_ps(in + 32), o3 = _mm512_loadu_ps(in + 48);
  const VF u0 = _mm512_shuffle_f32x4(o0, o1, 0x44), u1 = _mm512_shuffle_f32x4(o0, o1, 0xEE);
  const VF u2 = _mm512_shuffle_f32x4(o2, o3, 0x44), u3 = _mm512_shuffle_f32x4(o2, o3, 0xEE);
  const VF t0 = _mm512_shuffle_f32x4(u0, u2, 0x88), t1 = _mm512_shuffle_f32x4(u0, u2, 0xDD);
  const VF t2 = _mm512_shuffle_f32x4(u1, u3, 0x88), t3 = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  const VF a = _mm512_unpacklo_ps(t0, t1), b = _mm512_unpackhi_ps(t0, t1);
  const VF c = _mm512_unpacklo_ps(t2, t3), d = _mm512_unpackhi_ps(t2, t3);
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b), cd = _mm512_castps_pd(c),
                dd = _mm512_castps_pd(d);
  r[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(ad, cd));
  r[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(ad, cd));
  r[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(bd, dd));
  r[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(bd, dd));
}
// dst[0..4) += src[0..4)
static inline void vadd4(float* dst, const float* src) {
  _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), _mm_loadu_ps(src)));
}

// A 16-byte table in every 128-bit lane: ci_lut16's operand.
static inline VI ci_tab16(const uint8_t* t) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)t));
}
// Every byte x (a code < 16, ci_field's output) -> tab[x] (vpshufb).
static inline VI ci_lut16(VI x, VI tab) { return _mm512_shuffle_epi8(tab, x); }
// bf16 keys x a bf16 query, for qk_bf16 (attn_body.h): only KVQ_BF16_TARGET functions run
// AVX512-BF16, and the driver sets AttnParams::bf16dp on this path only when the CPU has it.
// vdpbf16ps: lane i += a[2i] * b[2i] + a[2i+1] * b[2i+1] (bf16 products are exact in fp32;
// bf16 denormals read as 0), 32 channels per instruction.
#define KVQ_HAS_BF16DP 1
#define KVQ_BF16_TARGET __attribute__((target("avx512bf16")))
static inline KVQ_BF16_TARGET VF vdp_bf16(VF acc, VI a, VI b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
static inline VI ci_loadu(const void* p) { return _mm512_loadu_si512(p); }
// bf16 weights for the decode P.V of 4/3/2-bit and bf16 values (pv_bf16, attn_body.h): two
// tokens per vdpbf16ps, lane i = (token 0's value, token 1's value) of one channel, the
// channels in ld_u4x2 / ld_u2x2's order (4/2 bits) or natural (3, 16). Only KVQ_PV_TARGET
// functions run AVX512-BF16 / VBMI, and the driver sets AttnParams::pv_bf16 on this path
// only when the CPU has both.
#define KVQ_HAS_PV_BF16 1
#define KVQ_PV_TARGET __attribute__((target("avx512bf16,avx512vbmi")))
// 16 floats (pv_bf16's table: int codes or nuq levels, minus their midpoint) -> 32 words,
// word i = bf16 of tab[i & 15], round to nearest even (int codes - mid are exact).
static inline KVQ_PV_TARGET VI pv_tabw(const float* tab) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tab));
  return _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
}
// A step's two tokens as bf16 pairs, per value width (bits): the constants of pv_pairs*.
//  4 / 2: i0 spreads the two tokens' code bytes so that byte 0 of dword i is token 0's byte
//         sel(i), byte 2 token 1's (vpermb with a zeroing mask over src: token 0's bytes at
//         [0, 16), token 1's at [16, 32)); 2-bit: i1 / i2 the per-word shifts of chunk a / b.
//  3:     i0 / i1 gather, for chunk a / b, the two bytes holding channels 2j, 2j+1 of each
//         token into qword j (token 0: bytes 0-1, token 1: bytes 2-3); i2 the bit offsets
//         vpmultishiftqb takes each code from (words 0 / 1: channel 2j, words 2 / 3: 2j+1).
//  16:    i0 / i1 vpermt2w's indices of channels [0, W) / [W, 2W).
//  8:     i0 / i1 pv_i16_unpair's vpermt2d indices (below).
// tw: the value table (codes or levels, 32 words, vpermw reads an index's low 5 bits).
struct PvPairs {
  VI i0, i1, i2, tw;
};
static inline KVQ_PV_TARGET PvPairs pv_pairs_init(int bits, const float* tab) {
  alignas(64) uint8_t b0[64], b1[64], b2[64];
  alignas(64) uint16_t s[32];
  PvPairs p;
  if (bits == 8) {  // pv_i16_unpair's indices: channel j of the step from lane idx of (a, b)
    alignas(64) int32_t lo[16], hi[16];
    for (int j = 0; j < 32; ++j) {
      const int lane = 4 * (j / 8) + j % 4, idx = j % 8 < 4 ? lane : 16 + lane;
      (j < 16 ? lo[j] : hi[j - 16]) = idx;
    }
    p.i0 = _mm512_load_si512((const void*)lo);
    p.i1 = _mm512_load_si512((const void*)hi);
    p.i2 = p.tw = p.i0;
    return p;
  }
  if (bits == 16) {
    for (int i = 0; i < 32; ++i) s[i] = (uint16_t)(i / 2 + (i % 2 ? 32 : 0));
    p.i0 = _mm512_load_si512((const void*)s);
    p.i1 = _mm512_add_epi16(p.i0, _mm512_set1_epi16(16));
    p.i2 = p.tw = p.i0;
    return p;
  }
  if (bits == 3) {
    for (int j = 0; j < 8; ++j) {
      const int B = 6 * j / 8, r = 6 * j % 8;  // channels 2j, 2j+1: bits 6j .. 6j+5
      const uint8_t ia[8] = {(uint8_t)B, (uint8_t)(B + 1), (uint8_t)(16 + B), (uint8_t)(17 + B),
                             0, 0, 0, 0};
      const uint8_t sh[8] = {(uint8_t)r, 0, (uint8_t)(16 + r), 0, (uint8_t)(r + 3), 0,
                             (uint8_t)(19 + r), 0};
      for (int k = 0; k < 8; ++k) {
        b0[8 * j + k] = ia[k];
        b1[8 * j + k] = k < 4 ? (uint8_t)(ia[k] + 6) : 0;  // channels 16 + 2j: 6 bytes on
        b2[8 * j + k] = sh[k];
      }
    }
    p.i0 = _mm512_load_si512((const void*)b0);
    p.i1 = _mm512_load_si512((const void*)b1);
    p.i2 = _mm512_load_si512((const void*)b2);
    p.tw = pv_tabw(tab);
    return p;
  }
  for (int i = 0; i < 16; ++i) {
    const int sel = bits == 4 ? i : i % 8;
    b0[4 * i] = (uint8_t)sel;
    b0[4 * i + 2] = (uint8_t)(16 + sel);
    b0[4 * i + 1] = b0[4 * i + 3] = 0;
    s[2 * i] = s[2 * i + 1] = (uint16_t)(bits == 4 ? 0 : (i < 8 ? 0 : 2));
  }
  p.i0 = _mm512_load_si512((const void*)b0);
  p.i1 = _mm512_load_si512((const void*)s);
  p.i2 = _mm512_add_epi16(p.i1, _mm512_set1_epi16(4));
  p.tw = pv_tabw(tab);
  return p;
}
static inline VI pv_src(__m128i x0, __m128i x1) {  // x0 in bytes [0, 16), x1 in [16, 32)
  return _mm512_inserti32x4(_mm512_castsi128_si512(x0), x1, 1);
}
// 4-bit: W bytes (2W channels) of each token; a = low nibbles (even channels), b = high
// (the bit above a low nibble picks a copy of its table entry).
static inline KVQ_PV_TARGET void pv_pairs4(const PvPairs& c, const uint8_t* r0,
                                           const uint8_t* r1, VI& a, VI& b) {
  const VI src = pv_src(_mm_loadu_si128((const __m128i*)r0), _mm_loadu_si128((const __m128i*)r1));
  const VI z = _mm512_maskz_permutexvar_epi8((__mmask64)0x5555555555555555ULL, c.i0, src);
  a = _mm512_permutexvar_epi16(z, c.tw);
  b = _mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), c.tw);
}
// 2-bit: W/2 bytes of each token; lanes [0, W/2) byte i, lanes [W/2, W) byte i - W/2;
// a = bit pairs 0 | 1, b = 2 | 3 (ld_x2x2's order; the table repeats every 4 entries).
static inline KVQ_PV_TARGET void pv_pairs2(const PvPairs& c, const uint8_t* r0,
                                           const uint8_t* r1, VI& a, VI& b) {
  const VI src = pv_src(_mm_loadl_epi64((const __m128i*)r0), _mm_loadl_epi64((const __m128i*)r1));
  const VI z = _mm512_maskz_permutexvar_epi8((__mmask64)0x5555555555555555ULL, c.i0, src);
  a = _mm512_permutexvar_epi16(_mm512_srlv_epi16(z, c.i1), c.tw);
  b = _mm512_permutexvar_epi16(_mm512_srlv_epi16(z, c.i2), c.tw);
}
// 3-bit: 3W/4 bytes (8 codes per 3 bytes, code i at bits 3i..3i+2) of each token at byte
// off of its row (at least 24 bytes: pv_bf16_3bit); a = channels [0, W), b = [W, 2W),
// natural order (the table repeats every 8 entries, the 2 bits above a code pick a copy, so
// the byte after a step's 12 may be anything). The 12 bytes are read as 16 inside the row:
// with the 4 after them (its first step) or the 4 before them (any other step; the indices
// move up by 4). Read as 8 + 4 and put together, they were ~a third of the pair's
// instructions, most of them on the shuffle port with the permutes.
static inline KVQ_PV_TARGET void pv_pairs3(const PvPairs& c, const uint8_t* r0,
                                           const uint8_t* r1, int off, VI& a, VI& b) {
  const int back = off > 0 ? 4 : 0;
  const VI src = pv_src(_mm_loadu_si128((const __m128i*)(r0 + off - back)),
                        _mm_loadu_si128((const __m128i*)(r1 + off - back)));
  const VI up = _mm512_set1_epi8((char)back);
  const __mmask64 w0 = (__mmask64)0x5555555555555555ULL;  // each word's low byte
  a = _mm512_permutexvar_epi16(
      _mm512_maskz_multishift_epi64_epi8(w0, c.i2, _mm512_permutexvar_epi8(
                                                       _mm512_add_epi8(c.i0, up), src)), c.tw);
  b = _mm512_permutexvar_epi16(
      _mm512_maskz_multishift_epi64_epi8(w0, c.i2, _mm512_permutexvar_epi8(
                                                       _mm512_add_epi8(c.i1, up), src)), c.tw);
}
// bf16 values: 2W of each token; a = channels [0, W), b = [W, 2W), natural order.
static inline KVQ_PV_TARGET void pv_pairs16(const PvPairs& c, const uint8_t* r0,
                                            const uint8_t* r1, VI& a, VI& b) {
  const VI x0 = _mm512_loadu_si512((const void*)r0), x1 = _mm512_loadu_si512((const void*)r1);
  a = _mm512_permutex2var_epi16(x0, c.i0, x1);
  b = _mm512_permutex2var_epi16(x0, c.i1, x1);
}
// acc + two bf16 products per lane (w: the same bf16 weight pair in every lane).
static inline KVQ_PV_TARGET VF pv_dp(VF acc, VI w, VI v) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)v);
}
static inline VI pv_bcast(const uint16_t* p) {  // the dword at p (p[0], p[1]) in every lane
  uint32_t x;
  memcpy(&x, p, 4);
  return _mm512_set1_epi32((int)x);
}
// W floats -> W bf16 (round to nearest even; pv_bf16's weights are finite or NaN, and a NaN
// stays a NaN)
static inline KVQ_PV_TARGET void pv_store_bf16(uint16_t* p, VF x) {
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x));
}
// (p[0], 0) in every lane: a lone token's weight, its pair's partner weighted 0
static inline VI pv_bcast1(const uint16_t* p) { return _mm512_set1_epi32((int)p[0]); }
// int16 weights for the decode P.V of 8-bit int values (pv_i16, attn_body.h; pv_bf16's
// loops with BITS 8): two tokens per vpdpwssd (VNNI: lane i += w0 * v0 + w1 * v1 in int32),
// lane i = (token 0's code, token 1's code) of one channel as int16. vpunpckl/hwd interleave
// within 128-bit lanes, so a step's pairs a / b hold channels {0-3, 8-11, 16-19, 24-27} /
// {4-7, 12-15, 20-23, 28-31}; pv_i16_unpair puts a block's sums back in channel order
// (pv_pairs_init(8): i0 / i1 its vpermt2d indices). The driver sets AttnParams::pv_i16 only
// where pv_bf16 runs and the CPU has VNNI.
// 8-bit codes: 2W bytes of each token, zero-extended (0..255 are valid int16 factors).
static inline void pv_pairs8(const uint8_t* r0, const uint8_t* r1, VI& a, VI& b) {
  const VI x0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)r0));
  const VI x1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)r1));
  a = _mm512_unpacklo_epi16(x0, x1);
  b = _mm512_unpackhi_epi16(x0, x1);
}
static inline VI pv_dpi(VI acc, VI w, VI v) { return _mm512_dpwssd_epi32(acc, w, v); }
static inline void pv_i16_unpair(const PvPairs& c, VI a, VI b, VI& lo, VI& hi) {
  lo = _mm512_permutex2var_epi32(a, c.i0, b);
  hi = _mm512_permutex2var_epi32(a, c.i1, b);
}
// W floats -> W int16, rounded to nearest even, saturated (the weights are within +-32767)
static inline void pv_store_i16(uint16_t* p, VF x) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
}
// 3-bit codes as stored, for qk_int3 (attn_body.h): only functions with KVQ_QK3_TARGET
// run VBMI / VBMI2 instructions, and the driver sets AttnParams::qk3 on this path only when
// the CPU has both, so the rest of this file stays runnable on AVX-512 CPUs without them.
#define KVQ_HAS_QK3 1
#define KVQ_QK3_TARGET __attribute__((target("avx512vbmi,avx512vbmi2")))
// Three transposed row words (96 bits per token lane: 32 codes) -> four 24-bit units of 8
// codes each, unit k in the low bits of u[k] (vpshrdd joins the words a unit straddles).
static inline KVQ_QK3_TARGET void ci_units3(VI w0, VI w1, VI w2, VI* u) {
  u[0] = w0;
  u[1] = _mm512_shrdi_epi32(w0, w1, 24);
  u[2] = _mm512_shrdi_epi32(w1, w2, 16);
  u[3] = _mm512_srli_epi32(w2, 8);
}
// The 64-byte table ci_fields3 reads: byte i = lut[i & 7] (nullptr: i & 7, the code itself),
// the 8 entries broadcast to every qword (it was built byte by byte and reloaded: ~2.7% of a
// nuq3 decode at 512 tokens, as qk_int3 runs once per 32-token scale row there).
static inline KVQ_QK3_TARGET VI ci_tab3(const uint8_t* lut) {
  uint64_t t = 0x0706050403020100ULL;
  if (lut) memcpy(&t, lut, 8);
  return _mm512_set1_epi64((long long)t);
}
// 64 bytes dst[p] = src[idx[p]] (idx < 64; dst may be src): the per-channel fold's int8
// query from channel order into the code order of 4/2-bit keys (vpermb).
static inline KVQ_QK3_TARGET void q8_perm64(const int8_t* src, const uint8_t* idx, int8_t* dst) {
  _mm512_storeu_si512((void*)dst, _mm512_permutexvar_epi8(_mm512_loadu_si512((const void*)idx),
                                                          _mm512_loadu_si512((const void*)src)));
}
// A unit's 8 codes as bytes through the table: x[0] byte k of each lane = tab[code k],
// x[1] = tab[code 4 + k]. vpmultishiftqb takes the 8 bits at 3k of each token's dword (two
// tokens per qword: offsets 32 + 3k for the upper one), vpermb reads their low 6 bits, so
// the 5 bits above the code only pick a copy of the same entry.
static inline KVQ_QK3_TARGET void ci_fields3(VI u, VI tab, VI* x) {
  const VI lo = _mm512_set1_epi64(0x2926232009060300LL);  // 0, 3, 6, 9 | 32, 35, 38, 41
  const VI hi = _mm512_set1_epi64(0x35322F2C15120F0CLL);  // 12, 15, 18, 21 | 44, ...
  x[0] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(lo, u), tab);
  x[1] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(hi, u), tab);
}
// D packed 3-bit codes (8 per 3 bytes, code i at bits 3i..3i+2) -> D/2 bytes of 4-bit codes
// (code i in nibble i), D % 32 == 0. Per 32 codes: their 12 bytes in every 128-bit lane
// (a masked load: nothing past the row is read), vpshufb puts the two bytes holding code
// 8L + w in word w of lane L, vpsrlvw by 3w mod 8 and a mask leave the code, and each
// dword's two codes become one byte (w | w >> 12, vpmovdb).
static inline void cvt3to4_row(const uint8_t* src, int D, uint8_t* dst) {
  alignas(64) static const struct Tabs {
    uint8_t idx[64];
    uint16_t sh[32];
    Tabs() {
      for (int L = 0; L < 4; ++L)
        for (int w = 0; w < 8; ++w) {
          idx[16 * L + 2 * w] = (uint8_t)(3 * L + 3 * w / 8);
          idx[16 * L + 2 * w + 1] = (uint8_t)(3 * L + 3 * w / 8 + 1);
          sh[8 * L + w] = (uint16_t)(3 * w % 8);
        }
    }
  } tabs;
  const __m512i idx = _mm512_load_si512((const void*)tabs.idx);
  const __m512i sh = _mm512_loadu_si512((const void*)tabs.sh);
  for (int d = 0; d < D; d += 32) {
    const __m128i x = _mm_maskz_loadu_epi8((__mmask16)0x0FFF, src + d / 8 * 3);
    __m512i y = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(x), idx);
    y = _mm512_and_si512(_mm512_srlv_epi16(y, sh), _mm512_set1_epi16(7));
    y = _mm512_or_si512(y, _mm512_srli_epi32(y, 12));
    _mm_storeu_si128((__m128i*)(dst + d / 2), _mm512_cvtepi32_epi8(y));
  }
}
// dst[0..W) = (int8) rint(x * inv); |x * inv| <= 127.
static inline void vq8_store(VF x, VF inv, int8_t* dst) {
  _mm_storeu_si128((__m128i*)dst, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv))));
}

// Butterfly of lanes l and l + h (bit h of l clear) for h < W: (x_l + x_{l+h}, x_l - x_{l+h})
// (hadamard_body.h).
static inline VF vbfly(VF x, int h) {
  VF t;
  __mmask16 hi;
  switch (h) {
    case 1: t = _mm512_permute_ps(x, 0xB1); hi = 0xAAAA; break;
    case 2: t = _mm512_permute_ps(x, 0x4E); hi = 0xCCCC; break;
    case 4: t = _mm512_shuffle_f32x4(x, x, 0xB1); hi = 0xF0F0; break;
    default: t = _mm512_shuffle_f32x4(x, x, 0x4E); hi = 0xFF00; break;
  }
  return _mm512_mask_sub_ps(_mm512_add_ps(x, t), hi, t, x);
}

#define KVQ_HAS_PV_BYTE 0  // vpermps reads all 16 float levels at once (ld_t4x2)
#define KVQ_FOLD_QK 0  // (attn_avx2.cpp)
#define KVQ_HAS_PDEP 0  // cvt3to4_row only
#include "attn_body.h"

const TaskFn run_task = &run_task_impl;
const DecodeRowsFn decode_rows = &decode_rows_impl;
const HadamardFn hadamard_rows = &hadamard_rows_impl;

}  // namespace kvq_avx512
}  // namespace kvq_cpu

#pragma GCC pop_options
