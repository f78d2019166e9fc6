// Shared pieces of the vllm-kvq CUDA kernels: kernel parameter blocks (plain structs, no
// torch types), the compile-time "kinds" of a cache side, byte loaders and the register
// dequantisation of packed codes into packed fp16/bf16 pairs.
#pragma once
#include <stdint.h>

#include "../kvq_layout.h"
#include "../kvq_numeric.h"
#include "kvq_cuda_compat.cuh"
#include "kvq_ptx.cuh"

namespace kvq_cuda {

// Runtime dtypes of activations (query, key, value, out, staging).
enum DType : int32_t { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

// One side (K or V) of a format, resolved for the kernels.
struct Side {
  int32_t encoding, bits, gran, group, symmetric;
  int32_t data_off, row_bytes;
  int32_t scale_off, zero_off, scale_cols, has_zero;  // has_zero: asymmetric INT with zeros
  int32_t gshift;          // ROW scales: channel -> column is (ch >> gshift); 31 for per-token
  int32_t sink, sink_off;  // attention sink: a block's first `sink` tokens again as int8 rows
  const float* levels;     // nuq: the layer's codebook, float32 [2^bits] ascending in [-1, 1]
  int32_t outliers, outlier_off;  // sparse outlier slots per token (kvq::Outlier), 0: none
  int32_t static_scale;    // 1 for TENSOR/HEAD granularity (scale is a kernel argument)
  const float* sscale;     // static scales, sscale_n == 1 (tensor) or num_kv_heads
  int32_t sscale_n;
};

struct WriteParams {
  const void* key;
  const void* value;
  int64_t k_sn, k_sh, v_sn, v_sh;  // element strides of [N, H, D] (last dim contiguous)
  int32_t in_dtype;
  uint8_t* cache;
  int64_t plane_bytes, num_blocks;
  int32_t H, D, B;
  const void* slots;     // int64 or int32 [N] (slots_i32)
  int32_t slots_i32;
  int32_t N;
  Side side[2];
  int32_t* error_flag;  // optional: set to 1 when slot_mapping breaks a rule (see README)
};

struct AttnParams {
  void* out;
  const void* q;
  int64_t q_st, q_sh, o_st, o_sh;  // element strides of [T, Hq, D]
  int32_t q_dtype;                 // also the dtype of out and of the staging tensors
  const uint8_t* cache;
  int64_t plane_bytes;
  int32_t H, Hq, D, B, G;  // G = Hq / H
  const int32_t* block_table;
  int64_t bt_stride;
  int32_t max_blocks;
  const int32_t* seq_lens;
  const int32_t* qsl;  // query_start_loc [S+1]
  int32_t S, T;
  const void* sk;
  const void* sv;
  int64_t sk_sn, sk_sh, sv_sn, sv_sh;
  const int32_t* ssl;    // staging_start_loc [S+1]
  const int32_t* spos0;  // staging_pos0 [S]
  int32_t R;             // residual chunk (1 = no staging)
  int32_t window;        // sliding window W (0: none): a query at p sees keys (p - W, p]
  float scale_log2;      // softmax_scale * log2(e)
  float softcap_log2;    // logits_soft_cap * log2(e) (0: none): logit x -> c tanh(x / c)
  int32_t sink;          // attention sink: positions < sink are read from the first block's
                         // int8 sink rows (K and V), wherever the pages would be read
  Side side[2];
  // split-KV decode (kvq_decode.cuh)
  int32_t decode_fast;       // 1: sequences with one query token go to the decode kernel
  int32_t dec_head_tiles;    // ceil(G / 8)
  int32_t min_part_tokens;   // smallest partition (multiple of 64)
  int32_t max_parts;         // page partitions per sequence at most (grid.x - 1)
  float* part_o;             // [S, Hq, max_parts + 1, D]: normalised partial outputs
  float* part_ml;            // [S, Hq, max_parts + 1, 2]: (max logit, exp-sum), log2 domain
  // generic attention (kvq_attention.cuh)
  int32_t gen_heads;         // heads per generic tile (<= 16)
  int32_t gen_queries;       // query tokens per generic tile
  int32_t gen_head_tiles;    // ceil(G / gen_heads)
  int32_t max_tiles;
  int32_t* tiles;            // [1 + 2 * max_tiles]: count, then (seq, first query) pairs
};

// ---- kinds: what the inner loops are specialised on -----------------------------------
enum Kind : int32_t {
  KIND_F16 = 0, KIND_BF16, KIND_E4M3, KIND_E5M2, KIND_I2, KIND_I3, KIND_I4, KIND_I8,
  KIND_N2, KIND_N3, KIND_N4,  // nuq: b-bit indices into a codebook, scale and zero as INT
  KIND_COUNT
};
KVQ_HOSTDEV int32_t kind_of(const kvq::Codec& c) {
  switch (c.encoding) {
    case kvq::ENC_FP16: return KIND_F16;
    case kvq::ENC_BF16: return KIND_BF16;
    case kvq::ENC_FP8_E4M3: return KIND_E4M3;
    case kvq::ENC_FP8_E5M2: return KIND_E5M2;
    case kvq::ENC_INT:
      return c.bits == 2 ? KIND_I2 : c.bits == 3 ? KIND_I3 : c.bits == 4 ? KIND_I4
             : c.bits == 8 ? KIND_I8 : -1;
    case kvq::ENC_NUQ:
      return c.bits == 2 ? KIND_N2 : c.bits == 3 ? KIND_N3 : c.bits == 4 ? KIND_N4 : -1;
    default: return -1;
  }
}

template <int K>
struct KindT {
  static constexpr bool nuq = K >= KIND_N2;
  static constexpr int bits = K <= KIND_BF16 ? 16 : K <= KIND_E5M2 ? 8
                              : K == KIND_I2 || K == KIND_N2 ? 2 : K == KIND_I3 || K == KIND_N3 ? 3
                              : K == KIND_I4 || K == KIND_N4 ? 4 : 8;
  static constexpr bool raw16 = K <= KIND_BF16;         // stored as 16-bit floats
  static constexpr bool fp8 = K == KIND_E4M3 || K == KIND_E5M2;
  static constexpr bool is_int = K >= KIND_I2;          // packed codes + scale / zero (INT, nuq)
  static constexpr bool bf = K == KIND_BF16;            // mma operands in bf16, else fp16
};

// ---- small helpers ---------------------------------------------------------------------
KVQ_DEV int64_t load_slot(const WriteParams& p, int64_t i) {
  return p.slots_i32 ? (int64_t) static_cast<const int32_t*>(p.slots)[i]
                     : static_cast<const int64_t*>(p.slots)[i];
}
KVQ_DEV float load_act(const void* p, int64_t i, int dt) {
  if (dt == DT_F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dt == DT_F16 ? h2f(h) : bf2f(h);
}
KVQ_DEV void store_act(void* p, int64_t i, int dt, float v) {
  if (dt == DT_F32) { static_cast<float*>(p)[i] = v; return; }
  const uint32_t w = dt == DT_F16 ? pack2<false>(v, 0.0f) : pack2<true>(v, 0.0f);
  static_cast<uint16_t*>(p)[i] = (uint16_t)(w & 0xffffu);
}
KVQ_DEV uint16_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
constexpr int kMaxOutliers = 8;  // outlier slots per token the CUDA kernels take

// The stored correction of channel ch of token t (0 when none of its slots holds ch).
KVQ_DEV float outlier_correction(const Side& sd, const uint8_t* plane, int t, int ch) {
  const uint8_t* o = plane + sd.outlier_off + (int64_t)t * sd.outliers * 4;
  float c = 0.0f;
  for (int j = 0; j < sd.outliers; ++j)
    if (ld_u16(o + 4 * j) == (uint16_t)ch) c += h2f(ld_u16(o + 4 * j + 2));
  return c;
}

// The dense decode of an INT or nuq `code` with its group's (stored) scale / zero.
KVQ_DEV float dense_value(const Side& sd, uint32_t code, float scale, float zero) {
  return sd.encoding == kvq::ENC_NUQ ? kvq::dequantize_nuq(code, scale, zero, sd.levels)
                                     : kvq::dequantize_int(code, scale, zero, sd.bits, sd.symmetric != 0);
}

// Channel ch of sink row t of a plane (the block's token t as int8 codes + a float32 scale,
// vllm_kvq.residual.quantize_window_rows): code * scale.
KVQ_DEV float sink_value(const Side& sd, const uint8_t* plane, int t, int ch, int D) {
  const uint8_t* row = plane + sd.sink_off + (int64_t)t * kvq::int8_row_bytes(D);
  return (float)(int8_t)row[ch] * *reinterpret_cast<const float*>(row + D);
}
KVQ_DEV uint32_t h2_bcast(uint16_t h) { return (uint32_t)h * 0x10001u; }
KVQ_DEV uint32_t h2_pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }
KVQ_HOSTDEV constexpr int pow2_part(int x) { return x & -x; }
KVQ_HOSTDEV constexpr int cmin(int a, int b) { return a < b ? a : b; }

// Load NB bytes starting at p (aligned to ALIGN bytes) into little-endian 32-bit words.
template <int NB, int ALIGN>
KVQ_DEV void load_bytes(const uint8_t* p, uint32_t (&w)[(NB + 3) / 4]) {
  constexpr int A = cmin(cmin(ALIGN, pow2_part(NB)), 16);
  if constexpr (A == 16) {
#pragma unroll
    for (int i = 0; i < NB / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (A == 8) {
#pragma unroll
    for (int i = 0; i < NB / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x; w[2 * i + 1] = v.y;
    }
  } else if constexpr (A == 4) {
#pragma unroll
    for (int i = 0; i < NB / 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
  } else if constexpr (A == 2) {
#pragma unroll
    for (int i = 0; i < (NB + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < NB / 2; ++i)
      w[i / 2] |= (uint32_t)reinterpret_cast<const uint16_t*>(p)[i] << (16 * (i & 1));
  } else {
#pragma unroll
    for (int i = 0; i < (NB + 3) / 4; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < NB; ++i) w[i / 4] |= (uint32_t)p[i] << (8 * (i & 3));
  }
}

// `n` bits (n <= 32) at bit offset `off` of a little-endian word array.
template <int NW>
KVQ_DEV uint32_t bits_at(const uint32_t (&w)[NW], int off, int n) {
  const int i = off >> 5, sh = off & 31;
  uint64_t v = w[i];
  if (sh + n > 32 && i + 1 < NW) v |= (uint64_t)w[i + 1] << 32;
  return (uint32_t)(v >> sh) & (n == 32 ? 0xffffffffu : ((1u << n) - 1u));
}

constexpr uint32_t kMagic = 0x64006400u;  // fp16 1024.0 in both halves: (bits | kMagic) = 1024 + code

// ---- K side: one token's 16-channel segment -> 8 packed pairs ---------------------------
// Pair p of a segment holds channels (k_pair_lo(p), k_pair_hi(p)) of that segment; the Q
// fragments are built with the same map, so the order is free to suit the unpacking.
template <int K>
KVQ_HOSTDEV constexpr int k_pair_lo(int p) {
  return KindT<K>::bits >= 8 ? 2 * p
         : KindT<K>::bits == 4 ? 8 * (p / 4) + (p % 4)
         : KindT<K>::bits == 2 ? p
                               : 8 * (p / 4) + (p % 4);  // 3 bits
}
template <int K>
KVQ_HOSTDEV constexpr int k_pair_hi(int p) {
  return KindT<K>::bits >= 8 ? 2 * p + 1
         : KindT<K>::bits == 2 ? p + 8 : k_pair_lo<K>(p) + 4;
}

// Raw codes of segment `seg` of a quarter row `w` (QC channels) as packed halves: for INT
// kinds 1024 + code, for fp8 the exact value (e5m2) or value * 2^-8 (e4m3), for 16-bit
// kinds the stored bits.
template <int K, int NW>
KVQ_DEV void k_seg_codes(const uint32_t (&w)[NW], int seg, uint32_t (&h)[8]) {
  constexpr int b = KindT<K>::bits;
  if constexpr (b == 16) {
#pragma unroll
    for (int p = 0; p < 8; ++p) h[p] = w[seg * 8 + p];
  } else if constexpr (KindT<K>::fp8) {
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint32_t x = prmt(w[seg * 4 + p / 2], 0u, (p & 1) ? 0x3424u : 0x1404u);
      h[p] = K == KIND_E4M3 ? (((x >> 1) & 0x3f803f80u) | (x & 0x80008000u)) : x;
    }
  } else if constexpr (b == 8) {
#pragma unroll
    for (int p = 0; p < 8; ++p) h[p] = prmt(w[seg * 4 + p / 2], 0x64646464u, (p & 1) ? 0x4342u : 0x4140u);
  } else if constexpr (b == 4) {
#pragma unroll
    for (int p = 0; p < 8; ++p) h[p] = ((w[seg * 2 + p / 4] >> (4 * (p % 4))) & 0x000f000fu) | kMagic;
  } else if constexpr (b == 2) {
#pragma unroll
    for (int p = 0; p < 8; ++p) h[p] = ((w[seg] >> (2 * p)) & 0x00030003u) | kMagic;
  } else {  // 3 bits: two 24-bit units of 8 channels
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const uint32_t x = bits_at(w, seg * 48 + u * 24, 24);
      const uint32_t y = (x & 0xfffu) | ((x & 0xfff000u) << 4);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[4 * u + k] = ((y >> (3 * k)) & 0x00070007u) | kMagic;
    }
  }
}

// ---- V side: one 8-channel octet of two tokens -> 8 packed (token a, token b) pairs ----
// wa / wb: the two tokens' slice words; octet `o` of the slice. Channel order is natural.
template <int K, int NW>
KVQ_DEV void v_oct_codes(const uint32_t (&wa)[NW], const uint32_t (&wb)[NW], int o,
                         uint32_t (&h)[8]) {
  constexpr int b = KindT<K>::bits;
  if constexpr (b == 16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      h[2 * i] = prmt(wa[4 * o + i], wb[4 * o + i], 0x5410u);
      h[2 * i + 1] = prmt(wa[4 * o + i], wb[4 * o + i], 0x7632u);
    }
  } else if constexpr (b == 8) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t lo = prmt(wa[2 * o + i], wb[2 * o + i], 0x5410u);
      const uint32_t hi = prmt(wa[2 * o + i], wb[2 * o + i], 0x7632u);
      if constexpr (KindT<K>::fp8) {
        uint32_t x[4] = {prmt(lo, 0u, 0x2404u), prmt(lo, 0u, 0x3414u), prmt(hi, 0u, 0x2404u),
                         prmt(hi, 0u, 0x3414u)};
#pragma unroll
        for (int k = 0; k < 4; ++k)
          h[4 * i + k] = K == KIND_E4M3 ? (((x[k] >> 1) & 0x3f803f80u) | (x[k] & 0x80008000u)) : x[k];
      } else {
        h[4 * i + 0] = prmt(lo, 0x64646464u, 0x4240u);
        h[4 * i + 1] = prmt(lo, 0x64646464u, 0x4341u);
        h[4 * i + 2] = prmt(hi, 0x64646464u, 0x4240u);
        h[4 * i + 3] = prmt(hi, 0x64646464u, 0x4341u);
      }
    }
  } else if constexpr (b == 4) {
    const uint32_t lo = prmt(wa[o], wb[o], 0x5410u), hi = prmt(wa[o], wb[o], 0x7632u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      h[k] = ((lo >> (4 * k)) & 0x000f000fu) | kMagic;
      h[4 + k] = ((hi >> (4 * k)) & 0x000f000fu) | kMagic;
    }
  } else if constexpr (b == 2) {
    const uint32_t q = bits_at(wa, 16 * o, 16) | (bits_at(wb, 16 * o, 16) << 16);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = ((q >> (2 * k)) & 0x00030003u) | kMagic;
  } else {  // 3 bits
    const uint32_t ua = bits_at(wa, 24 * o, 24), ub = bits_at(wb, 24 * o, 24);
    const uint32_t lo = (ua & 0xfffu) | ((ub & 0xfffu) << 16);
    const uint32_t hi = (ua >> 12) | ((ub >> 12) << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      h[k] = ((lo >> (3 * k)) & 0x00070007u) | kMagic;
      h[4 + k] = ((hi >> (3 * k)) & 0x00070007u) | kMagic;
    }
  }
}

// Codes -> values, both packed fp16: INT (code - off) * s + z; fp8 code * s; nuq
// level[code] * s + z with `lut` the codebook as fp16 bits. `off2` is fp16 (1024 + offset)
// in both halves (see kMagic), s2 / z2 the packed scale / zero.
template <int K>
KVQ_DEV uint32_t dequant2(uint32_t h, uint32_t off2, uint32_t s2, uint32_t z2,
                          const uint16_t* lut) {
  if constexpr (KindT<K>::raw16) return h;
  else if constexpr (KindT<K>::fp8) return hmul2(h, s2);
  else if constexpr (KindT<K>::nuq)  // the codes are the low bits of each (1024 + code)
    return hfma2(h2_pack(lut[h & 0xfu], lut[(h >> 16) & 0xfu]), s2, z2);
  else return hfma2(hsub2(h, off2), s2, z2);
}

// fp16 bits of a float scale (saturating, like stored scales); for e4m3 codes (which the
// unpacking leaves scaled by 2^-8) the factor 256 is folded in.
KVQ_DEV uint16_t scale_half(float s, int kind) {
  if (kind == KIND_E4M3) s *= 256.0f;
  const uint32_t w = pack2<false>(fminf(fmaxf(s, -65504.0f), 65504.0f), 0.0f);
  return (uint16_t)(w & 0xffffu);
}
// Same for a stored fp16 scale.
KVQ_DEV uint16_t stored_scale_half(uint16_t s, int kind) {
  return kind == KIND_E4M3 ? scale_half(h2f(s), kind) : s;
}

}  // namespace kvq_cuda
