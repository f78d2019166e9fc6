// kvq_cpu::stage_window: one layer's residual-window step in one call (vllm_kvq/residual.py,
// stage_and_write, is the reference). Profiled on SmolLM2 (16 sequences, kivi2), its eight
// torch indexing ops per layer cost ~0.3 ms per layer, ~10 ms per decode step; the rows it
// moves are a few hundred bytes each, so here it is a loop of row copies.
//
// staging [2, Ns, H, D] (the model's dtype) receives
//   rows gather_rows[i] <- window row (gather_blk[i], gather_row[i]) of pool (K and V),
//   rows new_rows[i]    <- key[new_tok[i]] / value[new_tok[i]];
// then window row (keep_blk[i], keep_row[i]) <- staging row keep_rows[i] (K and V).
// pool: [num_blocks, rows_per_block, 2, H, D], 16 bits, or for an 8-bit window (_w8)
// [num_blocks, rows_per_block, 2, H, D + 4] uint8: per (token, K or V, head) D int8 codes
// and a float32 scale (csrc/kvq_layout.h window_value_row_bytes); any strides of its two
// first dims with each (K or V) row contiguous. Conversions round like torch's .to().
// With an 8-bit pool every staging row holds what the pool holds: new tokens are rounded
// to int8 as they are staged (the step's own tokens too, so that a prefill chunk sees what
// decode steps see), and a kept row stores the same codes, not a requantization.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "kvq_layout.h"
#include "op_checks.h"

namespace kvq_cpu {
namespace {

template <class S, class T>
void copy_row(const S* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, sizeof(T) * (size_t)n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
  }
}

const int64_t* index_data(const at::Tensor& t, const char* what, int64_t n_expect = -1) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                  t.device().is_cpu(),
              what, " must be a contiguous 1-D int64 CPU tensor, got ", t.scalar_type(), " ",
              t.sizes());
  TORCH_CHECK(n_expect < 0 || t.numel() == n_expect, what, " has ", t.numel(),
              " entries, expected ", n_expect);
  return t.data_ptr<int64_t>();
}

void check_range(const int64_t* x, int64_t n, int64_t limit, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(x[i] >= 0 && x[i] < limit, what, "[", i, "] = ", x[i], " is outside [0, ",
                limit, ")");
}

// The step's row lists (pointers into the int64 index tensors).
struct RowPlan {
  const int64_t *g_rows, *g_blk, *g_row;  // pool -> staging
  int64_t ng;
  const int64_t *n_rows, *n_tok;          // key/value -> staging
  int64_t nn;
  const int64_t *k_rows, *k_blk, *k_row;  // staging -> pool
  int64_t nk;
};

template <class TS, class TP>
void stage_typed(at::Tensor& staging, const at::Tensor& key, const at::Tensor& value,
                 at::Tensor& pool, const RowPlan& p) {
  const int64_t H = staging.size(2), D = staging.size(3), E = H * D;  // values per K/V row
  TS* st = staging.data_ptr<TS>();
  const int64_t plane = staging.stride(0);
  TP* pl = pool.data_ptr<TP>();
  const int64_t pb = pool.stride(0), pr = pool.stride(1), pkv = pool.stride(2);
  for (int64_t i = 0; i < p.ng; ++i) {
    const TP* src = pl + p.g_blk[i] * pb + p.g_row[i] * pr;
    copy_row(src, st + p.g_rows[i] * E, E);
    copy_row(src + pkv, st + plane + p.g_rows[i] * E, E);
  }
  const TS* kd = key.data_ptr<TS>();
  const TS* vd = value.data_ptr<TS>();
  for (int64_t i = 0; i < p.nn; ++i)
    for (int64_t h = 0; h < H; ++h) {
      TS* dst = st + p.n_rows[i] * E + h * D;
      std::memcpy(dst, kd + p.n_tok[i] * key.stride(0) + h * key.stride(1), sizeof(TS) * D);
      std::memcpy(dst + plane, vd + p.n_tok[i] * value.stride(0) + h * value.stride(1),
                  sizeof(TS) * D);
    }
  for (int64_t i = 0; i < p.nk; ++i) {
    TP* dst = pl + p.k_blk[i] * pb + p.k_row[i] * pr;
    copy_row(st + p.k_rows[i] * E, dst, E);
    copy_row(st + plane + p.k_rows[i] * E, dst + pkv, E);
  }
}

// ---- 8-bit window rows --------------------------------------------------------------
// One (K or V, head) row: D int8 codes and a float32 scale (window_rows_body.h, compiled
// for each SIMD path; simd_level() picks one per call, KVQ_SIMD lowers it like the other
// ops). A prefill chunk quantizes every token, so the loops are written to vectorize.
constexpr int64_t kWindowScaleBytes = kvq::kWindowScaleBytes;
constexpr int64_t kMaxWindowHeadDim = 512;  // formats.SUPPORTED_HEAD_SIZES go to 256
namespace rows_scalar {
#include "window_rows_body.h"
}  // namespace rows_scalar
#pragma GCC push_options
#pragma GCC target("avx2")
namespace rows_avx2 {
#include "window_rows_body.h"
}  // namespace rows_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace rows_avx512 {
#include "window_rows_body.h"
}  // namespace rows_avx512
#pragma GCC pop_options

