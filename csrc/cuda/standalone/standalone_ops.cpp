// Fallback module for scripts/gpu_check.py: the CUDA ops without the rest of the package
// (built with torch.utils.cpp_extension.load from this file and ../cuda_ops.cu when the
// full `setup.py build_ext` fails on a GPU host). Exposes make_layout and
// residual_bytes_per_seq_layer like vllm_kvq._C, so vllm_kvq.formats works with it.
#include <torch/extension.h>

#include "../../kvq_layout.h"
#include "../../kvq_torch_codec.h"
#include "../cuda_ops.h"

namespace {


py::dict region_dict(const kvq::Region& r) {
  py::dict d;
  d["data_off"] = r.data_off; d["data_bytes"] = r.data_bytes; d["row_bytes"] = r.row_bytes;
  d["scale_off"] = r.scale_off; d["scale_bytes"] = r.scale_bytes;
  d["zero_off"] = r.zero_off; d["zero_bytes"] = r.zero_bytes;
  d["scale_rows"] = r.scale_rows; d["scale_cols"] = r.scale_cols;
  d["outlier_off"] = r.outlier_off; d["outlier_bytes"] = r.outlier_bytes;
  d["sink_off"] = r.sink_off; d["sink_bytes"] = r.sink_bytes; d["end"] = r.end;
  return d;
}

py::dict make_layout(const std::vector<int64_t>& k, const std::vector<int64_t>& v, int64_t D, int64_t B) {
  const kvq::Layout l = kvq::make_layout(kvq::to_codec(k, "k_codec"), kvq::to_codec(v, "v_codec"),
                                         (int32_t)D, (int32_t)B);
  py::dict d;
  d["k"] = region_dict(l.k); d["v"] = region_dict(l.v);
  d["head_dim"] = l.head_dim; d["block_size"] = l.block_size;
  d["used_bytes"] = l.used_bytes; d["token_bytes"] = l.token_bytes;
  d["plane_bytes"] = l.plane_bytes; d["padding"] = l.padding;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_layout", &make_layout);
  m.def("window_value_row_bytes", &kvq::window_value_row_bytes);
  m.def("residual_bytes_per_seq_layer", &kvq::residual_bytes_per_seq_layer);
  m.def("window_rows_per_block", &kvq::window_rows_per_block);
  m.def("window_blocks_per_seq", &kvq::window_blocks_per_seq);
  m.attr("with_cuda") = true;
  m.def("write_cache", [](const at::Tensor& k, const at::Tensor& v, at::Tensor cache, const at::Tensor& slots,
                          std::vector<int64_t> kc, std::vector<int64_t> vc, const at::Tensor& ks,
                          const at::Tensor& vs, const at::Tensor& kl, const at::Tensor& vl) {
    kvq_cuda::write_cache(k, v, cache, slots, kc, vc, ks, vs, kl, vl);
  });
  m.def("paged_attention",
        [](at::Tensor out, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& bt,
           const at::Tensor& sl, const at::Tensor& qsl, const at::Tensor& sk, const at::Tensor& sv,
           const at::Tensor& ssl, const at::Tensor& sp0, int64_t r, int64_t w, double scale, double cap,
           std::vector<int64_t> kc,
           std::vector<int64_t> vc, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& kl,
           const at::Tensor& vl) {
          kvq_cuda::paged_attention(out, q, cache, bt, sl, qsl, sk, sv, ssl, sp0, r, w, scale, cap, kc, vc, ks, vs,
                                    kl, vl, 0, std::nullopt);
        });
}
