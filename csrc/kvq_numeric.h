// Scalar number formats shared by the CPU and CUDA kernels: fp16, bf16, fp8 e4m3/e5m2
// conversions (round-to-nearest-even, matching torch's casts), bit packing of b-bit codes,
// and the quantization rules of every codec. The PyTorch reference
// (vllm_kvq/reference.py) implements the same rules with torch ops; tests hold them equal.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvq_layout.h"

namespace kvq {

KVQ_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u; memcpy(&u, &x, 4); return u;
#endif
}
KVQ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x; memcpy(&x, &u, 4); return x;
#endif
}

// ---- 16-bit floats -------------------------------------------------------------------
KVQ_HD float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }
KVQ_HD uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

KVQ_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero / subnormal: man * 2^-24
    float v = (float)man * 5.9604644775390625e-08f;
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

// Generic IEEE-style encoder for a finite |x| that fits: RNE, subnormals, no saturation.
// Works for fp16 (5,10), e5m2 (5,2) and e4m3fn (4,3).
KVQ_HD uint32_t encode_small_float(float ax, int exp_bits, int man_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const float min_normal = ldexpf(1.0f, 1 - bias);
  if (ax < min_normal) {  // subnormal quantum 2^(1-bias-man_bits); q == 2^man_bits is min normal
    return (uint32_t)rintf(ldexpf(ax, bias - 1 + man_bits));
  }
  int e;
  const float m = frexpf(ax, &e);  // ax = m * 2^e, m in [0.5, 1)
  e -= 1;                          // ax = (2m) * 2^e, 2m in [1, 2)
  uint32_t q = (uint32_t)rintf((2.0f * m - 1.0f) * (float)(1 << man_bits));
  if (q == (1u << man_bits)) { q = 0; e += 1; }
  return ((uint32_t)(e + bias) << man_bits) | q;
}

constexpr float kFp16Max = 65504.0f;
// Scales and zero-points are stored as fp16, saturated (never Inf).
KVQ_HD uint16_t float_to_fp16_sat(float x) {
  if (x != x) return 0x7e00;
  const uint16_t sign = (float_bits(x) >> 16) & 0x8000;  // keeps -0.0, as torch does
  float ax = fabsf(x);
  if (ax > kFp16Max) ax = kFp16Max;
  return sign | (uint16_t)encode_small_float(ax, 5, 10);
}

// ---- fp8 -----------------------------------------------------------------------------
constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
KVQ_HD float fp8_max(int32_t encoding) { return encoding == ENC_FP8_E4M3 ? kE4m3Max : kE5m2Max; }

// Callers pass a finite value already clamped to [-fp8_max, fp8_max].
KVQ_HD uint8_t float_to_fp8(float x, int32_t encoding) {
  const uint8_t sign = (float_bits(x) >> 24) & 0x80;
  const float ax = fabsf(x);
  const uint32_t mag = encoding == ENC_FP8_E4M3 ? encode_small_float(ax, 4, 3)
                                                : encode_small_float(ax, 5, 2);
  return sign | (uint8_t)mag;
}
KVQ_HD float fp8_to_float(uint8_t v, int32_t encoding) {
  const int man_bits = encoding == ENC_FP8_E4M3 ? 3 : 2;
  const int bias = encoding == ENC_FP8_E4M3 ? 7 : 15;
  const int exp = (v & 0x7f) >> man_bits, man = v & ((1 << man_bits) - 1);
  float mag = exp == 0 ? ldexpf((float)man, 1 - bias - man_bits)
                       : ldexpf(1.0f + (float)man / (float)(1 << man_bits), exp - bias);
  return (v & 0x80) ? -mag : mag;
}

