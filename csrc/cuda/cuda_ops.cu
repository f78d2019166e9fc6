// Torch binding of the CUDA kernels: argument checks (kvq_torch_glue.h), device guard,
// current stream, workspace from the caching allocator, launch (kvq_dispatch.cuh).
#include <torch/all.h>

// The CPU wheel of torch ships c10/cuda headers without their generated config header;
// the compile check (scripts/check_cuda_compile.sh) supplies a stand-in for it.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>

#include "cuda_ops.h"
#include "kvq_torch_glue.h"

namespace kvq_cuda {

namespace {

int num_sms(int device) {
  static int cache[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (!cache[device]) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = n > 0 ? n : 132;
  }
  return cache[device];
}

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

}  // namespace

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor cache,
                 const at::Tensor& slot_mapping, c10::IntArrayRef k_codec,
                 c10::IntArrayRef v_codec, const at::Tensor& k_scale, const at::Tensor& v_scale,
                 const at::Tensor& k_levels, const at::Tensor& v_levels) {
  TORCH_CHECK(cache.is_cuda(), "vllm_kvq.write_cache (CUDA): cache must be a CUDA tensor");
  const c10::cuda::OptionalCUDAGuard guard(cache.device());
  WriteParams p = make_write_params(key, value, cache, slot_mapping, k_codec, v_codec, k_scale, v_scale,
                                    k_levels, v_levels);
  at::Tensor flag;
  const bool check = env_on("KVQ_CUDA_CHECK_SLOTS");
  if (check) {
    flag = at::zeros({1}, cache.options().dtype(at::kInt));
    p.error_flag = flag.data_ptr<int32_t>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(cache.device().index()).stream();
  launch_write_cache(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (check)
    TORCH_CHECK(flag.item<int32_t>() == 0, "vllm_kvq.write_cache (CUDA): slot_mapping has slots out of "
                "range, or per-channel groups that are not whole aligned runs of G slots");
}

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
                     int64_t rotation, const std::optional<at::Tensor>& rotation_sc) {
  TORCH_CHECK(cache.is_cuda(), "vllm_kvq.paged_attention (CUDA): cache must be a CUDA tensor");
  // vllm_kvq.ops rotates around the CUDA kernel (one fp32 product each way)
  TORCH_CHECK(rotation == 0, "vllm_kvq.paged_attention (CUDA): rotation ", rotation,
              " is not fused on CUDA; allowed: 0 (vllm_kvq.ops rotates around the kernel)");
  const c10::cuda::OptionalCUDAGuard guard(cache.device());
  AttnPlan plan;
  AttnParams p = make_attn_params(out, query, cache, block_table, seq_lens, query_start_loc,
                                  staging_k, staging_v, staging_start_loc, staging_pos0,
                                  residual_chunk, sliding_window, softmax_scale, logits_soft_cap, k_codec,
                                  v_codec, k_scale,
                                  v_scale, k_levels, v_levels, num_sms(cache.device().index()), false, 0,
                                  &plan);
  at::Tensor ws = at::empty({(int64_t)plan.workspace_bytes()}, cache.options().dtype(at::kByte));
  set_workspace(p, plan, ws.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(cache.device().index()).stream();
  launch_attention(p, plan, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kvq_cuda
