// Paged attention, portable path: plain C++ "vectors" of 16 floats (the compiler uses
// whatever the baseline target has). Same lane count as the AVX-512 path, so the tests
// exercise attn_body.h's 16-lane logic (register blocking, transposed reductions) even on
// machines without AVX-512. See attn_body.h.
#include <math.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attn_common.h"

namespace kvq_cpu {
namespace kvq_scalar {

constexpr int W = 16;
struct VF {
  float v[W];
};

static inline VF vzero() { VF r; for (int i = 0; i < W; ++i) r.v[i] = 0.0f; return r; }
static inline VF vset(float x) { VF r; for (int i = 0; i < W; ++i) r.v[i] = x; return r; }
static inline VF vload(const float* p) { VF r; memcpy(r.v, p, sizeof(r.v)); return r; }
static inline void vstore(float* p, VF v) { memcpy(p, v.v, sizeof(v.v)); }
#define KVQ_EW(name, expr)                                        \
  static inline VF name(VF a, VF b) {                             \
    VF r;                                                         \
    for (int i = 0; i < W; ++i) { const float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } \
    return r;                                                     \
  }
KVQ_EW(vadd, x + y)
KVQ_EW(vsub, x - y)
KVQ_EW(vmul, x * y)
KVQ_EW(vdiv, x / y)
KVQ_EW(vmax, (x > y ? x : y))  // like maxps: y when either is NaN
KVQ_EW(vmin, (x < y ? x : y))
#undef KVQ_EW
static inline VF vfma(VF a, VF b, VF c) {
  VF r;
  // one rounding, like the SIMD paths' fma (libm's fmaf: baseline x86-64 has no fma
  // instruction), so every path decodes a value to the same float
  for (int i = 0; i < W; ++i) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
  return r;
}
static inline float vhsum(VF v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v.v[i];
  return s;
}
static inline float vhmax(VF v) {
  float s = v.v[0];
  for (int i = 1; i < W; ++i) s = v.v[i] > s ? v.v[i] : s;
  return s;
}
static inline float exp2_1(float x) {
  float t = x > -125.0f ? x : -125.0f;
  if (x != x) t = x;
  t = t < 127.0f ? t : 127.0f;
  if (x != x) return x;
  const float n = rintf(t), f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const float r = kvq::bits_float(kvq::float_bits(p) + ((uint32_t)(int32_t)n << 23));
  return x < -125.0f ? 0.0f : r;
}
static inline VF vexp2(VF x) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = exp2_1(x.v[i]);
  return r;
}
static inline VF vreduce(const VF* a) {
  VF r;
  for (int k = 0; k < W; ++k) r.v[k] = vhsum(a[k]);
  return r;
}
static inline VF ld_f16(const uint16_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = kvq::fp16_to_float(p[i]);
  return r;
}
// W floats -> bf16, round to nearest even, NaN -> 0x7FC0 (torch's cast).
static inline void st_bf16(uint16_t* p, VF x) {
  for (int i = 0; i < W; ++i) {
    const uint32_t u = kvq::float_bits(x.v[i]);
    p[i] = x.v[i] != x.v[i] ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}
// W floats -> fp16, round to nearest even (overflow -> Inf), NaN -> sign | 0x7E00 (torch's).
static inline void st_f16(uint16_t* p, VF x) {
  for (int i = 0; i < W; ++i) p[i] = out_fp16(x.v[i]);
}
static inline VF ld_bf16(const uint16_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = kvq::bf16_to_float(p[i]);
  return r;
}
static inline VF ld_u8(const uint8_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = (float)p[i];
  return r;
}
static inline VF ld_u4(const uint8_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = (float)((p[i >> 1] >> ((i & 1) * 4)) & 15);
  return r;
}
static inline VF ld_u2(const uint8_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = (float)((p[i >> 2] >> ((i & 3) * 2)) & 3);
  return r;
}
// Two chunks of 4-bit / 2-bit codes in the permuted lane order (see the AVX-512 path)
// through a table (tab[i] = level[i mod 2^b]): nuq's codebook, or the codes themselves.
static inline void ld_t4x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  for (int i = 0; i < W; ++i) {
    a.v[i] = tab[p[i] & 15];
    b.v[i] = tab[p[i] >> 4];
  }
}
static inline void ld_t2x2(const uint8_t* p, const float* tab, VF& a, VF& b) {
  for (int i = 0; i < W; ++i) {
    const int byte = p[i % (W / 2)], hi = i >= W / 2 ? 2 : 0;
    a.v[i] = tab[(byte >> hi) & 3];
    b.v[i] = tab[(byte >> (4 + hi)) & 3];
  }
}
static const float kCodes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static inline void ld_u4x2(const uint8_t* p, VF& a, VF& b) { ld_t4x2(p, kCodes, a, b); }
static inline void ld_u2x2(const uint8_t* p, VF& a, VF& b) { ld_t2x2(p, kCodes, a, b); }
static inline VF ld_e4m3(const uint8_t* p) {  // value * 2^-8, like the SIMD paths
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = kvq::fp8_to_float(p[i], kvq::ENC_FP8_E4M3) * 0.00390625f;
  return r;
}
static inline VF ld_e5m2(const uint8_t* p) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = kvq::fp8_to_float(p[i], kvq::ENC_FP8_E5M2);
  return r;
}

