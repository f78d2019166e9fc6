// kvq_cpu::dequantize_pages: one sequence's K and V, read from its pages into dense
// [H, L, D] tensors (float32 / float16 / bfloat16), for the prefill path (vllm_kvq/prefill.py)
// that hands them to torch's flash attention.
//
// Every value is what the attention kernel computes (it is the kernel's own tile decode,
// attn_body.h decode_rows_impl, on the current SIMD path) and the reference
// (reference.py::decode_plane_region), in fp32, rounded once to the output dtype:
//   fp16 / bf16       the stored value
//   fp8               fp8 * scale
//   int  asym         code * scale + zero      (code * fp16 scale is exact in fp32, so this
//   int  sym          (code - 2^(b-1)) * scale  equals the kernel's fma(code, scale, zero))
//   nuq               level[code] * scale + zero   (two roundings, as the kernel and the
//                                                   reference; the build has -ffp-contract=off)
// then every outlier slot whose channel is below D adds its correction to its channel; with
// an attention sink (_sink) position 0 is the first block's int8 sink row instead. Scales and zeros are
// fp16 (token, group, channel granularity) or the static per-head fp32 scale (tensor, head).
//
// OpenMP over (block, kv head, side); this file is compiled for the baseline target.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attn_common.h"
#include "cpu_ops.h"
#include "op_checks.h"
#include "kvq_layout.h"
#include "kvq_torch_codec.h"
#include "kvq_numeric.h"

namespace kvq_cpu {

namespace {

using kvq::Codec;
using kvq::Region;

// One side (K or V) of a layer.
struct Side {
  Codec c;
  Region r;
  const float* st;      // [H] static scales
  const float* levels;  // nuq codebook, or nullptr
};

namespace sink_row {
#include "window_rows_body.h"
}  // namespace sink_row

// Position 0 of a sequence from its first block's sink row (kvq_layout.h int8_row_bytes):
// codes * scale in fp32, rounded once to the output dtype, as the kernel reads it.
void store_sink_row(const uint8_t* row, int D, uint8_t* dst, int32_t dtype) {
  float f[512];  // D <= 512 (dequantize_pages checks it)
  sink_row::dequantize_row_i8_f32(row, D, f);
  for (int d = 0; d < D; ++d) {
    const float x = f[d];
    if (dtype == DT_F32) ((float*)dst)[d] = x;
    else if (dtype == DT_BF16) ((uint16_t*)dst)[d] = kvq::float_to_bf16(x);
    else ((uint16_t*)dst)[d] = out_fp16(x);
  }
}

// outs[side] + h * o_sh[side] + position * o_sl[side]: element (h, position) of K / V.
void run(DecodeRowsFn decode, const Side sides[2], const uint8_t* cache, int64_t c_sb,
         int64_t c_sh, const int32_t* blocks, int nblk, int L, int H, int B, int D,
         uint8_t* outs[2], int32_t dtype, int64_t elem_bytes, const int64_t o_sh[2],
         const int64_t o_sl[2]) {
  const int64_t ntask = (int64_t)nblk * H * 2;
#pragma omp parallel
  {
    float* scratch = thread_scratch(decode_scratch_floats(D));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int side = (int)(task % 2);
      const int h = (int)(task / 2 % H);
      const int j = (int)(task / 2 / H);
      const int cnt = std::min(B, L - j * B);
      const uint8_t* plane = cache + (int64_t)blocks[j] * c_sb + (int64_t)h * c_sh;
      const Side& sd = sides[side];
      uint8_t* dst = outs[side] + (h * o_sh[side] + (int64_t)j * B * o_sl[side]) * elem_bytes;
      decode(sd.c, sd.r, plane, cnt, D, sd.st[h], sd.levels, scratch, dst, dtype,
             o_sl[side]);
      if (j == 0 && sd.c.sink) store_sink_row(plane + sd.r.sink_off, D, dst, dtype);
    }
  }
}

using kvq::static_scales;
using kvq::to_codec;

}  // namespace

