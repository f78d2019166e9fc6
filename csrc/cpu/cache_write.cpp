// kvq_cpu::write_cache: quantize K/V rows [N, H, D] into their (block, kv_head) planes.
// This file checks the arguments (once, here: the ISA paths trust them), splits the work
// and dispatches each row to write_avx2.cpp or write_scalar.cpp (write_common.h), whose
// bytes are identical to the PyTorch reference (vllm_kvq/reference.py::write_cache).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include <string>
#include <vector>

#include "cpu_ops.h"
#include "kvq_layout.h"
#include "kvq_torch_codec.h"
#include "kvq_numeric.h"
#include "attn_common.h"
#include "op_checks.h"
#include "write_common.h"

namespace kvq_cpu {
namespace {

using kvq::Codec;
using kvq::Region;
using kvq::to_codec;

static_assert((int)IN_F32 == DT_F32 && (int)IN_F16 == DT_F16 && (int)IN_BF16 == DT_BF16,
              "the write kernels number dtypes as the attention kernels (op_checks dtype_of)");
InDType in_dtype(const at::Tensor& t, const char* what) { return (InDType)dtype_of(t, what); }

// The attention sink's rows: the 8-bit window's row codec (one row per block and side, so
// the scalar build; every path's bytes are the same).
namespace sink_rows {
#include "window_rows_body.h"
}  // namespace sink_rows

}  // namespace

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                 const at::Tensor& slot_mapping, const std::vector<int64_t>& k_codec,
                 const std::vector<int64_t>& v_codec, const at::Tensor& k_scale,
                 const at::Tensor& v_scale, const at::Tensor& k_levels,
                 const at::Tensor& v_levels) {
  const Codec kc = to_codec(k_codec, "k_codec"), vc = to_codec(v_codec, "v_codec");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [N, H, D]");
  TORCH_CHECK(key.sizes() == value.sizes(), "key ", key.sizes(), " and value ",
              value.sizes(), " must have the same shape");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && cache.device().is_cpu(),
              "write_cache (CPU) needs CPU tensors");
  const int64_t N = key.size(0);
  const int H = (int)key.size(1), D = (int)key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4,
              "cache must be uint8 [num_blocks, H, block_size, C]");
  TORCH_CHECK(cache.size(1) == H, "cache has ", cache.size(1), " kv heads, key has ", H);
  const int B = (int)cache.size(2);
  const int64_t C = cache.size(3);
  check_codecs(kc, vc, D, B);
  SideQ kq{kc, {}}, vq{vc, {}};
  {
    const std::vector<float> kl = codebook(kc, k_levels, "k_levels");
    const std::vector<float> vl = codebook(vc, v_levels, "v_levels");
    for (auto [l, q] : {std::pair{&kl, &kq}, std::pair{&vl, &vq}}) {
      if (l->empty()) continue;
      kvq::nuq_midpoints(l->data(), (int)l->size(), q->mids);
      std::copy(l->begin(), l->end(), q->levels);
    }
  }
  const kvq::Layout lay = kvq::make_layout(kc, vc, D, B);
  TORCH_CHECK(C == lay.token_bytes, "cache last dim is ", C, " bytes but this format needs ",
              lay.token_bytes, " bytes per token (head_dim ", D, ", block_size ", B, ")");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == C && cache.stride(1) >= (int64_t)B * C,
              "each (block, kv_head) plane of the cache must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) >= N,
              "slot_mapping must be 1-D with at least N=", N, " entries");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 or int32");
  const int64_t num_slots = cache.size(0) * B;

  std::vector<int64_t> slots(N);
  {
    at::Tensor sm = slot_mapping.to(at::kLong).contiguous();
    const int64_t* p = sm.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      slots[i] = p[i];
      TORCH_CHECK(p[i] < num_slots, "slot_mapping entry ", i, " = ", p[i],
                  " is past the cache's ", num_slots, " slots");
    }
  }
  const std::vector<float> ks = kvq::static_scales(kc, k_scale, H, "k_scale");
  const std::vector<float> vs = kvq::static_scales(vc, v_scale, H, "v_scale");

  const RowSrc ksrc{(const uint8_t*)key.data_ptr(), key.stride(0) * key.element_size(),
                    key.stride(1) * key.element_size(), in_dtype(key, "key"),
                    (int)key.element_size()};
  const RowSrc vsrc{(const uint8_t*)value.data_ptr(), value.stride(0) * value.element_size(),
                    value.stride(1) * value.element_size(), in_dtype(value, "value"),
                    (int)value.element_size()};
  uint8_t* cbase = cache.data_ptr<uint8_t>();
  const int64_t sb = cache.stride(0), sh = cache.stride(1);

  constexpr int64_t kParallelWriteValues = 16384;  // below this, one thread writes
  // Work items per side: entry index (token codecs) or first entry of a group (channel).
  auto items_for = [&](const Codec& c, const char* side) {
    std::vector<int64_t> items;
    if (c.granularity != kvq::GRAN_CHANNEL) {
      for (int64_t i = 0; i < N; ++i)
        if (slots[i] >= 0) items.push_back(i);
      return items;
    }
    const int G = c.group;
    int64_t i = 0;
    while (i < N) {
      const int64_t s = slots[i];
      if (s < 0) { ++i; continue; }
      bool ok = s % G == 0 && i + G <= N;
      for (int j = 1; ok && j < G; ++j) ok = slots[i + j] == s + j;
      TORCH_CHECK(ok, "per-channel ", side, " codec needs whole aligned groups of ", G,
                  " slots; entry ", i, " (slot ", s, ") starts none");
      items.push_back(i);
      i += G;
    }
    return items;
  };
  const std::vector<int64_t> kitems = items_for(kc, "key"), vitems = items_for(vc, "value");

  auto run_side = [&](const SideQ& q, const Region& r, const RowSrc& src,
                      const std::vector<int64_t>& items, const std::vector<float>& st) {
    const Codec& c = q.c;
    const int64_t n = (int64_t)items.size() * H;
    if (n == 0) return;
    const int rows = c.granularity == kvq::GRAN_CHANNEL ? c.group : 1;
    const bool vec = simd_level() >= 1 && D % 8 == 0;
    // A decode step writes a few rows per layer: microseconds of work, less than waking the
    // thread team (and far less than waiting for a descheduled thread on a busy machine).
    const bool parallel = n * rows * D >= kParallelWriteValues;
#pragma omp parallel if (parallel)
    {
      std::vector<float> buf((size_t)rows * D), sbuf((size_t)rows * D);
      std::vector<uint8_t> codes((size_t)rows * D);
#pragma omp for schedule(static)
      for (int64_t w = 0; w < n; ++w) {
        const int64_t i = items[w / H];
        const int h = (int)(w % H);
        const int64_t s = slots[i];
        uint8_t* plane = cbase + (s / B) * sb + h * sh;
        const int t = (int)(s % B);
        // the block's first tokens also go to its sink rows (read for a sequence's
        // position 0: the kernels take them from its first block only)
        auto sink = [&] {
          for (int j = 0; t + j < c.sink && j < rows; ++j)
            sink_rows::quantize_f32_row_i8(
                buf.data() + (size_t)j * D, D,
                plane + r.sink_off + (int64_t)(t + j) * kvq::int8_row_bytes(D));
        };
        if (vec) {
          for (int j = 0; j < rows; ++j)
            write_avx2::load_row(src, i + j, h, D, buf.data() + (size_t)j * D);
          if (t < c.sink) sink();
          if (rows == 1)
            write_avx2::encode_token_row(q, r, plane, t, buf.data(), D, st[h], codes.data(),
                                         sbuf.data());
          else
            write_avx2::encode_channel_group(q, r, plane, t, buf.data(), D, codes.data(),
                                             sbuf.data());
          continue;
        }
        for (int j = 0; j < rows; ++j)
          write_scalar::load_row(src, i + j, h, D, buf.data() + (size_t)j * D);
        if (t < c.sink) sink();
        if (rows == 1)
          write_scalar::encode_token_row(q, r, plane, t, buf.data(), D, st[h], sbuf.data());
        else
          write_scalar::encode_channel_group(q, r, plane, t, buf.data(), D, sbuf.data());
      }
    }
  };
  run_side(kq, lay.k, ksrc, kitems, ks);
  run_side(vq, lay.v, vsrc, vitems, vs);
}

}  // namespace kvq_cpu
