// Quantize-and-write of new K/V tokens into their slots (vllm_kvq.write_cache on CUDA).
//
// Rules are those of kvq_numeric.h, applied with the same float operations as the CPU
// kernels, so planes are byte-identical to the PyTorch reference (IEEE division, no
// fast-math: see setup.py).
//  * write_rows_kernel: one warp per (token, kv head), for every side whose scale is per
//    token, per channel group of a token, or static. Lane i owns channels 8i..8i+7, so a
//    lane's codes are whole bytes (b bits x 8) and scale groups are aligned lane groups.
//  * write_channel_kernel: one CTA per (slot-group start, kv head, side) for per-channel
//    sides (scale per channel over G tokens): G consecutive entries with aligned,
//    consecutive slots. Entries that break that rule are skipped and flagged.
//  * outlier slots (Codec.outliers): a token's n finite values of largest |x| (kvq::
//    select_outliers, ties to the lower channel) are left out of the dense scale statistics;
//    each slot stores its channel and the fp16 correction x - (the dense decode there).
//  * the attention sink (sides with sink > 0): write_rows_kernel also stores a token among
//    its block's first `sink` as an int8 row, for every side (per-channel ones included).
#pragma once
#include "kvq_cuda_common.cuh"

namespace kvq_cuda {

KVQ_DEV uint16_t f32_to_f16_bits(float x) {  // like torch's float -> half
#if defined(KVQ_CUDA_EMULATE)
  return host_f32_to_f16_rn(x);
#else
  if (x != x) return (uint16_t)(((kvq::float_bits(x) >> 16) & 0x8000u) | 0x7e00u);
  return (uint16_t)(pack2<false>(x, 0.0f) & 0xffffu);
#endif
}

KVQ_DEV float side_static_scale(const Side& sd, int h) {
  return sd.sscale[sd.sscale_n == 1 ? 0 : h];
}

// Reductions over the aligned group of `width` lanes (power of two) holding one scale group.
KVQ_DEV float group_max(float v, int width) {
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
    if (m < width) v = fmaxf(v, shfl_xor(v, m));
  return v;
}
KVQ_DEV float group_min(float v, int width) {
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
    if (m < width) v = fminf(v, shfl_xor(v, m));
  return v;
}

KVQ_DEV void store_bytes(uint8_t* dst, uint64_t v, int nbytes) {
  for (int i = 0; i < nbytes; ++i) dst[i] = (uint8_t)(v >> (8 * i));
}

// kvq::select_outliers over a warp whose lane i holds channels 8i..8i+7 in x (mine: the
// lane has channels): the n finite values of largest |x|, equal |x| the lower channel
// first. chans[0..filled) (warp-uniform); returns filled.
KVQ_DEV int warp_select_outliers(const float (&x)[8], bool mine, int lane, int n, int* chans) {
  uint32_t taken = 0;  // bit k: this lane's channel 8 * lane + k is taken
  int filled = 0;
  for (int j = 0; j < n; ++j) {
    float ba = -1.0f;
    int bd = 1 << 30;
    if (mine) {
      for (int k = 0; k < 8; ++k) {
        const float a = fabsf(x[k]);
        if (!(a <= 3.4028234663852886e38f) || (taken >> k & 1u)) continue;  // NaN / Inf, taken
        if (a > ba) { ba = a; bd = lane * 8 + k; }
      }
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
      const float oa = shfl_xor(ba, m);
      const int od = shfl_xor(bd, m);
      if (oa > ba || (oa == ba && od < bd)) { ba = oa; bd = od; }
    }
    if (ba < 0.0f) break;  // no finite value left (warp-uniform)
    if (bd / 8 == lane) taken |= 1u << (bd % 8);
    chans[filled++] = bd;
  }
  return filled;
}

KVQ_DEV bool is_outlier(const int* chans, int n, int ch) {
  for (int j = 0; j < n; ++j)
    if (chans[j] == ch) return true;
  return false;
}

// One value's code (INT, nuq with the codebook's midpoints, or fp8) under its group's qp.
KVQ_DEV uint32_t quantize_code(const Side& sd, float x, const kvq::QParams& qp, const float* mids) {
  if (sd.encoding == kvq::ENC_NUQ) return kvq::quantize_nuq(x, qp, mids, 1 << sd.bits);
  if (sd.encoding == kvq::ENC_INT) return kvq::quantize_int(x, qp, sd.bits, sd.symmetric != 0);
  return kvq::quantize_fp8(x, qp.scale, sd.encoding);
}

KVQ_DEV void store_outlier(uint8_t* slot, int ch, float corr) {
  const uint16_t c = ch < 0 ? kvq::kNoOutlier : (uint16_t)ch;
  const uint16_t v = ch < 0 ? 0 : kvq::float_to_fp16_sat(corr);
  slot[0] = (uint8_t)c; slot[1] = (uint8_t)(c >> 8);
  slot[2] = (uint8_t)v; slot[3] = (uint8_t)(v >> 8);
}

// The attention sink's row of a token at block offset off < sink: int8 codes round(x * (1 /
// s)) (half to even, clamped to +-127) and the float32 scale s = max|x| / 127 (1 for an
// all-zero row; a non-finite max stores codes 0 and the scale as it is),
// vllm_kvq.residual.quantize_window_rows. Lane i holds channels 8i..8i+7 in x; the max is
// taken on the bits with the sign cleared, so NaN wins as in torch.
KVQ_DEV void write_sink_row(const Side& sd, uint8_t* plane, int off, int D, const float (&x)[8],
                            bool mine, int lane) {
  uint32_t amax = 0u;
  for (int k = 0; k < 8; ++k) {
    const uint32_t u = kvq::float_bits(x[k]) & 0x7fffffffu;
    amax = u > amax ? u : amax;
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const uint32_t o = shfl_xor(amax, m);
    amax = o > amax ? o : amax;
  }
  float s = kvq::bits_float(amax) / 127.0f;
  if (s == 0.0f) s = 1.0f;
  const bool finite = s - s == 0.0f;
  const float inv = 1.0f / s;
  uint8_t* row = plane + sd.sink_off + (int64_t)off * kvq::int8_row_bytes(D);
  if (mine) {
    for (int k = 0; k < 8; ++k) {
      const float c = finite ? fminf(fmaxf(rintf(x[k] * inv), -127.0f), 127.0f) : 0.0f;
      row[lane * 8 + k] = (uint8_t)(int8_t)c;
    }
  }
  // a NaN scale is stored as torch's amax gives it (0x7fc00000), whatever NaN came in
  if (lane == 0) *reinterpret_cast<float*>(row + D) = s == s ? s : kvq::bits_float(0x7fc00000u);
}

// One side of one (token, head): the warp's lanes hold 8 channels each in x[]; ochans[0..
// nout): its outlier channels (left out of the statistics; their slots written last).
KVQ_DEV void write_side_rows(const Side& sd, uint8_t* plane, int off, int h,
                             const float (&x)[8], bool mine, int lane, const int* ochans,
                             int nout) {
  const int b = sd.bits;
  uint8_t* row = plane + sd.data_off + (int64_t)off * sd.row_bytes;
  if (sd.encoding == kvq::ENC_FP16 || sd.encoding == kvq::ENC_BF16) {
    if (mine) {
      uint8_t* dst = row + lane * 16;
      for (int k = 0; k < 8; ++k) {
        const uint16_t v = sd.encoding == kvq::ENC_FP16 ? f32_to_f16_bits(x[k])
                                                        : kvq::float_to_bf16(x[k]);
        dst[2 * k] = (uint8_t)v;
        dst[2 * k + 1] = (uint8_t)(v >> 8);
      }
    }
    return;
  }
  // Scale group statistics over finite values (non-finite values never widen a range).
  const int width = sd.gran == kvq::GRAN_GROUP ? sd.group / 8 : 32;
  float lo = INFINITY, hi = -INFINITY, amax = 0.0f;
  if (mine) {
    for (int k = 0; k < 8; ++k) {
      const float v = x[k];
      if (v - v == 0.0f && !is_outlier(ochans, nout, lane * 8 + k)) {  // finite, dense
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
        amax = fmaxf(amax, fabsf(v));
      }
    }
  }
  const bool dynamic = sd.gran == kvq::GRAN_TOKEN || sd.gran == kvq::GRAN_GROUP;
  if (dynamic) {  // warp-uniform: every lane takes part in the shuffles
    lo = group_min(lo, width);
    hi = group_max(hi, width);
    amax = group_max(amax, width);
  }
  kvq::QParams qp;
  if (dynamic) {  // lo <= hi: the group had a finite (dense) value
    qp = kvq::group_params(sd.encoding, b, sd.symmetric != 0, lo, hi, amax, lo <= hi);
  } else {
    qp.scale = side_static_scale(sd, h);
    qp.zero = 0.0f;
  }
  float mids[kvq::kMaxNuqLevels];
  if (sd.encoding == kvq::ENC_NUQ) kvq::nuq_midpoints(sd.levels, 1 << b, mids);
  uint64_t packed = 0;
  for (int k = 0; k < 8; ++k) packed |= (uint64_t)quantize_code(sd, x[k], qp, mids) << (b * k);
  const float scale = qp.scale, zero = qp.zero;
  if (sd.outliers) {  // the slots: channel and x - (its dense decode), then empty ones
    uint8_t* slots = plane + sd.outlier_off + (int64_t)off * sd.outliers * 4;
    for (int j = 0; j < sd.outliers; ++j) {
      const int ch = j < nout ? ochans[j] : -1;
      if (ch < 0 ? lane == 0 : ch / 8 == lane) {
        const int k = ch < 0 ? 0 : ch % 8;
        const uint32_t code = (uint32_t)(packed >> (b * k)) & ((1u << b) - 1u);
        store_outlier(slots + 4 * j, ch, x[k] - dense_value(sd, code, scale, zero));
      }
    }
  }
  if (!mine) return;
  store_bytes(row + lane * b, packed, b);
  if (dynamic) {
    const int gl = sd.gran == kvq::GRAN_GROUP ? sd.group / 8 : 32;
    if ((lane & (gl - 1)) == 0) {  // first lane of its scale group
      const int col = sd.gran == kvq::GRAN_GROUP ? (lane * 8) / sd.group : 0;
      const int idx = off * sd.scale_cols + col;
      const uint16_t s16 = kvq::float_to_fp16_sat(scale);
      plane[sd.scale_off + 2 * idx] = (uint8_t)s16;
      plane[sd.scale_off + 2 * idx + 1] = (uint8_t)(s16 >> 8);
      if (sd.has_zero) {
        const uint16_t z16 = kvq::float_to_fp16_sat(zero);
        plane[sd.zero_off + 2 * idx] = (uint8_t)z16;
        plane[sd.zero_off + 2 * idx + 1] = (uint8_t)(z16 >> 8);
      }
    }
  }
}

__global__ void __launch_bounds__(128) write_rows_kernel(WriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t item = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  if (item >= (int64_t)p.N * p.H) return;  // warp-uniform; no block barrier in this kernel
  const int i = (int)(item / p.H), h = (int)(item % p.H);
  const int64_t slot = load_slot(p, i);
  if (slot < 0) return;
  if (slot >= p.num_blocks * p.B) {
    if (p.error_flag && lane == 0) *p.error_flag = 1;
    return;
  }
  const int64_t blk = slot / p.B;
  const int off = (int)(slot % p.B);
  uint8_t* plane = p.cache + (blk * p.H + h) * p.plane_bytes;
  const bool mine = lane * 8 < p.D;
  for (int side = 0; side < 2; ++side) {
    const Side& sd = p.side[side];
    const bool sink = off < sd.sink;  // warp-uniform, like the granularity
    if (sd.gran == kvq::GRAN_CHANNEL && !sink) continue;
    const void* src = side ? p.value : p.key;
    const int64_t base = side ? (int64_t)i * p.v_sn + (int64_t)h * p.v_sh
                              : (int64_t)i * p.k_sn + (int64_t)h * p.k_sh;
    float x[8];
    for (int k = 0; k < 8; ++k) x[k] = mine ? load_act(src, base + lane * 8 + k, p.in_dtype) : 0.0f;
    if (sink) write_sink_row(sd, plane, off, p.D, x, mine, lane);
    if (sd.gran == kvq::GRAN_CHANNEL) continue;  // write_channel_kernel's
    int ochans[kMaxOutliers];
    const int nout = sd.outliers ? warp_select_outliers(x, mine, lane, sd.outliers, ochans) : 0;
    write_side_rows(sd, plane, off, h, x, mine, lane, ochans, nout);
  }
}


constexpr int kMaxChannelGroup = 128;
constexpr int kMaxHeadDim = 256;

__global__ void __launch_bounds__(128) write_channel_kernel(WriteParams p) {
  const int i = blockIdx.x, h = blockIdx.y, side = blockIdx.z;
  const Side& sd = p.side[side];
  if (sd.gran != kvq::GRAN_CHANNEL) return;
  const int G = sd.group;
  const int64_t slot = load_slot(p, i);
  if (slot < 0) return;
  if (slot % G) {  // inside a group: it must be covered by the group that starts G-aligned
    const int r = (int)(slot % G);
    if (p.error_flag && threadIdx.x == 0 && h == 0 && (i < r || load_slot(p, i - r) != slot - r))
      *p.error_flag = 1;
    return;
  }
  __shared__ int bad;
  __shared__ uint8_t codes[kMaxChannelGroup][kMaxHeadDim];
  __shared__ int16_t ochan[kMaxChannelGroup][kMaxOutliers];  // outlier channels per token, -1
  __shared__ float cscale[kMaxHeadDim], czero[kMaxHeadDim];   // per-channel params (slots)
  if (threadIdx.x == 0) bad = (i + G > p.N || slot + G > p.num_blocks * p.B) ? 1 : 0;
  __syncthreads();
  for (int t = 1 + threadIdx.x; t < G && !bad; t += blockDim.x)
    if (load_slot(p, i + t) != slot + t) bad = 1;
  __syncthreads();
  if (bad) {
    if (p.error_flag && threadIdx.x == 0) *p.error_flag = 1;
    return;
  }
  const int64_t blk = slot / p.B;
  const int off = (int)(slot % p.B);  // a multiple of G (B is)
  uint8_t* plane = p.cache + (blk * p.H + h) * p.plane_bytes;
  const void* src = side ? p.value : p.key;
  const int64_t sn = side ? p.v_sn : p.k_sn;
  const int64_t base = (int64_t)i * sn + (int64_t)h * (side ? p.v_sh : p.k_sh);
  const int b = sd.bits, D = p.D, n = sd.outliers;
  auto outlier_at = [&](int t, int ch) {
    for (int j = 0; j < n; ++j)
      if (ochan[t][j] == ch) return true;
    return false;
  };
  if (n) {  // each token's outliers, one warp per token
    const int lane = threadIdx.x & 31;
    for (int t = threadIdx.x >> 5; t < G; t += blockDim.x >> 5) {
      float x[8];
      const bool mine = lane * 8 < D;
      for (int k = 0; k < 8; ++k) x[k] = mine ? load_act(src, base + t * sn + lane * 8 + k, p.in_dtype) : 0.0f;
      int chans[kMaxOutliers];
      const int filled = warp_select_outliers(x, mine, lane, n, chans);
      if (lane < n) ochan[t][lane] = (int16_t)(lane < filled ? chans[lane] : -1);
    }
    __syncthreads();
  }
  for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
    float lo = INFINITY, hi = -INFINITY, amax = 0.0f;
    for (int t = 0; t < G; ++t) {
      const float v = load_act(src, base + t * sn + ch, p.in_dtype);
      if (v - v == 0.0f && !(n && outlier_at(t, ch))) {
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
        amax = fmaxf(amax, fabsf(v));
      }
    }
    const kvq::QParams qp = kvq::group_params(sd.encoding, b, sd.symmetric != 0, lo, hi, amax, lo <= hi);
    float mids[kvq::kMaxNuqLevels];
    if (sd.encoding == kvq::ENC_NUQ) kvq::nuq_midpoints(sd.levels, 1 << b, mids);
    for (int t = 0; t < G; ++t)
      codes[t][ch] = (uint8_t)quantize_code(sd, load_act(src, base + t * sn + ch, p.in_dtype), qp, mids);
    cscale[ch] = qp.scale;
    czero[ch] = qp.zero;
    const int idx = (off / G) * D + ch;
    const uint16_t s16 = kvq::float_to_fp16_sat(qp.scale);
    plane[sd.scale_off + 2 * idx] = (uint8_t)s16;
    plane[sd.scale_off + 2 * idx + 1] = (uint8_t)(s16 >> 8);
    if (sd.has_zero) {
      const uint16_t z16 = kvq::float_to_fp16_sat(qp.zero);
      plane[sd.zero_off + 2 * idx] = (uint8_t)z16;
      plane[sd.zero_off + 2 * idx + 1] = (uint8_t)(z16 >> 8);
    }
  }
  __syncthreads();
  const int octs = D / 8;
  for (int e = threadIdx.x; e < G * octs; e += blockDim.x) {
    const int t = e / octs, o = e % octs;
    uint64_t packed = 0;
    for (int k = 0; k < 8; ++k) packed |= (uint64_t)codes[t][8 * o + k] << (b * k);
    store_bytes(plane + sd.data_off + (int64_t)(off + t) * sd.row_bytes + o * b, packed, b);
  }
  for (int e = threadIdx.x; e < G * n; e += blockDim.x) {  // outlier slots
    const int t = e / n, j = e % n, ch = ochan[t][j];
    const float x = ch < 0 ? 0.0f : load_act(src, base + t * sn + ch, p.in_dtype);
    const float dense = ch < 0 ? 0.0f : dense_value(sd, codes[t][ch], cscale[ch], czero[ch]);
    store_outlier(plane + sd.outlier_off + ((int64_t)(off + t) * n + j) * 4, ch, x - dense);
  }
}

}  // namespace kvq_cuda
