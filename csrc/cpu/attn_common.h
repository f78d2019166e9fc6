// Plain-C++ interface between the attention driver (attention.cpp) and the per-ISA kernel
// bodies (attn_avx512.cpp, attn_avx2.cpp, attn_scalar.cpp, all built from attn_body.h).
//
// No torch types here: the ISA translation units are compiled under `#pragma GCC target`
// and must not instantiate inline code (torch, std templates) that other translation units
// also instantiate, or the linker could keep an AVX-512 copy for everyone.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "kvq_layout.h"
#include "kvq_numeric.h"

namespace kvq_cpu {

enum DType : int32_t { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

// Key tokens per tile: K (then V) of one tile is dequantized into a TT x D fp32 scratch.
// 128 (one block of vLLM's CPU default) rather than 64: the per-tile work (scale rows,
// transposes, the folded value weights, loop setup) is spread over twice the tokens; on
// Zen 4, one thread, 4k-token decodes 9-18% faster (9/3/64) and 25% (32/8/128).
constexpr int kTileTokens = 128;
// Per-channel scale rows one tile can span: token groups are >= 16 and a tile may start
// anywhere in one (sliding windows, split contexts).
constexpr int kTileChanRows = kTileTokens / 16 + 1;

struct AttnParams {
  const void* q;            // [T, Hq, D]
  int64_t q_st, q_sh;       // element strides
  void* out;                // [T, Hq, D], dtype of q
  int64_t o_st, o_sh;
  int32_t dtype;            // DType of q / out
  const uint8_t* cache;     // [nb, H, B, C]
  int64_t c_sb, c_sh;       // byte strides of block and head
  const int32_t* bt;        // [S, max_blocks]
  int64_t bt_stride;
  const void* sk;           // staging K [Ns, H, D] (dtype s_dtype)
  const void* sv;
  int64_t sk_st, sk_sh, sv_st, sv_sh;  // element strides
  int32_t s_dtype;
  int32_t Hq, H, D, B, R, gq;
  int32_t window;           // sliding window W (0: none): a query at p reads keys > p - W
  float scale_log2;         // softmax_scale * log2(e): logits live in the log2 domain
  float softcap_log2;       // logits_soft_cap * log2(e) (0: none): logit x -> c tanh(x / c)
  kvq::Codec kc, vc;
  kvq::Layout lay;
  const float* k_scale;     // [H] static scales (1.0 when unused)
  const float* v_scale;
  const float* k_levels;    // [2^bits] nuq codebook of the K / V codec (nullptr if not nuq)
  const float* v_levels;
  float* partials;          // split tasks' partial results (AttnTask::part offsets)
  // A rotated format's rotation fused into the kernel (vllm_kvq.rotation, hadamard_body.h):
  // rot_q rotates each query row as it is loaded (keys stored rotated), rot_out rotates each
  // output row back before its one rounding (values stored rotated); rot_sc: the signed
  // scale [D] (signs / sqrt(D)). Staging rows are read as given (already rotated).
  const float* rot_sc;
  int32_t rot_q, rot_out;
  int32_t int_qk;           // 1: decode tasks may use the int8-query Q.K for int keys
                            // (attn_body.h "integer Q.K"); 0: exact fp32 Q.K everywhere
  int32_t qk3;              // 1: that Q.K reads 3-bit codes as stored (the path has
                            // KVQ_HAS_QK3 and the CPU its instructions); 0: repacked / fp32
  int32_t bf16dp;           // 1: a bf16 query's decode Q.K on bf16 keys uses vdpbf16ps (the
                            // path has KVQ_HAS_BF16DP and the CPU AVX512-BF16); 0: fp32 FMAs
  int32_t pv_bf16;          // 1: a bf16 query's decode P.V of 4/3/2-bit int / nuq and bf16
                            // values uses bf16 weights (attn_body.h pv_bf16: the path has
                            // KVQ_HAS_PV_BF16, the CPU AVX512-BF16 and VBMI); 0: fp32 weights
  int32_t pv_i16;           // 1: a bf16 query's decode P.V of 8-bit int values uses int16
                            // weights (attn_body.h pv_i16: where pv_bf16 runs and the CPU
                            // has AVX512-VNNI); 0: fp32 weights
  int32_t fast_pdep;        // 1: the CPU's BMI2 pdep is fast (not Zen 1/2's microcode): the
                            // AVX2 body repacks 3-bit keys with it (cvt3to4_row_pdep)
  int32_t pv_byte;          // 1: the decode P.V of nuq 4-bit values reads their levels as
                            // 7-bit bytes (attn_body.h K_B4: the path has KVQ_HAS_PV_BYTE);
                            // 0: the float levels
};

// One unit of work: a tile of consecutive query tokens of one sequence, one kv head (all
// gq query heads of its group), paged key positions [kbeg, kend), and optionally the
// staging positions its queries read.
struct AttnTask {
  int32_t s, h;
  int32_t tok0;       // first query row
  int32_t nq;         // query tokens
  int32_t pos0;       // absolute position of the first query token
  int32_t kbeg, kend; // paged key positions covered (kend <= F of the last query; with a
                      // sliding window kbeg is the first query's first key)
  int32_t staging;    // 1: also read staging positions [F(pos0+1), pos0+nq-1]
  int32_t decode;     // 1: the sequence's only query this step; only decodes may take the
                      // int8-query Q.K, so a prefill chunk computes what a whole prefill does
  int64_t stg_base;   // staging row of position p is stg_base + p
  int64_t part;       // partial result offset (floats) or -1: write `out` directly
};

// Partial results of a split task: m[M], l[M], acc[M*D] (log2-domain max and sum).
inline size_t partial_floats(int M, int D) { return (size_t)M * (2 + D); }

// Floats of one tile's scale and code buffers (attn_body.h TileBufs / carve_tile_bufs):
// scales and zeros, kTileChanRows per-channel scale rows each, unpacked codes (bytes), decoded values,
// 16-entry lookup tables per channel.
inline size_t tile_buf_floats(int D) {
  const size_t TT = kTileTokens;
  return 2 * TT * (D / 16) + 2 * (size_t)kTileChanRows * D + TT * D / 4 + TT * D +
         16 * (size_t)D;
}

// Scratch floats one thread needs for tasks of at most max_rows (= nq*gq) rows (see the
// carving at the top of run_task_impl in attn_body.h).
inline size_t scratch_floats(int max_rows, int D) {
  const size_t M = (size_t)(max_rows < 16 ? 16 : max_rows), TT = kTileTokens;
  return M * D * 3 + M * TT + TT * D + tile_buf_floats(D) + 6 * M + 256 +
         M * D / 4 + M * (D / 4 + 2) + 2 * TT * (D / 4) + 64 +  // integer Q.K: q8, qs/qsum, zt/skT
         M * (D / 16) * TT + 2 * (D / 16) * TT + M * (D / 16) + 64 +  // folded P.V: PS, s/z, zp
         kTileChanRows * M * (2 + D / 4) + 64 +  // per-channel keys: the tile's folds
         M * D + 16;  // per-channel keys on the fp32 Q.K: the folded query
}

using TaskFn = void (*)(const AttnParams&, const AttnTask&, float* scratch);
// The calling thread's scratch of n floats, on a cache-line boundary, kept across calls
// (attention.cpp): the decode tasks' and dequant.cpp's prefill pages'.
float* thread_scratch(size_t n);

// Rows [0, cnt) of one region of a (block, kv head) plane -> rows of `out` (DType, rows
// row_stride elements apart), as the kernel decodes them, rounded once to nearest even
// (attn_body.h decode_rows_impl; dequant.cpp's prefill pages).
using DecodeRowsFn = void (*)(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                              int cnt, int D, float static_scale, const float* levels,
                              float* scratch, void* out, int32_t dtype, int64_t row_stride);
inline size_t decode_scratch_floats(int D) {
  return tile_buf_floats(D) + (size_t)kTileTokens * D + 64;  // + one tile's fp32 rows
}
DecodeRowsFn current_decode_rows();  // attention.cpp: the SIMD path of this call

// The rotation of rotated formats (hadamard_body.h): rows (i, j) of in [N, rows_inner, D]
// -> out (element strides s0, s1; the last dim contiguous), forward or inverse.
constexpr int kMaxRotD = 256;
struct HadamardArgs {
  const void* in;
  void* out;
  int64_t in_s0, in_s1, out_s0, out_s1;
  int64_t rows_inner;
  int32_t in_dtype, out_dtype, D, inverse;
  const float* sc;  // [D] signs / sqrt(D)
};
using HadamardFn = void (*)(const HadamardArgs& a, int64_t row_begin, int64_t row_end);
HadamardFn current_hadamard_rows();  // attention.cpp: the SIMD path of this call

// Non-saturating IEEE fp16 from float (RNE; Inf stays Inf), for outputs.
inline uint16_t out_fp16(float x) {
  const uint32_t u = kvq::float_bits(x);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;
  if (a >= 0x477ff000u) return sign | 0x7c00;
  if (a < 0x38800000u) return sign | (uint16_t)rintf(kvq::bits_float(a) * 16777216.0f);
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return sign | (uint16_t)((r >> 13) - (112u << 10));
}

namespace kvq_avx512 {
extern const TaskFn run_task;
extern const DecodeRowsFn decode_rows;
extern const HadamardFn hadamard_rows;
}  // namespace kvq_avx512
namespace kvq_avx2 {
extern const TaskFn run_task;
extern const DecodeRowsFn decode_rows;
extern const HadamardFn hadamard_rows;
}  // namespace kvq_avx2
namespace kvq_scalar {
extern const TaskFn run_task;
extern const DecodeRowsFn decode_rows;
extern const HadamardFn hadamard_rows;
}  // namespace kvq_scalar

}  // namespace kvq_cpu
