// CUDA implementations of the ops declared in csrc/torch_bindings.cpp (registered there
// under KVQ_WITH_CUDA). Same arguments and semantics as the CPU ops (csrc/cpu/cpu_ops.h).
#pragma once
#include <torch/all.h>

namespace kvq_cuda {

// key/value: [N, H, D] fp32/fp16/bf16 (last dim contiguous); cache: uint8
// [num_blocks, H, block_size, C] contiguous; slot_mapping: int64 [N] (-1 = padding);
// k_scale/v_scale: fp32 [1] or [H] static scales (read for tensor/head codecs only);
// k_levels/v_levels: nuq codebooks, float32 [2^bits] on the cache's device (required for a
// nuq side, ignored otherwise).
// With KVQ_CUDA_CHECK_SLOTS=1 the op synchronises and raises on slots that are out of
// range or break the whole-aligned-group rule of per-channel codecs; otherwise such
// entries are skipped (never partially written).
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor cache,
                 const at::Tensor& slot_mapping, c10::IntArrayRef k_codec,
                 c10::IntArrayRef v_codec, const at::Tensor& k_scale, const at::Tensor& v_scale,
                 const at::Tensor& k_levels, const at::Tensor& v_levels);

// out/query: [T, Hq, D] fp16/bf16/fp32; block_table int32 [S, max_blocks]; seq_lens int32 [S];
// query_start_loc int32 [S+1]; staging_k/v [Ns, H, D] (dtype of query, read when
// residual_chunk > 1); staging_start_loc int32 [S+1]; staging_pos0 int32 [S].
// KVQ_CUDA_ATTN=generic forces the CUDA-core kernel for every sequence.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& staging_k,
                     const at::Tensor& staging_v, const at::Tensor& staging_start_loc,
                     const at::Tensor& staging_pos0, int64_t residual_chunk,
                     int64_t sliding_window, double softmax_scale, double logits_soft_cap,
                     c10::IntArrayRef k_codec,
                     c10::IntArrayRef v_codec,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& k_levels, const at::Tensor& v_levels,
                     int64_t rotation, const std::optional<at::Tensor>& rotation_sc);

}  // namespace kvq_cuda