void dequantize_pages(const at::Tensor& cache, const at::Tensor& block_row, int64_t num_tokens,
                      const std::vector<int64_t>& k_codec, const std::vector<int64_t>& v_codec,
                      const at::Tensor& k_scale, const at::Tensor& v_scale,
                      const at::Tensor& k_levels, const at::Tensor& v_levels, at::Tensor& out_k,
                      at::Tensor& out_v) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.device().is_cpu(),
              "cache must be a uint8 CPU tensor [num_blocks, H, block_size, C]");
  const int nb = (int)cache.size(0), H = (int)cache.size(1), B = (int)cache.size(2);
  const int64_t C = cache.size(3);
  TORCH_CHECK(out_k.dim() == 3 && out_v.dim() == 3, "out_k/out_v must be [H, L, D]");
  const int D = (int)out_k.size(2);
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 512, "head_dim ", D,
              " must be a multiple of 16 in [16, 512]");
  TORCH_CHECK(B % 16 == 0 && B > 0, "block_size ", B, " must be a multiple of 16");
  const Codec kc = to_codec(k_codec, "k_codec"), vc = to_codec(v_codec, "v_codec");
  check_codecs(kc, vc, D, B);
  const kvq::Layout lay = kvq::make_layout(kc, vc, D, B);
  TORCH_CHECK(C == lay.token_bytes, "cache last dim is ", C, " bytes but this format needs ",
              lay.token_bytes);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == C && cache.stride(1) >= (int64_t)B * C,
              "each (block, kv_head) plane of the cache must be contiguous");
  const int L = (int)num_tokens;
  TORCH_CHECK(L >= 0, "num_tokens ", num_tokens, " must be >= 0");
  for (const at::Tensor* o : {&out_k, &out_v}) {
    TORCH_CHECK(o->size(0) == H && o->size(1) >= L && o->size(2) == D, "out_k/out_v must be [H=",
                H, ", >= num_tokens=", L, ", D=", D, "], got ", o->sizes());
    TORCH_CHECK(o->stride(2) == 1, "out_k/out_v last dim must be contiguous");
    TORCH_CHECK(o->scalar_type() == out_k.scalar_type(), "out_k and out_v must share a dtype");
    TORCH_CHECK(o->device().is_cpu(), "out_k/out_v must be CPU tensors");
  }
  const int nblk = (L + B - 1) / B;
  TORCH_CHECK(block_row.scalar_type() == at::kInt && block_row.dim() == 1 &&
                  block_row.stride(0) == 1 && block_row.size(0) >= nblk,
              "block_row must be a contiguous int32 [>= ", nblk, "] tensor, got ",
              block_row.scalar_type(), " ", block_row.sizes());
  const int32_t* blocks = block_row.data_ptr<int32_t>();
  for (int j = 0; j < nblk; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < nb, "block_row[", j, "] = ", blocks[j],
                " is outside the cache's ", nb, " blocks");
  if (L == 0) return;
  const std::vector<float> ks = static_scales(kc, k_scale, H, "k_scale");
  const std::vector<float> vs = static_scales(vc, v_scale, H, "v_scale");
  const std::vector<float> kl = codebook(kc, k_levels, "k_levels");
  const std::vector<float> vl = codebook(vc, v_levels, "v_levels");
  const Side sides[2] = {{kc, lay.k, ks.data(), kl.empty() ? nullptr : kl.data()},
                         {vc, lay.v, vs.data(), vl.empty() ? nullptr : vl.data()}};
  const DecodeRowsFn decode = current_decode_rows();
  const int64_t o_sh[2] = {out_k.stride(0), out_v.stride(0)};
  const int64_t o_sl[2] = {out_k.stride(1), out_v.stride(1)};
  const uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t c_sb = cache.stride(0), c_sh = cache.stride(1);
  const int32_t dtype = dtype_of(out_k, "out_k/out_v");
  uint8_t* outs[2] = {(uint8_t*)out_k.data_ptr(), (uint8_t*)out_v.data_ptr()};
  run(decode, sides, cp, c_sb, c_sh, blocks, nblk, L, H, B, D, outs, dtype,
      (int64_t)out_k.element_size(), o_sh, o_sl);
}

}  // namespace kvq_cpu
