// The Codec of the int[7] every op takes from Python (vllm_kvq.formats: Codec.as_ints()),
// checked once here for all of them (CPU, CUDA, the CUDA emulation and standalone builds).
#pragma once
#include <ATen/core/Tensor.h>  // Tensor and ScalarType only (ATen/ATen.h: +7 s a TU)
#include <c10/util/Exception.h>

#include <cstddef>
#include <vector>

#include "kvq_layout.h"

namespace kvq {

template <class Ints>  // std::vector<int64_t> or c10::IntArrayRef
inline Codec to_codec(const Ints& v, const char* what) {
  TORCH_CHECK(v.size() == (size_t)kCodecInts, what, " must have ", kCodecInts, " ints, got ",
              v.size());
  return Codec{(int32_t)v[0], (int32_t)v[1], (int32_t)v[2],
               (int32_t)v[3], (int32_t)v[4], (int32_t)v[5], (int32_t)v[6]};
}

// The per-head static scales of a tensor/head codec (1 or H values, any float dtype) as H
// floats; other codecs carry their scales in the pages and get 1.0 (k_scale is not read).
inline std::vector<float> static_scales(const Codec& c, const at::Tensor& s, int H,
                                        const char* what) {
  std::vector<float> out(H, 1.0f);
  if (c.granularity == GRAN_TENSOR || c.granularity == GRAN_HEAD) {
    TORCH_CHECK(s.numel() == H || s.numel() == 1, what, " must have 1 or H=", H,
                " values for a static-scale codec, got ", s.numel());
    at::Tensor f = s.to(at::kFloat).contiguous();
    for (int h = 0; h < H; ++h) out[h] = f.data_ptr<float>()[s.numel() == 1 ? 0 : h];
  }
  return out;
}

}  // namespace kvq
