// The Codec of the int[6] every op takes from Python (vllm_kvq.formats: Codec.as_ints()),
// checked once here for all of them (CPU, CUDA, the CUDA emulation and standalone builds).
#pragma once
#include <c10/util/Exception.h>

#include <cstddef>

#include "kvq_layout.h"

namespace kvq {

template <class Ints>  // std::vector<int64_t> or c10::IntArrayRef
inline Codec to_codec(const Ints& v, const char* what) {
  TORCH_CHECK(v.size() == (size_t)kCodecInts, what, " must have ", kCodecInts, " ints, got ",
              v.size());
  return Codec{(int32_t)v[0], (int32_t)v[1], (int32_t)v[2],
               (int32_t)v[3], (int32_t)v[4], (int32_t)v[5]};
}

}  // namespace kvq