// ---- b-bit codes -------------------------------------------------------------------
// Value i of a row occupies bits [i*b, i*b+b) of the row read as a little-endian bit
// string (int4: low nibble first; int2: lowest pair first; int3: 8 values per 3 bytes).
KVQ_HD uint32_t get_code(const uint8_t* row, int i, int bits) {
  if (bits == 8) return row[i];
  const int bit = i * bits, byte = bit >> 3, shift = bit & 7;
  uint32_t w = row[byte];
  if (shift + bits > 8) w |= (uint32_t)row[byte + 1] << 8;
  return (w >> shift) & ((1u << bits) - 1u);
}
KVQ_HD void put_code(uint8_t* row, int i, int bits, uint32_t code) {
  if (bits == 8) { row[i] = (uint8_t)code; return; }
  const int bit = i * bits, byte = bit >> 3, shift = bit & 7;
  const uint32_t mask = (1u << bits) - 1u;
  uint32_t w = row[byte] | ((shift + bits > 8) ? (uint32_t)row[byte + 1] << 8 : 0u);
  w = (w & ~(mask << shift)) | ((code & mask) << shift);
  row[byte] = (uint8_t)w;
  if (shift + bits > 8) row[byte + 1] = (uint8_t)(w >> 8);
}

// ---- quantization rules (one group of values sharing a scale) --------------------------
// Non-finite policy, the same for every codec: NaN is stored as 0, +-Inf as the largest
// magnitude the group can represent; neither widens the group's range, so one bad value
// never spoils its neighbours. A zero-range group stores scale 0 and decodes exactly.
struct QParams {
  float scale;  // fp16-rounded for dynamic scales, the given one for static scales
  float zero;   // fp16-rounded minimum for asymmetric INT; 0 otherwise
};

KVQ_HD int32_t int_levels(int bits) { return (1 << bits) - 1; }   // asym codes 0..levels
KVQ_HD int32_t int_half(int bits) { return (1 << (bits - 1)) - 1; }  // sym codes -half..half

// Asymmetric from the finite min/max of a group.
KVQ_HD QParams int_asym_params(float lo, float hi, int bits) {
  QParams p;
  p.scale = fp16_to_float(float_to_fp16_sat((hi - lo) / (float)int_levels(bits)));
  p.zero = fp16_to_float(float_to_fp16_sat(lo));
  return p;
}
// Symmetric / fp8 dynamic from the finite absolute maximum of a group.
KVQ_HD QParams absmax_params(float amax, float qmax) {
  QParams p;
  p.scale = fp16_to_float(float_to_fp16_sat(amax / qmax));
  p.zero = 0.0f;
  return p;
}

// NaN -> 0; +-Inf -> +-big (clamped to the group's range by the caller's clamp).
KVQ_HD float sanitize(float x) {
  if (x != x) return 0.0f;
  if (isinf(x)) return x > 0.0f ? 3.0e38f : -3.0e38f;
  return x;
}

KVQ_HD uint32_t quantize_int(float x, const QParams& p, int bits, bool symmetric) {
  x = sanitize(x);
  if (symmetric) {
    const int32_t half = int_half(bits);
    float q = p.scale > 0.0f ? rintf(x / p.scale) : 0.0f;
    q = fminf(fmaxf(q, (float)-half), (float)half);
    return (uint32_t)((int32_t)q + (1 << (bits - 1)));
  }
  float q = p.scale > 0.0f ? rintf((x - p.zero) / p.scale) : 0.0f;
  q = fminf(fmaxf(q, 0.0f), (float)int_levels(bits));
  return (uint32_t)q;
}
KVQ_HD float dequantize_int(uint32_t code, float scale, float zero, int bits, bool symmetric) {
  if (symmetric) return (float)((int32_t)code - (1 << (bits - 1))) * scale;
  return (float)code * scale + zero;
}

KVQ_HD uint8_t quantize_fp8(float x, float scale, int32_t encoding) {
  x = sanitize(x);
  if (!(scale > 0.0f)) return 0;
  const float m = fp8_max(encoding);
  return float_to_fp8(fminf(fmaxf(x / scale, -m), m), encoding);
}

