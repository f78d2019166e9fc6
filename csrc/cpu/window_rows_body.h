// The 8-bit residual window's row codecs (csrc/cpu/window_stage.cpp), included once per
// SIMD path inside its own namespace and target (scalar, AVX2, AVX-512): plain loops the
// compiler vectorizes, the same exact arithmetic on every path (IEEE products, integer
// rounding steps; -ffp-contract=off). vllm_kvq/residual.py quantize_window_rows and
// dequantize_window_rows are the reference. Needs <cmath>, <cstdint>, <cstring>, kvq_layout.h.

// One (K or V, head) row of D floats -> D int8 codes round(x * (1 / s)) and the float32
// scale s = max|x| / 127 (1 for an all-zero row); a non-finite max stores codes 0 and the
// scale as it is, so the row reads back as NaN. max|x| as an integer max of the bits with
// the sign cleared (ordered like the floats; above 0x7f800000 is NaN); x * (1 / s) rounded
// half to even by adding and subtracting 1.5 * 2^23 (exact for |x / s| <= 2^22).
inline void quantize_f32_row_i8(const float* x, int64_t D, uint8_t* out) {
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < D; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    u &= 0x7fffffffu;
    amax_bits = u > amax_bits ? u : amax_bits;
  }
  float amax;
  std::memcpy(&amax, &amax_bits, sizeof amax);
  float s = amax / 127.f;
  if (s == 0.f) s = 1.f;
  int8_t* codes = reinterpret_cast<int8_t*>(out);
  if (std::isfinite(s)) {
    constexpr float kRound = 12582912.f;  // 1.5 * 2^23
    const float inv = 1.f / s;
    for (int64_t i = 0; i < D; ++i) {
      float c = (x[i] * inv + kRound) - kRound;
      c = c > 127.f ? 127.f : c;
      c = c < -127.f ? -127.f : c;
      codes[i] = (int8_t)(int32_t)c;
    }
  } else {
    std::memset(codes, 0, (size_t)D);
  }
  std::memcpy(out + D, &s, sizeof s);
}

// One int8 row (D codes + its float32 scale; kvq::int8_row_bytes(D) bytes) -> D floats
// code * s: the one decoder of the attention sink's rows (the decode kernels, attn_body.h,
// and dequantize_pages, dequant.cpp). A non-finite scale reads back as NaN (codes 0).
inline void dequantize_row_i8_f32(const uint8_t* in, int64_t D, float* out) {
  float s;
  std::memcpy(&s, in + D, sizeof s);
  const int8_t* codes = reinterpret_cast<const int8_t*>(in);
  for (int64_t i = 0; i < D; ++i) out[i] = static_cast<float>(codes[i]) * s;
}

// One K or V row (H segments of D codes + a float32 scale) to bf16 with c10's round to
// nearest even, as branch-free integer steps (c10's constructor does not vectorize); a
// non-finite scale makes its segment NaN, stored as c10 (and torch's .to()) stores NaN.
inline void dequantize_row_i8_bf16(const uint8_t* in, int64_t H, int64_t D, uint16_t* out) {
  for (int64_t h = 0; h < H; ++h, in += D + kvq::kWindowScaleBytes, out += D) {
    float s;
    std::memcpy(&s, in + D, sizeof s);
    const int8_t* codes = reinterpret_cast<const int8_t*>(in);
    if (!std::isfinite(s)) {
      for (int64_t i = 0; i < D; ++i) out[i] = 0x7fc0;
      continue;
    }
    for (int64_t i = 0; i < D; ++i) {
      const float f = static_cast<float>(codes[i]) * s;
      uint32_t u;
      std::memcpy(&u, &f, sizeof u);
      out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
}

