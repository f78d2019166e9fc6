// Checks shared by the CPU ops (op_checks.cpp) and the dispatch level they use.
#pragma once
// Tensor and its methods only: <torch/all.h> cost ~15 s of parsing per translation unit
#include <ATen/core/Tensor.h>

#include <vector>

#include "kvq_layout.h"

namespace kvq_cpu {

// A codec's fields are a combination the kernels implement for head_dim D and block size B
// (what: the argument's name in the error).
void check_codec(const kvq::Codec& c, int D, int B, const char* what);

// Both codecs of a format (k_codec, v_codec), and what they must agree on (the sink).
void check_codecs(const kvq::Codec& kc, const kvq::Codec& vc, int D, int B);

// A nuq codec's codebook (float32 [2^bits], ascending, finite, in [-1, 1]) copied out of its
// tensor; empty for other codecs.
std::vector<float> codebook(const kvq::Codec& c, const at::Tensor& levels, const char* what);

// A float tensor's dtype as the kernels number it (attn_common.h DType; write_common.h
// InDType is the same numbering); anything else is an error naming `what`.
int32_t dtype_of(const at::Tensor& t, const char* what);

// The SIMD path the ops dispatch to (attention.cpp): 0 scalar, 1 avx2, 2 avx512
// (KVQ_SIMD lowers it).
int simd_level();

}  // namespace kvq_cpu