struct RowCodec {
  void (*quantize)(const float*, int64_t, uint8_t*);
  void (*dequantize_bf16)(const uint8_t*, int64_t, int64_t, uint16_t*);
};

RowCodec row_codec() {
  switch (simd_level()) {
    case 2: return {rows_avx512::quantize_f32_row_i8, rows_avx512::dequantize_row_i8_bf16};
    case 1: return {rows_avx2::quantize_f32_row_i8, rows_avx2::dequantize_row_i8_bf16};
    default: return {rows_scalar::quantize_f32_row_i8, rows_scalar::dequantize_row_i8_bf16};
  }
}

template <class TS>
void quantize_row_i8(const RowCodec& rc, const TS* x, int64_t D, uint8_t* out) {
  if constexpr (std::is_same_v<TS, float>) {
    rc.quantize(x, D, out);
  } else {
    float buf[kMaxWindowHeadDim];  // stage_int8 checked D
    if constexpr (std::is_same_v<TS, c10::BFloat16>) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
      for (int64_t i = 0; i < D; ++i) {  // bf16 -> float is a shift (NaN stays NaN)
        const uint32_t u = (uint32_t)b[i] << 16;
        std::memcpy(buf + i, &u, sizeof u);
      }
    } else {
      for (int64_t i = 0; i < D; ++i) buf[i] = static_cast<float>(x[i]);
    }
    rc.quantize(buf, D, out);
  }
}

// One K or V row of H segments into H * D values of the staging dtype.
template <class TS>
void dequantize_row_i8(const RowCodec& rc, const uint8_t* in, int64_t H, int64_t D, TS* y) {
  if constexpr (std::is_same_v<TS, c10::BFloat16>) {
    rc.dequantize_bf16(in, H, D, reinterpret_cast<uint16_t*>(y));
  } else {
    for (int64_t h = 0; h < H; ++h, in += D + kWindowScaleBytes, y += D) {
      float s;
      std::memcpy(&s, in + D, sizeof s);
      const int8_t* codes = reinterpret_cast<const int8_t*>(in);
      for (int64_t i = 0; i < D; ++i) y[i] = static_cast<TS>(static_cast<float>(codes[i]) * s);
    }
  }
}

template <class TS>
void stage_int8(at::Tensor& staging, const at::Tensor& key, const at::Tensor& value,
                at::Tensor& pool, const RowPlan& p) {
  const int64_t Ns = staging.size(1), H = staging.size(2), D = staging.size(3);
  TORCH_CHECK(D <= kMaxWindowHeadDim, "an 8-bit window takes head_dim <= ", kMaxWindowHeadDim,
              ", got ", D);
  const int64_t E = H * D, RB = D + kWindowScaleBytes, P = H * RB;  // P: one K/V row
  TS* st = staging.data_ptr<TS>();
  const int64_t plane = staging.stride(0);
  uint8_t* pl = pool.data_ptr<uint8_t>();
  const int64_t pb = pool.stride(0), pr = pool.stride(1), pkv = pool.stride(2);
  // the pool bytes of the staging rows this step keeps (K row then V row), filled as those
  // rows are staged
  std::vector<int64_t> slot_of(Ns, -1);
  for (int64_t i = 0; i < p.nk; ++i) slot_of[p.k_rows[i]] = i;
  std::vector<uint8_t> kept((size_t)(p.nk * 2 * P));
  const RowCodec rc = row_codec();
  for (int64_t i = 0; i < p.ng; ++i) {
    const int64_t r = p.g_rows[i];
    const uint8_t* src = pl + p.g_blk[i] * pb + p.g_row[i] * pr;
    for (int64_t kv = 0; kv < 2; ++kv)
      dequantize_row_i8(rc, src + kv * pkv, H, D, st + kv * plane + r * E);
    if (slot_of[r] >= 0) {
      std::memcpy(kept.data() + slot_of[r] * 2 * P, src, (size_t)P);
      std::memcpy(kept.data() + slot_of[r] * 2 * P + P, src + pkv, (size_t)P);
    }
  }
  std::vector<uint8_t> row((size_t)(2 * P));
  const TS* kd = key.data_ptr<TS>();
  const TS* vd = value.data_ptr<TS>();
  for (int64_t i = 0; i < p.nn; ++i) {
    const int64_t r = p.n_rows[i], t = p.n_tok[i];
    for (int64_t h = 0; h < H; ++h) {
      quantize_row_i8(rc, kd + t * key.stride(0) + h * key.stride(1), D, row.data() + h * RB);
      quantize_row_i8(rc, vd + t * value.stride(0) + h * value.stride(1), D,
                      row.data() + P + h * RB);
    }
    for (int64_t kv = 0; kv < 2; ++kv)
      dequantize_row_i8(rc, row.data() + kv * P, H, D, st + kv * plane + r * E);
    if (slot_of[r] >= 0)
      std::memcpy(kept.data() + slot_of[r] * 2 * P, row.data(), (size_t)(2 * P));
  }
  for (int64_t i = 0; i < p.nk; ++i) {
    const uint8_t* src = kept.data() + slot_of[p.k_rows[i]] * 2 * P;
    uint8_t* dst = pl + p.k_blk[i] * pb + p.k_row[i] * pr;
    std::memcpy(dst, src, (size_t)P);
    std::memcpy(dst + pkv, src + P, (size_t)P);
  }
}

