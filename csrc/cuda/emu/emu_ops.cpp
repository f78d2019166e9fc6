// The CUDA kernels compiled for the CPU through the emulator (kvq_cuda_emu.h), for tests
// on machines without a GPU: same kernels, same dispatch and argument checks as
// cuda_ops.cu, run fiber by fiber on CPU tensors. Built on demand by
// tests/test_cuda_emulated.py (torch.utils.cpp_extension.load, as torch.ops.kvq_cuda_emu.*);
// not part of the package. Registered through TORCH_LIBRARY with the light ATen headers:
// <torch/extension.h> alone took 27 of the build's 39 s (2-core AVX2 Zen 3).
#include <ATen/core/Tensor.h>
#include <optional>
#include <torch/library.h>

#define KVQ_CUDA_EMULATE 1
#include "../kvq_torch_glue.h"

namespace {

int64_t write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor cache,
                    const at::Tensor& slots, std::vector<int64_t> kc, std::vector<int64_t> vc,
                    const at::Tensor& ks, const at::Tensor& vs,
                    const std::optional<at::Tensor>& kl, const std::optional<at::Tensor>& vl) {
  kvq_cuda::WriteParams p = kvq_cuda::make_write_params(key, value, cache, slots, kc, vc, ks, vs,
                                                        kl.value_or(at::Tensor()),
                                                        vl.value_or(at::Tensor()));
  int32_t flag = 0;
  p.error_flag = &flag;
  kvq_cuda::launch_write_cache(p, nullptr);
  return flag;
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& bt,
                     const at::Tensor& sl, const at::Tensor& qsl, const at::Tensor& sk,
                     const at::Tensor& sv, const at::Tensor& ssl, const at::Tensor& sp0, int64_t R,
                     int64_t window, double scale, double soft_cap, std::vector<int64_t> kc,
                     std::vector<int64_t> vc,
                     const at::Tensor& ks, const at::Tensor& vs, bool force_generic,
                     int64_t part_tokens, int64_t num_sms, const std::optional<at::Tensor>& kl,
                     const std::optional<at::Tensor>& vl) {
  kvq_cuda::AttnPlan plan;
  kvq_cuda::AttnParams p = kvq_cuda::make_attn_params(out, q, cache, bt, sl, qsl, sk, sv, ssl, sp0, R,
                                                      window, scale, soft_cap, kc, vc, ks, vs,
                                                      kl.value_or(at::Tensor()),
                                                      vl.value_or(at::Tensor()), (int)num_sms,
                                                      force_generic, (int)part_tokens, &plan);
  std::vector<uint8_t> ws(plan.workspace_bytes());
  kvq_cuda::set_workspace(p, plan, ws.data());
  kvq_cuda::launch_attention(p, plan, nullptr);
}

bool decode_supported(int64_t D, std::vector<int64_t> kc, std::vector<int64_t> vc) {
  return kvq_cuda::decode_fn((int)D, kvq_cuda::kind_of(kvq_cuda::codec_from(kc)),
                             kvq_cuda::kind_of(kvq_cuda::codec_from(vc))) != nullptr;
}

}  // namespace

// write_cache returns the slot error flag; decode_supported: whether the tensor-core decode
// kernel covers a format.
TORCH_LIBRARY(kvq_cuda_emu, m) {
  // the nuq codebooks last and optional: (k_levels, v_levels)
  m.def("write_cache(Tensor key, Tensor value, Tensor(a!) cache, Tensor slots, int[] kc, int[] vc, "
        "Tensor ks, Tensor vs, Tensor? kl=None, Tensor? vl=None) -> int", &write_cache);
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor cache, Tensor bt, Tensor sl, Tensor qsl, "
        "Tensor sk, Tensor sv, Tensor ssl, Tensor sp0, int R, int window, float scale, "
        "float soft_cap, int[] kc, int[] vc, Tensor ks, Tensor vs, bool force_generic, "
        "int part_tokens, int num_sms, Tensor? kl=None, Tensor? vl=None) -> ()", &paged_attention);
  m.def("decode_supported", &decode_supported);
}
