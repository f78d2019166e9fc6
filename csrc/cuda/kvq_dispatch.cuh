// Host-side dispatch of the vllm-kvq CUDA kernels, free of torch types: argument rules,
// kernel choice, launch shapes and workspace layout. Used by the torch bindings
// (cuda_ops.cu), the emulated CPU build (emu/emu_ops.cpp) and the compile check.
#pragma once
#include <string>

#include "kvq_attention.cuh"
#include "kvq_decode.cuh"
#include "kvq_write_cache.cuh"

namespace kvq_cuda {

constexpr int kWarpRowsPerCta = 4;  // write_rows_kernel: one warp per (token, head)

inline int ilog2(int x) {
  int r = 0;
  while ((1 << (r + 1)) <= x) ++r;
  return r;
}

// Resolve one side of a format. Returns "" or what is wrong.
// levels / levels_n: the side's nuq codebook (float32 on the cache's device), else unused.
inline std::string make_side(const kvq::Codec& c, const kvq::Region& r, int head_dim,
                             int block_size, const float* sscale, int sscale_n, int H,
                             const float* levels, int levels_n, Side* out) {
  const char* what = "";
  const int kind = kind_of(c);
  if (c.encoding == kvq::ENC_NUQ && (levels == nullptr || levels_n != 1 << c.bits))
    return "a nuq codec needs its codebook of 2^bits = " + std::to_string(1 << c.bits) +
           " float32 levels on the cache's device, got " + std::to_string(levels_n);
  if (kind < 0) return "unsupported encoding/bits " + std::to_string(c.encoding) + "/" + std::to_string(c.bits);
  if (c.outliers > kMaxOutliers)
    return "at most " + std::to_string(kMaxOutliers) + " outlier slots per token, got " +
           std::to_string(c.outliers);
  if (c.sink && (r.sink_bytes != c.sink * kvq::int8_row_bytes(head_dim) || r.sink_off % 4))
    return "sink rows must be sink x (head_dim + 4) bytes at a 4-byte aligned offset";
  const bool flt = kind == KIND_F16 || kind == KIND_BF16;
  if (flt && c.granularity != kvq::GRAN_NONE) what = "float formats take no scale";
  if (!flt && c.granularity == kvq::GRAN_NONE) what = "quantized formats need a granularity";
  if ((kind == KIND_E4M3 || kind == KIND_E5M2) && c.granularity > kvq::GRAN_TOKEN)
    what = "fp8 takes tensor, head or token scales";
  if (*what) return what;
  if (head_dim % 16 || head_dim > kMaxHeadDim) return "head_dim must be a multiple of 16 up to 256";
  if (c.granularity == kvq::GRAN_GROUP || c.granularity == kvq::GRAN_CHANNEL) {
    if (c.group < 16 || (c.group & (c.group - 1)) || c.group > kMaxChannelGroup)
      return "group must be a power of two in 16..128, got " + std::to_string(c.group);
    if (c.granularity == kvq::GRAN_GROUP && head_dim % c.group) return "group must divide head_dim";
    if (c.granularity == kvq::GRAN_CHANNEL && block_size % c.group)
      return "channel token group must divide block_size";
  }
  const bool stat = c.granularity == kvq::GRAN_TENSOR || c.granularity == kvq::GRAN_HEAD;
  if (stat && c.encoding == kvq::ENC_INT && !c.symmetric) return "static integer scales are symmetric";
  if (stat && (sscale == nullptr || !(sscale_n == 1 || sscale_n == H)))
    return "static scale needs 1 or num_kv_heads float32 values";
  Side s{};
  s.encoding = c.encoding;
  s.bits = c.bits;
  s.gran = c.granularity;
  s.group = c.group;
  s.symmetric = c.symmetric;
  s.data_off = r.data_off;
  s.row_bytes = r.row_bytes;
  s.scale_off = r.scale_off;
  s.zero_off = r.zero_off;
  s.scale_cols = r.scale_cols;
  s.has_zero = r.zero_bytes > 0;
  s.gshift = c.granularity == kvq::GRAN_GROUP ? ilog2(c.group) : 31;
  s.sink = c.sink;
  s.sink_off = r.sink_off;
  s.levels = c.encoding == kvq::ENC_NUQ ? levels : nullptr;
  s.outliers = c.outliers;
  s.outlier_off = r.outlier_off;
  s.static_scale = stat;
  s.sscale = stat ? sscale : nullptr;
  s.sscale_n = stat ? sscale_n : 0;
  *out = s;
  return "";
}

inline void launch_write_cache(const WriteParams& p, cudaStream_t stream) {
  (void)stream;  // unused by the emulation
  if (p.N == 0) return;
  // write_rows_kernel also writes the sink rows of per-channel sides
  const bool rows = p.side[0].gran != kvq::GRAN_CHANNEL || p.side[1].gran != kvq::GRAN_CHANNEL ||
                    p.side[0].sink || p.side[1].sink;
  const bool chan = p.side[0].gran == kvq::GRAN_CHANNEL || p.side[1].gran == kvq::GRAN_CHANNEL;
  if (rows) {
    const int64_t items = (int64_t)p.N * p.H;
    const dim3 grid((unsigned)((items + kWarpRowsPerCta - 1) / kWarpRowsPerCta));
    KVQ_LAUNCH(&write_rows_kernel, grid, dim3(32 * kWarpRowsPerCta), stream)(p);
  }
  if (chan) KVQ_LAUNCH(&write_channel_kernel, dim3(p.N, p.H, 2), dim3(128), stream)(p);
}

// ---- attention -------------------------------------------------------------------------
using AttnKernel = void (*)(AttnParams);

template <int D>
inline AttnKernel decode_fn_d(int kind) {
  switch (kind) {
    case KIND_F16: return &decode_kernel<D, KIND_F16, KIND_F16>;
    case KIND_BF16: return &decode_kernel<D, KIND_BF16, KIND_BF16>;
    case KIND_E4M3: return &decode_kernel<D, KIND_E4M3, KIND_E4M3>;
    case KIND_E5M2: return &decode_kernel<D, KIND_E5M2, KIND_E5M2>;
    case KIND_I2: return &decode_kernel<D, KIND_I2, KIND_I2>;
    case KIND_I3: return &decode_kernel<D, KIND_I3, KIND_I3>;
    case KIND_I4: return &decode_kernel<D, KIND_I4, KIND_I4>;
    case KIND_I8: return &decode_kernel<D, KIND_I8, KIND_I8>;
    case KIND_N2: return &decode_kernel<D, KIND_N2, KIND_N2>;
    case KIND_N3: return &decode_kernel<D, KIND_N3, KIND_N3>;
    case KIND_N4: return &decode_kernel<D, KIND_N4, KIND_N4>;
    default: return nullptr;
  }
}
// The tensor-core decode kernel for (head size, K kind, V kind), or null (generic path).
inline AttnKernel decode_fn(int D, int kk, int vk) {
  if (kk != vk) return nullptr;
  switch (D) {
    case 64: return decode_fn_d<64>(kk);
    case 128: return decode_fn_d<128>(kk);
    case 256: return decode_fn_d<256>(kk);
    default: return nullptr;
  }
}
inline AttnKernel generic_fn(int D) {
  switch (D) {
    case 64: return &generic_attn_kernel<64>;
    case 80: return &generic_attn_kernel<80>;
    case 96: return &generic_attn_kernel<96>;
    case 112: return &generic_attn_kernel<112>;
    case 128: return &generic_attn_kernel<128>;
    case 192: return &generic_attn_kernel<192>;
    case 256: return &generic_attn_kernel<256>;
    default: return nullptr;
  }
}

struct AttnPlan {
  AttnKernel decode = nullptr;  // null: every sequence goes through the generic kernel
  AttnKernel generic = nullptr;
  size_t part_o_floats = 0, part_ml_floats = 0, tile_ints = 0;
  size_t workspace_bytes() const {
    return (part_o_floats + part_ml_floats) * sizeof(float) + tile_ints * sizeof(int32_t) + 256;
  }
};

// Choose kernels and launch shapes; fills the planning fields of p. `num_sms` sizes the
// split-KV partitions. force_generic: tests / fallback.
inline std::string plan_attention(AttnParams& p, int kind_k, int kind_v, int num_sms,
                                  bool force_generic, AttnPlan* plan) {
  if (p.side[0].sink != p.side[1].sink) return "K and V must keep the same attention sink";
  p.sink = p.side[0].sink;
  if (p.sink > p.B) return "the attention sink must fit in the first block";
  plan->generic = generic_fn(p.D);
  if (!plan->generic) return "head_dim " + std::to_string(p.D) + " is not supported";
  // sliding-window layers take the generic kernel (it masks per row), and so do formats
  // with outlier slots (their corrections are added where the generic kernel dequantizes)
  const bool outliers = p.side[0].outliers || p.side[1].outliers;
  plan->decode = force_generic || p.window || outliers ? nullptr : decode_fn(p.D, kind_k, kind_v);
  p.decode_fast = plan->decode != nullptr;
  // generic tiles: up to 16 rows of (query, head)
  p.gen_heads = p.G < 16 ? p.G : 16;
  p.gen_queries = 16 / p.gen_heads;
  p.gen_head_tiles = (p.G + p.gen_heads - 1) / p.gen_heads;
  p.max_tiles = (p.T + p.gen_queries - 1) / p.gen_queries + p.S;
  plan->tile_ints = 1 + 2 * (size_t)p.max_tiles;
  // split-KV decode
  p.dec_head_tiles = (p.G + kDecodeHeads - 1) / kDecodeHeads;
  if (p.decode_fast) {
    // Enough CTAs to fill the GPU (4 per SM) without a needlessly long reduction; each
    // sequence splits its own keys over at most max_parts partitions (seq_split), so the
    // width of block_table only bounds max_parts.
    const int64_t max_ctx = (int64_t)p.max_blocks * p.B;
    const int64_t ctas = (int64_t)p.S * p.H * p.dec_head_tiles;
    int64_t want = ctas >= 4 * num_sms ? 1 : (4 * num_sms + ctas - 1) / ctas;
    p.min_part_tokens = 256;
    const int64_t cap = (max_ctx + p.min_part_tokens - 1) / p.min_part_tokens;
    if (want > cap) want = cap;
    if (want > kMaxParts) want = kMaxParts;
    p.max_parts = (int32_t)(want < 1 ? 1 : want);
    const size_t slots = (size_t)p.S * p.Hq * (p.max_parts + 1);
    plan->part_o_floats = slots * p.D;
    plan->part_ml_floats = slots * 2;
  } else {
    p.min_part_tokens = 256;
    p.max_parts = 0;
  }
  return "";
}

inline void set_workspace(AttnParams& p, const AttnPlan& plan, void* ws) {
  uintptr_t a = ((uintptr_t)ws + 255) / 256 * 256;
  p.part_o = plan.part_o_floats ? reinterpret_cast<float*>(a) : nullptr;
  a += plan.part_o_floats * sizeof(float);
  p.part_ml = plan.part_ml_floats ? reinterpret_cast<float*>(a) : nullptr;
  a += plan.part_ml_floats * sizeof(float);
  p.tiles = reinterpret_cast<int32_t*>(a);
}

inline void launch_attention(const AttnParams& p, const AttnPlan& plan, cudaStream_t stream) {
  (void)stream;  // unused by the emulation
  if (p.S == 0 || p.T == 0) return;
  if (plan.decode) {
    const dim3 grid(p.max_parts + 1, p.H * p.dec_head_tiles, p.S);
    KVQ_LAUNCH(plan.decode, grid, dim3(32 * kDecodeWarps), stream)(p);
    KVQ_LAUNCH(&reduce_kernel, dim3(p.S, p.Hq), dim3(128), stream)(p);
  }
  KVQ_LAUNCH(&plan_kernel, dim3(1), dim3(256), stream)(p);
  KVQ_LAUNCH(plan.generic, dim3(p.max_tiles, p.H * p.gen_head_tiles), dim3(128), stream)(p);
}

}  // namespace kvq_cuda
