// Plain-C++ interface between the cache writer (cache_write.cpp: checks, work split,
// dispatch) and its per-ISA encoders (write_scalar.cpp, write_avx2.cpp).
//
// No torch types here, for the reason attn_common.h gives: write_avx2.cpp is compiled under
// `#pragma GCC target` and must not instantiate inline code that other units also do.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvq_layout.h"
#include "kvq_numeric.h"

namespace kvq_cpu {

// ---- input rows ----------------------------------------------------------------------
enum InDType { IN_F32 = 0, IN_F16 = 1, IN_BF16 = 2 };

struct RowSrc {
  const uint8_t* base;
  int64_t stride_n, stride_h;  // bytes
  InDType dt;
  int esize;
};

// What a side's quantizer needs besides its codec: the nuq codebook's midpoints.
struct SideQ {
  kvq::Codec c;
  float mids[kvq::kMaxNuqLevels];    // nuq: (level[k] + level[k+1]) * 0.5, 2^bits - 1 of them
  float levels[kvq::kMaxNuqLevels];  // nuq: the codebook (the outlier slots' dense decode)
};

// kvq::group_params of a codec (the rule shared with the CUDA writer).
inline kvq::QParams group_params(const kvq::Codec& c, float lo, float hi, float amax, bool any) {
  return kvq::group_params(c.encoding, c.bits, c.symmetric != 0, lo, hi, amax, any);
}

// v is already fp16-rounded (QParams); -0.0 keeps its sign, as torch stores it.
inline void store_fp16(uint8_t* plane, int32_t off, int idx, float v) {
  const uint16_t h = kvq::float_to_fp16_sat(v);
  memcpy(plane + off + 2 * idx, &h, 2);
}

// Outlier slots of token t (kvq::select_outliers): writes the slots' channels and returns
// in sx the values the dense scales are computed from (x with the outliers replaced by NaN,
// which every statistic skips). Once the token's codes and scales are written,
// finish_outliers stores each slot's correction x - (the dense decode at its channel).
// Shared by both paths (write_scalar.cpp).
void encode_outliers(const kvq::Codec& c, const kvq::Region& r, uint8_t* plane, int t,
                     const float* x, int D, float* sx);
void finish_outliers(const SideQ& q, const kvq::Region& r, uint8_t* plane, int t,
                     const float* x, int D, float static_scale);

// Each path: load_row turns row (i, h) of a source into D floats; encode_token_row quantizes
// one token row x[D] (non-channel codecs) into row t of a region; encode_channel_group
// quantizes G = codec.group whole tokens x[G][D] (per-channel codec) into rows t0..t0+G-1.
// Scratch: sxbuf rows*D floats (outlier codecs), codes rows*D bytes (AVX2's unpacked codes).
// Both paths write bytes identical to vllm_kvq/reference.py's write_cache.
namespace write_scalar {
void load_row(const RowSrc& s, int64_t i, int h, int D, float* out);
void encode_token_row(const SideQ& q, const kvq::Region& r, uint8_t* plane, int t,
                      const float* x, int D, float static_scale, float* sxbuf);
void encode_channel_group(const SideQ& q, const kvq::Region& r, uint8_t* plane, int t0,
                          const float* x, int D, float* sxbuf);
}  // namespace write_scalar

namespace write_avx2 {  // needs D % 8 == 0
void load_row(const RowSrc& s, int64_t i, int h, int D, float* out);
void encode_token_row(const SideQ& q, const kvq::Region& r, uint8_t* plane, int t,
                      const float* x, int D, float static_scale, uint8_t* codes,
                      float* sxbuf);
void encode_channel_group(const SideQ& q, const kvq::Region& r, uint8_t* plane, int t0,
                          const float* x, int D, uint8_t* codes, float* sxbuf);
}  // namespace write_avx2

}  // namespace kvq_cpu