static inline VF ld_t4(const uint8_t* p, const float* tab) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = tab[(p[i >> 1] >> ((i & 1) * 4)) & 15];
  return r;
}
static inline VF ld_t3(const uint8_t* p, const float* tab) {
  VF r;
  for (int i = 0; i < W; ++i) {
    const uint8_t* g = p + (i / 8) * 3;
    const uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
    r.v[i] = tab[(w >> (3 * (i % 8))) & 7];
  }
  return r;
}
static inline VF ld_t2(const uint8_t* p, const float* tab) {
  VF r;
  for (int i = 0; i < W; ++i) r.v[i] = tab[(p[i >> 2] >> ((i & 3) * 2)) & 3];
  return r;
}

static inline void vdeint(VF a, VF b, VF& even, VF& odd) {
  for (int i = 0; i < W / 2; ++i) {
    even.v[i] = a.v[2 * i];
    even.v[W / 2 + i] = b.v[2 * i];
    odd.v[i] = a.v[2 * i + 1];
    odd.v[W / 2 + i] = b.v[2 * i + 1];
  }
}

static inline void vinter(VF e, VF o, VF& a, VF& b) {
  for (int i = 0; i < W / 2; ++i) {
    a.v[2 * i] = e.v[i];
    a.v[2 * i + 1] = o.v[i];
    b.v[2 * i] = e.v[W / 2 + i];
    b.v[2 * i + 1] = o.v[W / 2 + i];
  }
}

static inline VF vround(VF x) { for (int i = 0; i < W; ++i) x.v[i] = rintf(x.v[i]); return x; }

// lane l = base[l * stride]
static inline VF vgather(const float* base, int stride) {
  VF r;
  for (int l = 0; l < W; ++l) r.v[l] = base[(int64_t)l * stride];
  return r;
}

// The gather does it (attn_body.h transpose_tile); the AVX2 path shuffles instead.
static inline bool vtranspose_groups(const float*, int, int, float*) { return false; }

