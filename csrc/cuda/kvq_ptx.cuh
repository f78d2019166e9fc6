// The few PTX instructions the kernels use, each with a host emulation (KVQ_CUDA_EMULATE).
//
// Packed 16-bit floats travel as uint32_t (low half = lower index), so no cuda_fp16 types
// appear in the kernels. mma.sync m16n8k16 fragment layout (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A 16x16 row-major: a0 = A[g][2t..2t+1],   a1 = A[g+8][2t..2t+1],
//                      a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9]
//   B 16x8 (k x n):    b0 = B[2t..2t+1][g],   b1 = B[2t+8..2t+9][g]
//   C/D 16x8 f32:      d0,d1 = D[g][2t..2t+1], d2,d3 = D[g+8][2t..2t+1]
#pragma once
#include <math.h>
#include <stdint.h>

#include "../kvq_numeric.h"
#include "kvq_cuda_compat.cuh"

namespace kvq_cuda {

// ---- host-side helpers for the emulation ----------------------------------------------
KVQ_HOSTDEV uint16_t host_f32_to_f16_rn(float x) {  // IEEE round-to-nearest-even, Inf on overflow
  const uint32_t u = kvq::float_bits(x);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7e00u;
  const float ax = fabsf(x);
  if (ax >= 65520.0f) return sign | 0x7c00u;
  return sign | (uint16_t)kvq::encode_small_float(ax, 5, 10);
}

#if defined(KVQ_CUDA_EMULATE)
inline float emu_h2f(uint16_t h, bool bf) { return bf ? kvq::bf16_to_float(h) : kvq::fp16_to_float(h); }
inline uint16_t emu_f2h(float f, bool bf) { return bf ? kvq::float_to_bf16(f) : host_f32_to_f16_rn(f); }
inline uint32_t emu_pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }
template <class Op>
inline uint32_t emu_h2op(uint32_t a, uint32_t b, uint32_t c, Op op) {
  uint16_t r[2];
  for (int i = 0; i < 2; ++i) {
    const float x = emu_h2f((uint16_t)(a >> (16 * i)), false);
    const float y = emu_h2f((uint16_t)(b >> (16 * i)), false);
    const float z = emu_h2f((uint16_t)(c >> (16 * i)), false);
    r[i] = emu_f2h((float)op((double)x, (double)y, (double)z), false);
  }
  return emu_pack(r[0], r[1]);
}
#endif

// ---- byte permute ----------------------------------------------------------------------
KVQ_DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(KVQ_CUDA_EMULATE)
  const uint64_t v = (uint64_t)a | ((uint64_t)b << 32);
  uint32_t d = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t n = (sel >> (4 * k)) & 0xf;
    uint32_t byte = (uint32_t)(v >> (8 * (n & 7))) & 0xff;
    if (n & 8) byte = (byte & 0x80) ? 0xff : 0;
    d |= byte << (8 * k);
  }
  return d;
#else
  return __byte_perm(a, b, sel);
#endif
}

// ---- packed fp16 arithmetic ------------------------------------------------------------
KVQ_DEV uint32_t hsub2(uint32_t a, uint32_t b) {
#if defined(KVQ_CUDA_EMULATE)
  return emu_h2op(a, b, 0, [](double x, double y, double) { return x - y; });
#else
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#endif
}
KVQ_DEV uint32_t hmul2(uint32_t a, uint32_t b) {
#if defined(KVQ_CUDA_EMULATE)
  return emu_h2op(a, b, 0, [](double x, double y, double) { return x * y; });
#else
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#endif
}
KVQ_DEV uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(KVQ_CUDA_EMULATE)
  return emu_h2op(a, b, c, [](double x, double y, double z) { return x * y + z; });
#else
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#endif
}

// ---- conversions -----------------------------------------------------------------------
// Two floats -> packed fp16 (BF = false) or bf16 (BF = true), round to nearest even.
template <bool BF>
KVQ_DEV uint32_t pack2(float lo, float hi) {
#if defined(KVQ_CUDA_EMULATE)
  return emu_pack(emu_f2h(lo, BF), emu_f2h(hi, BF));
#else
  uint32_t d;
  if constexpr (BF) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
#endif
}
KVQ_DEV float h2f(uint16_t h) {
#if defined(KVQ_CUDA_EMULATE)
  return kvq::fp16_to_float(h);
#else
  float f;
  asm("{.reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t;}" : "=f"(f) : "h"(h));
  return f;
#endif
}
KVQ_DEV float bf2f(uint16_t h) { return kvq::bits_float((uint32_t)h << 16); }
// A 16-bit float of either kind -> float.
template <bool BF>
KVQ_DEV float x2f(uint16_t h) {
  if constexpr (BF) return bf2f(h); else return h2f(h);
}

// ---- tensor cores: D += A * B, m16n8k16, fp32 accumulate -------------------------------
template <bool BF>
KVQ_DEV void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                      uint32_t b0, uint32_t b1) {
#if defined(KVQ_CUDA_EMULATE)
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  ::kvq_emu::exchange_publish(mine, 6);
  const int ln = ::kvq_emu::lane(), g = ln >> 2, t = ln & 3;
  auto elem = [](uint32_t w, int hi) { return emu_h2f((uint16_t)(w >> (16 * hi)), BF); };
  // A[row][k]: held by lane (row%8)*4 + (k%8)/2, register (row>=8) + 2*(k>=8), half k%2.
  auto A = [&](int row, int k) {
    const int src = (row & 7) * 4 + ((k & 7) >> 1);
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return elem(::kvq_emu::exchange_read(src, reg), k & 1);
  };
  // B[k][n]: held by lane n*4 + (k%8)/2, register 4 + (k>=8), half k%2.
  auto B = [&](int k, int n) {
    const int src = n * 4 + ((k & 7) >> 1);
    return elem(::kvq_emu::exchange_read(src, 4 + (k >= 8 ? 1 : 0)), k & 1);
  };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    double acc = d[i];
    for (int k = 0; k < 16; ++k) acc += (double)A(row, k) * (double)B(k, col);
    out[i] = (float)acc;
  }
  ::kvq_emu::exchange_done();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
#else
  if constexpr (BF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

// Hint: bring the cache line holding p into L1 (no-op in the emulation).
KVQ_DEV void prefetch_l1(const void* ptr) {
#if defined(KVQ_CUDA_EMULATE)
  (void)ptr;
#else
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
#endif
}

// Logit soft-capping in the log2 domain (c = logits_soft_cap * log2 e; 0: none):
// x -> c tanh(x / c), which commutes with the log2 scaling of the logits.
KVQ_DEV float soft_cap(float x, float c) { return c > 0.0f ? c * tanhf(x / c) : x; }

KVQ_DEV float fast_exp2(float x) {
#if defined(KVQ_CUDA_EMULATE)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

}  // namespace kvq_cuda