template <class TS>
void stage_for_pool(at::Tensor& staging, const at::Tensor& key, const at::Tensor& value,
                    at::Tensor& pool, const RowPlan& p) {
  if (pool.scalar_type() == at::kByte)
    stage_int8<TS>(staging, key, value, pool, p);
  else if (pool.scalar_type() == at::kBFloat16)
    stage_typed<TS, c10::BFloat16>(staging, key, value, pool, p);
  else
    stage_typed<TS, c10::Half>(staging, key, value, pool, p);
}

}  // namespace

void stage_window(at::Tensor& staging, const at::Tensor& key, const at::Tensor& value,
                  at::Tensor& pool, const at::Tensor& gather_rows, const at::Tensor& gather_blk,
                  const at::Tensor& gather_row, const at::Tensor& new_rows,
                  const at::Tensor& new_tok, const at::Tensor& keep_rows,
                  const at::Tensor& keep_blk, const at::Tensor& keep_row) {
  TORCH_CHECK(staging.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  pool.device().is_cpu(),
              "stage_window (CPU) needs CPU tensors");
  TORCH_CHECK(staging.dim() == 4 && staging.size(0) == 2 && staging.is_contiguous(),
              "staging must be a contiguous [2, Ns, H, D] tensor, got ", staging.sizes());
  const int64_t Ns = staging.size(1), H = staging.size(2), D = staging.size(3);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == H && key.size(2) == D &&
                  value.sizes() == key.sizes(),
              "key/value must be [N, ", H, ", ", D, "] like staging, got ", key.sizes(), " and ",
              value.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  TORCH_CHECK(key.scalar_type() == staging.scalar_type() &&
                  value.scalar_type() == staging.scalar_type(),
              "key/value must have staging's dtype ", staging.scalar_type());
  TORCH_CHECK(pool.scalar_type() == at::kBFloat16 || pool.scalar_type() == at::kHalf ||
                  pool.scalar_type() == at::kByte,
              "pool must be bfloat16 or float16 (a 16-bit window) or uint8 (an 8-bit one), got ",
              pool.scalar_type());
  const int64_t row = pool.scalar_type() == at::kByte
                          ? kvq::window_value_row_bytes((int32_t)D, 8) : D;
  TORCH_CHECK(pool.dim() == 5 && pool.size(2) == 2 && pool.size(3) == H &&
                  pool.size(4) == row && pool.stride(4) == 1 && pool.stride(3) == row,
              "pool must be [num_blocks, rows_per_block, 2, ", H, ", ", row,
               "] with contiguous rows, got ", pool.sizes(), " strides ", pool.strides());
  RowPlan p;
  p.ng = gather_rows.numel(), p.nn = new_rows.numel(), p.nk = keep_rows.numel();
  p.g_rows = index_data(gather_rows, "gather_rows");
  p.g_blk = index_data(gather_blk, "gather_blk", p.ng);
  p.g_row = index_data(gather_row, "gather_row", p.ng);
  p.n_rows = index_data(new_rows, "new_rows");
  p.n_tok = index_data(new_tok, "new_tok", p.nn);
  p.k_rows = index_data(keep_rows, "keep_rows");
  p.k_blk = index_data(keep_blk, "keep_blk", p.nk);
  p.k_row = index_data(keep_row, "keep_row", p.nk);
  check_range(p.g_rows, p.ng, Ns, "gather_rows");
  check_range(p.n_rows, p.nn, Ns, "new_rows");
  check_range(p.k_rows, p.nk, Ns, "keep_rows");
  check_range(p.g_blk, p.ng, pool.size(0), "gather_blk");
  check_range(p.k_blk, p.nk, pool.size(0), "keep_blk");
  check_range(p.g_row, p.ng, pool.size(1), "gather_row");
  check_range(p.k_row, p.nk, pool.size(1), "keep_row");
  check_range(p.n_tok, p.nn, key.size(0), "new_tok");
  switch (staging.scalar_type()) {
    case at::kFloat:
      stage_for_pool<float>(staging, key, value, pool, p);
      break;
    case at::kBFloat16:
      stage_for_pool<c10::BFloat16>(staging, key, value, pool, p);
      break;
    case at::kHalf:
      stage_for_pool<c10::Half>(staging, key, value, pool, p);
      break;
    default:
      TORCH_CHECK(false, "staging must be float32, float16 or bfloat16, got ",
                  staging.scalar_type());
  }
}

}  // namespace kvq_cpu
