// Every op of vllm_kvq, registered once (torch.ops.vllm_kvq.*). CPU and CUDA share names
// and schemas; the Python wrappers are in vllm_kvq/ops.py.
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/cpu_ops.h"
#include "kvq_layout.h"
#include "kvq_torch_codec.h"

#ifdef KVQ_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

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

// The layout of kvq_layout.h, for Python (page sizes, reports, the reference).
py::dict make_layout(const std::vector<int64_t>& k, const std::vector<int64_t>& v,
                     int64_t head_dim, int64_t block_size) {
  const kvq::Layout l = kvq::make_layout(kvq::to_codec(k, "k_codec"),
                                         kvq::to_codec(v, "v_codec"), (int32_t)head_dim,
                                         (int32_t)block_size);
  py::dict d;
  d["k"] = region_dict(l.k); d["v"] = region_dict(l.v);
  d["head_dim"] = l.head_dim; d["block_size"] = l.block_size;
  d["used_bytes"] = l.used_bytes; d["token_bytes"] = l.token_bytes;
  d["plane_bytes"] = l.plane_bytes; d["padding"] = l.padding;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_layout", &make_layout, "byte layout of one (block, kv_head) plane");
  m.def("window_value_row_bytes", &kvq::window_value_row_bytes);
  m.def("residual_bytes_per_seq_layer", &kvq::residual_bytes_per_seq_layer);
  m.def("window_rows_per_block", &kvq::window_rows_per_block);
  m.def("window_blocks_per_seq", &kvq::window_blocks_per_seq);
  m.def("simd_path", &kvq_cpu::simd_path);
#ifdef KVQ_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}

TORCH_LIBRARY(vllm_kvq, ops) {
  ops.def(
      "write_cache(Tensor key, Tensor value, Tensor(a!) cache, Tensor slot_mapping, "
      "int[] k_codec, int[] v_codec, Tensor k_scale, Tensor v_scale, Tensor k_levels, "
      "Tensor v_levels) -> ()");
  ops.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor staging_k, Tensor staging_v, "
      "Tensor staging_start_loc, Tensor staging_pos0, int residual_chunk, "
      "int sliding_window, float softmax_scale, float logits_soft_cap, int[] k_codec, "
      "int[] v_codec, Tensor k_scale, "
      "Tensor v_scale, Tensor k_levels, Tensor v_levels, int rotation=0, "
      "Tensor? rotation_sc=None) -> ()");
  ops.def(
      "dequantize_pages(Tensor cache, Tensor block_row, int num_tokens, int[] k_codec, "
      "int[] v_codec, Tensor k_scale, Tensor v_scale, Tensor k_levels, Tensor v_levels, "
      "Tensor(a!) out_k, Tensor(b!) out_v) -> ()");
  ops.def(
      "stage_window(Tensor(a!) staging, Tensor key, Tensor value, Tensor(b!) pool, "
      "Tensor gather_rows, Tensor gather_blk, Tensor gather_row, Tensor new_rows, "
      "Tensor new_tok, Tensor keep_rows, Tensor keep_blk, Tensor keep_row) -> ()");
  ops.def("hadamard(Tensor x, Tensor(a!) out, Tensor sc, bool inverse) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_kvq, CPU, ops) {
  ops.impl("write_cache", [](const at::Tensor& key, const at::Tensor& value, at::Tensor cache,
                             const at::Tensor& slots, c10::IntArrayRef kc, c10::IntArrayRef vc,
                             const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& kl,
                             const at::Tensor& vl) {
    kvq_cpu::write_cache(key, value, cache, slots, kc.vec(), vc.vec(), ks, vs, kl, vl);
  });
  ops.impl("paged_attention",
           [](at::Tensor out, const at::Tensor& q, const at::Tensor& cache,
              const at::Tensor& bt, const at::Tensor& sl, const at::Tensor& qsl,
              const at::Tensor& sk, const at::Tensor& sv, const at::Tensor& ssl,
              const at::Tensor& sp0, int64_t r, int64_t w, double scale, double cap,
              c10::IntArrayRef kc, c10::IntArrayRef vc, const at::Tensor& ks,
              const at::Tensor& vs, const at::Tensor& kl, const at::Tensor& vl, int64_t rot,
              const std::optional<at::Tensor>& rot_sc) {
             kvq_cpu::paged_attention(out, q, cache, bt, sl, qsl, sk, sv, ssl, sp0, r, w, scale,
                                      cap, kc.vec(), vc.vec(), ks, vs, kl, vl, rot, rot_sc);
           });
  ops.impl("dequantize_pages",
           [](const at::Tensor& cache, const at::Tensor& br, int64_t n, c10::IntArrayRef kc,
              c10::IntArrayRef vc, const at::Tensor& ks, const at::Tensor& vs,
              const at::Tensor& kl, const at::Tensor& vl, at::Tensor ok, at::Tensor ov) {
             kvq_cpu::dequantize_pages(cache, br, n, kc.vec(), vc.vec(), ks, vs, kl, vl, ok, ov);
           });
  ops.impl("stage_window",
           [](at::Tensor st, const at::Tensor& k, const at::Tensor& v, at::Tensor pool,
              const at::Tensor& gr, const at::Tensor& gb, const at::Tensor& gw,
              const at::Tensor& nr, const at::Tensor& nt, const at::Tensor& kr,
              const at::Tensor& kb, const at::Tensor& kw) {
             kvq_cpu::stage_window(st, k, v, pool, gr, gb, gw, nr, nt, kr, kb, kw);
           });
  ops.impl("hadamard", [](const at::Tensor& x, at::Tensor out, const at::Tensor& sc,
                          bool inverse) { kvq_cpu::hadamard(x, out, sc, inverse); });
}

#ifdef KVQ_WITH_CUDA
TORCH_LIBRARY_IMPL(vllm_kvq, CUDA, ops) {
  ops.impl("write_cache", &kvq_cuda::write_cache);
  ops.impl("paged_attention", &kvq_cuda::paged_attention);
}
#endif