// ---- nuq: a b-bit index into a per-layer codebook ---------------------------------------
// Normalisation exactly as INT asymmetric but centred: over the group's dense finite values
// zero = fp16((hi + lo) / 2), scale = fp16((hi - lo) / 2), so x_norm = (x - zero) / scale
// lies in [-1, 1]. The codebook is 2^b float32 levels, ascending, in [-1, 1] (one table per
// layer and side, from the calibration file). code = the nearest level, decided through
// the fp32 midpoints mid[k] = (level[k] + level[k+1]) * 0.5: code = #{k : x_norm > mid[k]}
// (a value exactly on a midpoint takes the lower index). x = level[code] * scale + zero.
// With the uniform grid level[k] = -1 + 2k/(2^b - 1) this is INT asymmetric up to the
// fp16 rounding of the (different) scale and zero.
constexpr int kMaxNuqLevels = 16;

KVQ_HD QParams nuq_params(float lo, float hi) {
  QParams p;
  p.scale = fp16_to_float(float_to_fp16_sat((hi - lo) / 2.0f));
  p.zero = fp16_to_float(float_to_fp16_sat((hi + lo) / 2.0f));
  return p;
}
// Dynamic parameters (INT asym/sym, nuq, fp8) of a scale group from its finite values' min,
// max and |max| (any: whether it had a finite value at all). One rule for every writer:
// the CPU paths (csrc/cpu/write_common.h) and the CUDA kernels (kvq_write_cache.cuh).
KVQ_HD QParams group_params(int32_t encoding, int32_t bits, bool symmetric, float lo, float hi,
                            float amax, bool any) {
  if (!any) { lo = 0.0f; hi = 0.0f; }
  if (encoding == ENC_NUQ) return nuq_params(lo, hi);
  if (encoding == ENC_INT) {
    if (symmetric) return absmax_params(amax, (float)int_half(bits));
    return int_asym_params(lo, hi, bits);
  }
  return absmax_params(amax, fp8_max(encoding));  // fp8 dynamic
}
KVQ_HD void nuq_midpoints(const float* levels, int n, float* mids) {
  for (int k = 0; k + 1 < n; ++k) mids[k] = (levels[k] + levels[k + 1]) * 0.5f;
}
// Non-finite policy as INT: NaN -> the level nearest the value 0, +-Inf -> the extremes.
KVQ_HD uint32_t quantize_nuq(float x, const QParams& p, const float* mids, int n) {
  x = sanitize(x);
  if (!(p.scale > 0.0f)) return 0;
  const float y = (x - p.zero) / p.scale;
  uint32_t code = 0;
  for (int k = 0; k + 1 < n; ++k) code += y > mids[k] ? 1u : 0u;
  return code;
}
KVQ_HD float dequantize_nuq(uint32_t code, float scale, float zero, const float* levels) {
  return levels[code] * scale + zero;
}

// ---- sparse outliers (Codec.outliers slots per token per kv head) -----------------------
// The rule, shared by the reference, the CPU and the CUDA kernels: of one token's head_dim
// values, the `n` finite values of largest |x| (equal |x|: the lower channel first), in that
// order. They are excluded from the dense scale statistics (min/max of their group, or of
// their channel over the token group) and their dense codes are whatever the group's
// quantizer gives them; the token's slots store each one's correction x - (the dense decode
// there) as fp16 (saturated), written after the codes and scales, and a read adds it: the
// value comes back to within fp16 rounding of the correction (at most 2|x| apart), and
// the attention kernels add the corrections sparsely without decoding the codes there.
// Fewer finite values than slots leave the last slots empty (channel kNoOutlier). Returns
// how many slots were filled.
KVQ_HD int select_outliers(const float* x, int D, int n, int32_t* chans) {
  uint32_t taken[16] = {0};  // D <= 512
  int filled = 0;
  for (int j = 0; j < n; ++j) {
    int best = -1;
    float bv = -1.0f;
    for (int d = 0; d < D; ++d) {
      const float v = x[d];
      if (!(fabsf(v) <= 3.4028234663852886e38f)) continue;  // NaN / Inf
      if (taken[d >> 5] >> (d & 31) & 1u) continue;
      const float a = fabsf(v);
      if (a > bv) { bv = a; best = d; }
    }
    if (best < 0) break;
    taken[best >> 5] |= 1u << (best & 31);
    chans[filled++] = best;
  }
  return filled;
}

}  // namespace kvq
