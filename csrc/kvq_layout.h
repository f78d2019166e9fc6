// The one definition of every vllm-kvq cache format's byte layout.
//
// vLLM hands each attention layer a byte tensor [num_blocks, num_kv_heads, block_size, C]
// (layout LBHNC). For one (block, kv_head) the B*C bytes form a "plane" that we lay out
// freely: the K region, then the V region, each made of fields. A format is two codecs
// (one for K, one for V); kvq_make_layout turns them into byte offsets. Python (page size,
// memory reports, the PyTorch reference), the C++ CPU kernels and the CUDA kernels all read
// offsets from here, so they cannot disagree.
//
// Plain C: no framework types, usable from C++, CUDA host and device code.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define KVQ_HD __host__ __device__ __forceinline__
#else
#define KVQ_HD inline
#endif
// Layout arithmetic is constexpr too: the canonical formats' sizes are pinned at compile
// time (bottom of this file).
#define KVQ_LAYOUT KVQ_HD constexpr

namespace kvq {

// How a single stored value is encoded.
enum Encoding : int32_t {
  ENC_FP16 = 0,      // unquantized baseline, 16 bits
  ENC_BF16 = 1,      // unquantized baseline, 16 bits
  ENC_FP8_E4M3 = 2,  // 8 bits, x = fp8 * scale
  ENC_FP8_E5M2 = 3,  // 8 bits, x = fp8 * scale
  ENC_INT = 4,       // b-bit unsigned code; x = code * scale + zero (asym) or (code - 2^(b-1)) * scale
  ENC_NUQ = 5,       // b-bit index into a per-layer codebook; x = level[code] * scale + zero
};

// Which values share one scale (and zero-point).
enum Granularity : int32_t {
  GRAN_NONE = 0,     // float baseline: nothing
  GRAN_TENSOR = 1,   // one static scale per layer: a kernel argument, not stored
  GRAN_HEAD = 2,     // one static scale per kv head: a kernel argument, not stored
  GRAN_TOKEN = 3,    // one per token (whole head vector), computed on write
  GRAN_GROUP = 4,    // one per token per `group` consecutive channels, computed on write
  GRAN_CHANNEL = 5,  // one per channel per `group` consecutive tokens (KIVI keys)
};

// A codec is what Python passes to every op as int[7], in this order.
struct Codec {
  int32_t encoding;
  int32_t bits;         // bits per stored value: 16, 8, 4, 3, 2
  int32_t granularity;
  int32_t group;        // GROUP: channels per scale; CHANNEL: tokens per scale; else 0
  int32_t symmetric;    // 1: no zero-point stored (INT codes are offset by 2^(bits-1))
  int32_t outliers;     // sparse outlier slots per token per kv head, 0 = none
  int32_t sink;         // 1: the block's first token also kept as an 8-bit row (the
                        // attention sink, read for a sequence's position 0), 0 = none
};
constexpr int kCodecInts = 7;

// A sparse outlier: removed from the dense range, its correction x - (the dense decode at
// its channel) stored (kvq_numeric.h select_outliers). channel == kNoOutlier marks an empty
// slot. 4 bytes keeps fp16 loads aligned on every target.
struct Outlier {
  uint16_t channel;
  uint16_t value_fp16;  // the correction, IEEE half bits
};
static_assert(sizeof(Outlier) == 4, "Outlier must stay 4 bytes");
constexpr uint16_t kNoOutlier = 0xFFFF;

// Scales and zero-points are IEEE fp16 (like ggml's block_q4_1 d/m).
constexpr int32_t kScaleBytes = 2;
// Every field starts on this boundary (vector loads on CPU and GPU); the gaps are padding
// and are counted in the page size like any other byte.
constexpr int32_t kFieldAlign = 16;

// Byte offsets of one tensor's (K's or V's) fields inside a plane.
struct Region {
  int32_t data_off, data_bytes;        // block_size rows of row_bytes packed codes
  int32_t row_bytes;                   // ceil(head_dim * bits / 8)
  int32_t scale_off, scale_bytes;      // scale_rows x scale_cols fp16
  int32_t zero_off, zero_bytes;        // same shape as scales, or 0 bytes when symmetric
  int32_t scale_rows, scale_cols;      // TOKEN: B x 1, GROUP: B x D/g, CHANNEL: B/G x D
  int32_t outlier_off, outlier_bytes;  // block_size x outliers Outlier structs
  int32_t end;                         // first byte after the fields above (aligned)
  int32_t sink_off, sink_bytes;        // sink rows of int8_row_bytes: the block's first
                                       // `sink` tokens again (0 bytes without a sink),
                                       // after both regions (make_layout)
};

struct Layout {
  Region k, v;
  int32_t head_dim, block_size;
  int32_t used_bytes;    // bytes of all fields incl. alignment gaps inside the plane
  int32_t token_bytes;   // C: bytes per token per kv head, K and V together (what vLLM sees)
  int32_t plane_bytes;   // block_size * token_bytes: one (block, kv_head) plane
  int32_t padding;       // plane_bytes - sum of field bytes: alignment gaps + rounding to C
};

KVQ_LAYOUT int32_t align_up(int32_t x, int32_t a) { return (x + a - 1) / a * a; }

// A row of head_dim values kept in 8 bits: int8 codes, then one float32 scale max|x| / 127
// (the 8-bit residual window's rows and the attention sink's; one codec, see
// csrc/cpu/window_rows_body.h and vllm_kvq/residual.py quantize_window_rows).
constexpr int32_t kWindowScaleBytes = 4;
KVQ_LAYOUT int32_t int8_row_bytes(int32_t head_dim) { return head_dim + kWindowScaleBytes; }

KVQ_LAYOUT bool has_stored_scale(const Codec& c) {
  return c.granularity == GRAN_TOKEN || c.granularity == GRAN_GROUP ||
         c.granularity == GRAN_CHANNEL;
}
KVQ_LAYOUT bool has_stored_zero(const Codec& c) {
  return has_stored_scale(c) && !c.symmetric &&
         (c.encoding == ENC_INT || c.encoding == ENC_NUQ);
}

// Index of the scale (and zero) that covers value (token t, channel d) of a block.
KVQ_LAYOUT int32_t scale_index(const Codec& c, int32_t head_dim, int32_t t, int32_t d) {
  switch (c.granularity) {
    case GRAN_TOKEN: return t;
    case GRAN_GROUP: return t * (head_dim / c.group) + d / c.group;
    case GRAN_CHANNEL: return (t / c.group) * head_dim + d;
    default: return 0;
  }
}

KVQ_LAYOUT Region make_region(const Codec& c, int32_t head_dim, int32_t block_size, int32_t off) {
  Region r{};
  r.row_bytes = (head_dim * c.bits + 7) / 8;
  r.data_off = off;
  r.data_bytes = block_size * r.row_bytes;
  off = align_up(off + r.data_bytes, kFieldAlign);
  r.scale_rows = 0;
  r.scale_cols = 0;
  switch (c.granularity) {
    case GRAN_TOKEN: r.scale_rows = block_size; r.scale_cols = 1; break;
    case GRAN_GROUP: r.scale_rows = block_size; r.scale_cols = head_dim / c.group; break;
    case GRAN_CHANNEL: r.scale_rows = block_size / c.group; r.scale_cols = head_dim; break;
    default: break;
  }
  r.scale_off = off;
  r.scale_bytes = r.scale_rows * r.scale_cols * kScaleBytes;
  off = align_up(off + r.scale_bytes, kFieldAlign);
  r.zero_off = off;
  r.zero_bytes = has_stored_zero(c) ? r.scale_bytes : 0;
  off = align_up(off + r.zero_bytes, kFieldAlign);
  r.outlier_off = off;
  r.outlier_bytes = block_size * c.outliers * (int32_t)sizeof(Outlier);
  off = align_up(off + r.outlier_bytes, kFieldAlign);
  r.end = off;
  r.sink_off = 0;  // make_layout places the sink rows after both regions
  r.sink_bytes = 0;
  return r;
}

// The layout of one (block, kv_head) plane. Validation (group divides head_dim, ...) is
// done by the callers' argument checks before this is used.
KVQ_LAYOUT Layout make_layout(const Codec& kc, const Codec& vc, int32_t head_dim,
                          int32_t block_size) {
  Layout l{};
  l.head_dim = head_dim;
  l.block_size = block_size;
  l.k = make_region(kc, head_dim, block_size, 0);
  l.v = make_region(vc, head_dim, block_size, l.k.end);
  // The sink rows go last: the K and V fields keep the offsets (and the cache-line
  // alignment) they have without them; moving V's data off a 64-byte boundary cost the
  // decode kernel 8-20% at 32k tokens.
  l.k.sink_off = l.v.end;
  l.k.sink_bytes = kc.sink * int8_row_bytes(head_dim);
  l.v.sink_off = align_up(l.k.sink_off + l.k.sink_bytes, kFieldAlign);
  l.v.sink_bytes = vc.sink * int8_row_bytes(head_dim);
  l.used_bytes = align_up(l.v.sink_off + l.v.sink_bytes, kFieldAlign);
  l.token_bytes = (l.used_bytes + block_size - 1) / block_size;
  l.plane_bytes = l.token_bytes * block_size;
  const int32_t fields = l.k.data_bytes + l.k.scale_bytes + l.k.zero_bytes +
                         l.k.outlier_bytes + l.k.sink_bytes + l.v.data_bytes +
                         l.v.scale_bytes + l.v.zero_bytes + l.v.outlier_bytes +
                         l.v.sink_bytes;
  l.padding = l.plane_bytes - fields;
  return l;
}

// Residual window (recent tokens), per running sequence per layer: K and V of up to
// `residual_tokens` tokens per kv head, each (token, K or V, kv head) row of head_dim values
// stored in `window_bits`: 16 (the model's 16-bit dtype, exact for a 16-bit model) or 8
// (int8 codes and one float32 scale, max|x| / 127, right after them: the `_w8` formats).
// vllm_kvq/residual.py WINDOW_BITS lists the two; formats validate them.
KVQ_LAYOUT int32_t window_value_row_bytes(int32_t head_dim, int32_t window_bits) {
  return window_bits == 8 ? int8_row_bytes(head_dim) : head_dim * 2;
}
KVQ_LAYOUT int64_t residual_bytes_per_seq_layer(int32_t num_kv_heads, int32_t head_dim,
                                            int32_t residual_tokens, int32_t window_bits) {
  return (int64_t)2 * num_kv_heads * residual_tokens *
         window_value_row_bytes(head_dim, window_bits);
}

// The window lives in blocks of vLLM's own pool (vllm_kvq/window_cache.py), pages of the
// same size as the quantized ones: a block's page (block_size tokens x token_bytes, per kv
// head) holds this many window rows of one token's K and V (2 value rows per head).
KVQ_LAYOUT int32_t window_rows_per_block(int32_t token_bytes, int32_t block_size,
                                         int32_t head_dim, int32_t window_bits) {
  return (int32_t)((int64_t)token_bytes * block_size /
                   (2 * window_value_row_bytes(head_dim, window_bits)));
}

// Blocks a running sequence claims for its window (0: no window).
KVQ_LAYOUT int32_t window_blocks_per_seq(int32_t token_bytes, int32_t block_size,
                                         int32_t head_dim, int32_t residual_tokens,
                                         int32_t window_bits) {
  if (residual_tokens == 0) return 0;
  const int32_t rows = window_rows_per_block(token_bytes, block_size, head_dim, window_bits);
  return (residual_tokens + rows - 1) / rows;
}


// ---- canonical formats, pinned like ggml's block structs ---------------------------------
// Bytes per token per kv head (K and V, scales, zero-points, outlier slots, alignment) at
// block size 128; README's tables and `vllm-kvq formats` print these same numbers.
namespace canonical {
constexpr Codec kBF16{ENC_BF16, 16, GRAN_NONE, 0, 0, 0, 0};
constexpr Codec kFP8{ENC_FP8_E4M3, 8, GRAN_TENSOR, 0, 0, 0, 0};
constexpr Codec kInt8Token{ENC_INT, 8, GRAN_TOKEN, 0, 0, 0, 0};
constexpr Codec kInt4Group32{ENC_INT, 4, GRAN_GROUP, 32, 0, 0, 0};
constexpr Codec kInt2Group32{ENC_INT, 2, GRAN_GROUP, 32, 0, 0, 0};
constexpr Codec kKivi4Keys{ENC_INT, 4, GRAN_CHANNEL, 32, 0, 0, 0};   // kivi4 = these + int4_group32
constexpr Codec kKivi2Keys{ENC_INT, 2, GRAN_CHANNEL, 32, 0, 0, 0};   // kivi2 = these + int2_group32
constexpr Codec kNuq3Keys{ENC_NUQ, 3, GRAN_CHANNEL, 32, 0, 1, 0};    // nuq3: 1 outlier slot each
constexpr Codec kNuq3Values{ENC_NUQ, 3, GRAN_TOKEN, 0, 0, 1, 0};
constexpr Codec kNuq2Keys{ENC_NUQ, 2, GRAN_CHANNEL, 32, 0, 1, 0};    // nuq2: like nuq3's
constexpr Codec kNuq2Values{ENC_NUQ, 2, GRAN_TOKEN, 0, 0, 1, 0};
// the same with the attention sink (_sink): one 8-bit row of K and one of V per block
constexpr Codec with_sink(Codec c) { c.sink = 1; return c; }
constexpr int32_t token_bytes(const Codec& k, const Codec& v, int32_t head_dim) {
  return make_layout(k, v, head_dim, 128).token_bytes;
}
static_assert(token_bytes(kBF16, kBF16, 64) == 256, "bf16, head_dim 64");
static_assert(token_bytes(kFP8, kFP8, 64) == 128, "fp8_e4m3, head_dim 64");
static_assert(token_bytes(kInt8Token, kInt8Token, 64) == 136, "int8_token, head_dim 64");
static_assert(token_bytes(kInt4Group32, kInt4Group32, 64) == 80, "int4_group32, head_dim 64");
static_assert(token_bytes(kKivi4Keys, kInt4Group32, 64) == 80, "kivi4, head_dim 64");
static_assert(token_bytes(kKivi2Keys, kInt2Group32, 64) == 48, "kivi2, head_dim 64");
static_assert(token_bytes(kNuq3Keys, kNuq3Values, 64) == 68, "nuq3, head_dim 64");
static_assert(token_bytes(kNuq2Keys, kNuq2Values, 64) == 52, "nuq2, head_dim 64");
// sinks: 2 x 80 aligned bytes per block at head_dim 64 (+1.25 B/token before rounding),
// 2 x 144 at 128 (+2.25 B); 256: 2 x 272 (+4.25 B)
static_assert(token_bytes(with_sink(kKivi2Keys), with_sink(kInt2Group32), 64) == 50,
              "kivi2_sink, head_dim 64");
static_assert(token_bytes(with_sink(kNuq2Keys), with_sink(kNuq2Values), 64) == 54,
              "nuq2_sink, head_dim 64");
static_assert(token_bytes(with_sink(kKivi4Keys), with_sink(kInt4Group32), 64) == 82,
              "kivi4_sink, head_dim 64");
static_assert(token_bytes(with_sink(kKivi2Keys), with_sink(kInt2Group32), 128) == 99,
              "kivi2_sink, head_dim 128");
static_assert(token_bytes(kInt4Group32, kInt4Group32, 128) == 160, "int4_group32, head_dim 128");
static_assert(token_bytes(kKivi2Keys, kInt2Group32, 128) == 96, "kivi2, head_dim 128");
static_assert(token_bytes(kNuq3Keys, kNuq3Values, 128) == 124, "nuq3, head_dim 128");
// 16-bit windows in pool blocks of 128 tokens at head_dim 64: kivi2's 128 tokens take 6
// blocks of 24 rows, kivi4's 4 blocks of 40, nuq3's 32 tokens one block of 34
static_assert(window_blocks_per_seq(token_bytes(kKivi2Keys, kInt2Group32, 64), 128, 64, 128, 16)
              == 6, "kivi2 window");
static_assert(window_blocks_per_seq(token_bytes(kKivi4Keys, kInt4Group32, 64), 128, 64, 128, 16)
              == 4, "kivi4 window");
static_assert(window_blocks_per_seq(token_bytes(kNuq3Keys, kNuq3Values, 64), 128, 64, 32, 16)
              == 1, "nuq3 window");
// 8-bit windows (_w8): 68 bytes per value row at head_dim 64; kivi2_w8 takes 3 blocks of 45
// rows, kivi4_w8 2 of 75
static_assert(window_value_row_bytes(64, 8) == 68 && window_value_row_bytes(128, 8) == 132,
              "int8 window row: codes + float32 scale");
static_assert(window_blocks_per_seq(token_bytes(kKivi2Keys, kInt2Group32, 64), 128, 64, 128, 8)
              == 3, "kivi2_w8 window");
static_assert(window_blocks_per_seq(token_bytes(kKivi4Keys, kInt4Group32, 64), 128, 64, 128, 8)
              == 2, "kivi4_w8 window");
}  // namespace canonical

}  // namespace kvq