// ---- integer vectors for the int8-query Q.K (see attn_body.h "integer Q.K") -------------
// The plain-C statement of the integer arithmetic the SIMD paths compute (exactly).
struct VI {
  int32_t i[W];  // W int32 lanes, or 4W bytes (u8 codes / s8 query)
};
static inline VI ci_zero() { VI r; memset(&r, 0, sizeof(r)); return r; }
static inline VI ci_add(VI a, VI b) {
  for (int l = 0; l < W; ++l) a.i[l] += b.i[l];
  return a;
}
template <bool SMALL>
static inline VI ci_dot(VI acc, VI c, VI q) {
  const uint8_t* cb = (const uint8_t*)c.i;
  const int8_t* qb = (const int8_t*)q.i;
  for (int l = 0; l < W; ++l)
    for (int k = 0; k < 4; ++k) acc.i[l] += (int32_t)cb[4 * l + k] * (int32_t)qb[4 * l + k];
  return acc;
}
// 8-bit codes: the plain dot (no bias, see attn_avx2.cpp ci_wide).
constexpr int kCiWideBias = 0;
struct CiWide {
  VI c;
};
static inline CiWide ci_wide(VI c) { return {c}; }
static inline VI ci_dot_wide(VI acc, const CiWide& c, VI q) { return ci_dot<false>(acc, c.c, q); }
static inline VF ci_tof(VI a) { VF r; for (int l = 0; l < W; ++l) r.v[l] = (float)a.i[l]; return r; }
static inline VI ci_bcast4(const int8_t* p) {
  VI r;
  for (int l = 0; l < W; ++l) memcpy(&r.i[l], p, 4);
  return r;
}
template <int SH>
static inline VI ci_field(VI x, int mask) {
  VI r;
  const uint8_t* xb = (const uint8_t*)x.i;
  uint8_t* b = (uint8_t*)r.i;
  for (int i = 0; i < 4 * W; ++i) b[i] = (uint8_t)((xb[i] >> SH) & mask);
  return r;
}
static inline void ci_tr8(const uint8_t* const* rows, int off, int nd, VI* out) {
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < W; ++l) {
      out[j].i[l] = 0;
      if (j < nd) memcpy(&out[j].i[l], rows[l] + off + 4 * j, 4);
    }
}
typedef uint32_t VM;  // lane l: bit l
static inline VI ci_set1(int x) { VI r; for (int l = 0; l < W; ++l) r.i[l] = x; return r; }
static inline VI ci_iota() { VI r; for (int l = 0; l < W; ++l) r.i[l] = l; return r; }
#define KVQ_CI(name, expr)                                                          \
  static inline VI name(VI a, VI b) {                                               \
    VI r;                                                                           \
    for (int l = 0; l < W; ++l) { const int32_t x = a.i[l], y = b.i[l]; r.i[l] = (expr); } \
    return r;                                                                       \
  }
KVQ_CI(ci_mullo, (int32_t)((uint32_t)x * (uint32_t)y))
KVQ_CI(ci_and, x & y)
KVQ_CI(ci_srlv, (uint32_t)y >= 32u ? 0 : (int32_t)((uint32_t)x >> y))
#undef KVQ_CI
static inline VM ci_lt(VI a, VI b) {
  VM m = 0;
  for (int l = 0; l < W; ++l) m |= (VM)(a.i[l] < b.i[l]) << l;
  return m;
}
static inline VM vm_and(VM a, VM b) { return a & b; }
static inline VM vm_first(int n) { return n >= W ? 0xFFFFu : (1u << n) - 1; }
static inline VI ci_sel0(VM m, VI a) {
  for (int l = 0; l < W; ++l) if (!((m >> l) & 1)) a.i[l] = 0;
  return a;
}
static inline VF vsel0(VM m, VF a) {
  for (int l = 0; l < W; ++l) if (!((m >> l) & 1)) a.v[l] = 0.0f;
  return a;
}
static inline VI ci_gather(const void* base, VI off, VM m) {
  VI r;
  for (int l = 0; l < W; ++l) {
    r.i[l] = 0;
    if ((m >> l) & 1) memcpy(&r.i[l], (const uint8_t*)base + off.i[l], 4);
  }
  return r;
}
static inline VF vgather_idx(const float* base, VI idx, VM m) {
  VF r;
  for (int l = 0; l < W; ++l) r.v[l] = (m >> l) & 1 ? base[idx.i[l]] : 0.0f;
  return r;
}
static inline VI ci_load(const void* p, VM m) {
  VI r;
  for (int l = 0; l < W; ++l) {
    r.i[l] = 0;
    if ((m >> l) & 1) memcpy(&r.i[l], (const int32_t*)p + l, 4);
  }
  return r;
}
static inline VF vload_m(const float* p, VM m) {
  VF r;
  for (int l = 0; l < W; ++l) r.v[l] = (m >> l) & 1 ? p[l] : 0.0f;
  return r;
}
static inline VF vtab(const float* tab, int, VI idx, VM m) { return vgather_idx(tab, idx, m); }
static inline VF ci_f16lo(VI a) {
  VF r;
  for (int l = 0; l < W; ++l) r.v[l] = kvq::fp16_to_float((uint16_t)(a.i[l] & 0xFFFF));
  return r;
}
static inline void ci_store(int32_t* p, VI a) { memcpy(p, a.i, sizeof(a.i)); }
// Four rows of W floats <-> W quads: out[4t + k] = r[k][t].
static inline void vtr4_store(const VF r[4], float* out) {
  for (int t = 0; t < W; ++t)
    for (int k = 0; k < 4; ++k) out[4 * t + k] = r[k].v[t];
}
static inline void vtr4_load(const float* in, VF r[4]) {
  for (int t = 0; t < W; ++t)
    for (int k = 0; k < 4; ++k) r[k].v[t] = in[4 * t + k];
}
static inline void vadd4(float* dst, const float* src) {
  for (int k = 0; k < 4; ++k) dst[k] += src[k];
}

