// CPU implementations of the ops declared in csrc/torch_bindings.cpp.
#pragma once
// Tensor and its methods only: <torch/all.h> cost ~15 s of parsing per translation unit
#include <ATen/core/Tensor.h>

namespace kvq_cpu {

// key/value: [N, H, D] fp32/fp16/bf16; cache: uint8 [num_blocks, H, block_size, C];
// slot_mapping: int64 [N] (-1 = padding); k_scale/v_scale: fp32 [H] static scales;
// k_levels/v_levels: fp32 [2^bits] codebooks of nuq codecs (ignored, may be empty, else).
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                 const at::Tensor& slot_mapping, const std::vector<int64_t>& k_codec,
                 const std::vector<int64_t>& v_codec, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& k_levels,
                 const at::Tensor& v_levels);

// out/query: [T, Hq, D]; block_table int32 [S, max_blocks]; seq_lens int32 [S];
// query_start_loc int32 [S+1]; staging_k/v [Ns, H, D] (dtype of query);
// staging_start_loc int32 [S+1]; staging_pos0 int32 [S]; k_levels/v_levels as write_cache.
// sliding_window W > 0: a query at position p sees keys (p - W, p] only (vLLM's convention).
// logits_soft_cap c > 0: each logit x (softmax_scale * q.k) becomes c * tanh(x / c) (Gemma 2).
// rotation (a rotated format, vllm_kvq.rotation), fused into the kernel: 0 none; 1 values
// stored rotated: each output row is rotated back before its rounding; 2 keys too: each
// query row is rotated as loaded. rotation_sc: signed_scale(D). Staging rows are read as
// given (the caller passes them rotated).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& staging_k,
                     const at::Tensor& staging_v, const at::Tensor& staging_start_loc,
                     const at::Tensor& staging_pos0, int64_t residual_chunk,
                     int64_t sliding_window, double softmax_scale, double logits_soft_cap,
                     const std::vector<int64_t>& k_codec, const std::vector<int64_t>& v_codec,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& k_levels, const at::Tensor& v_levels,
                     int64_t rotation, const std::optional<at::Tensor>& rotation_sc);

// One sequence's K and V, positions [0, num_tokens), from the pages of block_row (int32
// [>= ceil(num_tokens / block_size)]) into out_k / out_v [H, >= num_tokens, D] (float32,
// float16 or bfloat16, last dim contiguous): the attention kernel's fp32 values, rounded
// once to the output dtype. Scales and codebooks as paged_attention.
void dequantize_pages(const at::Tensor& cache, const at::Tensor& block_row, int64_t num_tokens,
                      const std::vector<int64_t>& k_codec, const std::vector<int64_t>& v_codec,
                      const at::Tensor& k_scale, const at::Tensor& v_scale,
                      const at::Tensor& k_levels, const at::Tensor& v_levels, at::Tensor& out_k,
                      at::Tensor& out_v);

// One layer's residual-window step (csrc/cpu/window_stage.cpp; reference:
// vllm_kvq/residual.py stage_and_write): staging [2, Ns, H, D] rows from the window pool
// [num_blocks, rows_per_block, 2, H, D] and from key/value, then the kept rows back.
void stage_window(at::Tensor& staging, const at::Tensor& key, const at::Tensor& value,
                  at::Tensor& pool, const at::Tensor& gather_rows, const at::Tensor& gather_blk,
                  const at::Tensor& gather_row, const at::Tensor& new_rows,
                  const at::Tensor& new_tok, const at::Tensor& keep_rows,
                  const at::Tensor& keep_blk, const at::Tensor& keep_row);

// The rotation of rotated formats (vllm_kvq/rotation.py), rows of x [N, D] or [N, M, D]
// (float32 / float16 / bfloat16, last dim contiguous) into out (same shape, any of those
// dtypes; may be x itself): forward fwht(x * sc), inverse fwht(x) * sc, sc fp32 [D] =
// signs / sqrt(D). Bit-identical to rotation.rotate / unrotate on every SIMD path.
void hadamard(const at::Tensor& x, at::Tensor& out, const at::Tensor& sc, bool inverse);

// Which SIMD path the kernels dispatch to on this CPU: "avx512", "avx2" or "scalar".
std::string simd_path();

}  // namespace kvq_cpu