static inline VI ci_tab16(const uint8_t* t) {
  VI r;
  for (int i = 0; i < 4 * W; ++i) ((uint8_t*)r.i)[i] = t[i & 15];
  return r;
}
static inline VI ci_lut16(VI x, VI tab) {
  VI r;
  const uint8_t* xb = (const uint8_t*)x.i;
  for (int i = 0; i < 4 * W; ++i) ((uint8_t*)r.i)[i] = ((const uint8_t*)tab.i)[xb[i] & 15];
  return r;
}
// 3-bit codes as stored (the AVX-512 body's VBMI primitives, stated in C).
#define KVQ_HAS_QK3 1
#define KVQ_QK3_TARGET
static inline void ci_units3(VI w0, VI w1, VI w2, VI* u) {
  for (int l = 0; l < W; ++l) {
    const uint32_t a = (uint32_t)w0.i[l], b = (uint32_t)w1.i[l], c = (uint32_t)w2.i[l];
    u[0].i[l] = (int32_t)a;
    u[1].i[l] = (int32_t)((a >> 24) | (b << 8));
    u[2].i[l] = (int32_t)((b >> 16) | (c << 16));
    u[3].i[l] = (int32_t)(c >> 8);
  }
}
static inline VI ci_tab3(const uint8_t* lut) {
  VI r;
  for (int i = 0; i < 4 * W; ++i) ((uint8_t*)r.i)[i] = lut ? lut[i & 7] : (uint8_t)(i & 7);
  return r;
}
static inline void q8_perm64(const int8_t* src, const uint8_t* idx, int8_t* dst) {
  int8_t t[64];
  memcpy(t, src, 64);
  for (int p = 0; p < 64; ++p) dst[p] = t[idx[p]];
}
static inline void ci_fields3(VI u, VI tab, VI* x) {
  const uint8_t* t = (const uint8_t*)tab.i;
  for (int l = 0; l < W; ++l)
    for (int k = 0; k < 8; ++k)
      ((uint8_t*)x[k / 4].i)[4 * l + k % 4] = t[((uint32_t)u.i[l] >> (3 * k)) & 7];
}
static inline void cvt3to4_row(const uint8_t* src, int D, uint8_t* dst) {
  for (int d = 0; d < D; d += 8) {
    const uint8_t* g = src + d / 8 * 3;
    const uint32_t w = (uint32_t)g[0] | ((uint32_t)g[1] << 8) | ((uint32_t)g[2] << 16);
    for (int i = 0; i < 8; i += 2)
      dst[(d + i) / 2] = (uint8_t)(((w >> (3 * i)) & 7u) | (((w >> (3 * i + 3)) & 7u) << 4));
  }
}
static inline void vq8_store(VF x, VF inv, int8_t* dst) {
  for (int l = 0; l < W; ++l) dst[l] = (int8_t)(int32_t)rintf(x.v[l] * inv.v[l]);
}

// Butterfly of lanes l and l + h (bit h of l clear) for h < W: (x_l + x_{l+h}, x_l - x_{l+h})
// (hadamard_body.h).
static inline VF vbfly(VF x, int h) {
  VF r;
  for (int l = 0; l < W; ++l) r.v[l] = (l & h) ? x.v[l - h] - x.v[l] : x.v[l] + x.v[l + h];
  return r;
}

#define KVQ_HAS_BF16DP 0  // no vdpbf16ps: bf16 keys take the fp32 Q.K (qk_fused)
#define KVQ_HAS_PV_BF16 0  // and the decode P.V keeps fp32 weights (pv_fused)
#define KVQ_HAS_PV_BYTE 0
#define KVQ_FOLD_QK 0  // (attn_avx2.cpp)
#define KVQ_HAS_PDEP 0  // cvt3to4_row only
#include "attn_body.h"

const TaskFn run_task = &run_task_impl;
const DecodeRowsFn decode_rows = &decode_rows_impl;
const HadamardFn hadamard_rows = &hadamard_rows_impl;

}  // namespace kvq_scalar
}  // namespace kvq_cpu
