// Generic paged attention on CUDA cores: prefill, chunked prefill, multi-token decode steps,
// and any (head size, codec pair) the tensor-core decode kernel does not cover.
//
// plan_kernel (1 CTA) lists the work tiles: for every sequence not taken by the decode
// kernel, ceil(n_queries / gen_queries) tiles of consecutive query tokens.
// generic_attn_kernel: grid (max_tiles, kv heads x head tiles), 128 threads = 16 rows x 8
// lanes. A row is one (query token, query head) of the tile (gen_queries x gen_heads <= 16);
// a lane owns channels j, j+8, ... Keys go through shared memory in chunks of KC: the CTA
// dequantizes the chunk (any codec, kvq_numeric.h rules) into fp32, then each row takes
// dot products (8-lane shuffles), an online softmax and the PV update in registers.
// Residual staging: pass A reads positions < F(p+1) from the pages, pass B positions in
// [F(p+1), p] from the staging tensors (per row masks), one softmax over both. A sliding
// window W starts pass A at the tile's first key and masks each row's keys <= p - W.
// Attention sink: pass A reads positions < sink from the first block's int8 sink rows.
#pragma once
#include "kvq_cuda_common.cuh"

namespace kvq_cuda {

__global__ void __launch_bounds__(256) plan_kernel(AttnParams p) {
  __shared__ int scan[256];
  __shared__ int carry;
  const int tid = threadIdx.x;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < p.S; base += 256) {
    const int s = base + tid;
    int n = 0;
    if (s < p.S) {
      const int nq = p.qsl[s + 1] - p.qsl[s];
      if (nq > 0 && !(nq == 1 && p.decode_fast)) n = (nq + p.gen_queries - 1) / p.gen_queries;
    }
    scan[tid] = n;
    __syncthreads();
    for (int o = 1; o < 256; o <<= 1) {
      const int v = tid >= o ? scan[tid - o] : 0;
      __syncthreads();
      scan[tid] += v;
      __syncthreads();
    }
    const int start = carry + scan[tid] - n;
    for (int k = 0; k < n && start + k < p.max_tiles; ++k) {
      p.tiles[1 + 2 * (start + k)] = s;
      p.tiles[2 + 2 * (start + k)] = k * p.gen_queries;
    }
    __syncthreads();
    if (tid == 255) carry += scan[255];
    __syncthreads();
  }
  if (tid == 0) p.tiles[0] = carry < p.max_tiles ? carry : p.max_tiles;
}

// One dequantized value of a paged plane (any codec): token t of the block, channel ch.
KVQ_DEV float plane_value(const Side& sd, const uint8_t* plane, int t, int ch, int D, int h) {
  const uint8_t* row = plane + sd.data_off + (int64_t)t * sd.row_bytes;
  if (sd.encoding == kvq::ENC_FP16) return h2f(ld_u16(row + 2 * ch));
  if (sd.encoding == kvq::ENC_BF16) return bf2f(ld_u16(row + 2 * ch));
  const uint32_t code = kvq::get_code(row, ch, sd.bits);
  float s, z = 0.0f;
  if (sd.static_scale) {
    s = sd.sscale[sd.sscale_n == 1 ? 0 : h];
  } else {
    int idx;
    if (sd.gran == kvq::GRAN_TOKEN) idx = t;
    else if (sd.gran == kvq::GRAN_GROUP) idx = t * sd.scale_cols + ch / sd.group;
    else idx = (t / sd.group) * D + ch;
    s = h2f(ld_u16(plane + sd.scale_off + 2 * idx));
    if (sd.has_zero) z = h2f(ld_u16(plane + sd.zero_off + 2 * idx));
  }
  if (sd.encoding == kvq::ENC_INT || sd.encoding == kvq::ENC_NUQ)
    return dense_value(sd, code, s, z) + (sd.outliers ? outlier_correction(sd, plane, t, ch) : 0.0f);
  return kvq::fp8_to_float((uint8_t)code, sd.encoding) * s;
}

template <int D>
__global__ void __launch_bounds__(128, 1) generic_attn_kernel(AttnParams p) {
  constexpr int KC = D <= 128 ? 32 : 16;  // keys per shared-memory chunk
  constexpr int CPL = D / 8;              // channels per lane
  static_assert(D % 8 == 0, "head size must be a multiple of 8");
  __shared__ float Ks[KC][D];
  __shared__ float Vs[KC][D];

  const int tile = blockIdx.x;
  if (tile >= p.tiles[0]) return;
  const int s = p.tiles[1 + 2 * tile], qt0 = p.tiles[2 + 2 * tile];
  const int h = blockIdx.y / p.gen_head_tiles;
  const int GH = p.gen_heads, g0 = (blockIdx.y % p.gen_head_tiles) * GH;
  const int rowi = threadIdx.x >> 3, j = threadIdx.x & 7;
  const int qi = rowi / GH, gi = rowi % GH;
  const int q0 = p.qsl[s], nq = p.qsl[s + 1] - q0, L = p.seq_lens[s];
  const int qlast = (qt0 + p.gen_queries < nq ? qt0 + p.gen_queries : nq) - 1;
  const int R = p.R;
  const int p_lo = L - nq + qt0, p_hi = L - nq + qlast;  // positions of the tile's queries
  const int F_lo = (p_lo + 1) / R * R, F_hi = (p_hi + 1) / R * R;
  const bool valid = rowi < p.gen_queries * GH && qt0 + qi <= qlast && g0 + gi < p.G;
  const int pos = L - nq + qt0 + qi;
  const int Fr = (pos + 1) / R * R;
  const int hq = h * p.G + g0 + (valid ? gi : 0);
  const int64_t qrow = (int64_t)(q0 + (valid ? qt0 + qi : qt0));

  float qv[CPL], o[CPL];
#pragma unroll
  for (int m = 0; m < CPL; ++m) {
    qv[m] = valid ? load_act(p.q, qrow * p.q_st + (int64_t)hq * p.q_sh + j + 8 * m, p.q_dtype) * p.scale_log2 : 0.0f;
    o[m] = 0.0f;
  }
  float m_run = -INFINITY, l_run = 0.0f;
  const Side& ks = p.side[0];
  const Side& vs = p.side[1];
  const int st0 = R > 1 ? p.ssl[s] : 0, pos0 = R > 1 ? p.spos0[s] : 0;

  for (int pass = 0; pass < 2; ++pass) {
    // pass 0: pages [0, F_hi); pass 1: staging [max(F_lo, pos0), p_hi]
    const int w_lo = p.window && p_lo - p.window + 1 > 0 ? p_lo - p.window + 1 : 0;
    const int k_begin = pass == 0 ? w_lo : (F_lo > pos0 ? F_lo : pos0);
    const int k_end = pass == 0 ? F_hi : (R > 1 ? p_hi + 1 : 0);
    for (int kb = k_begin; kb < k_end; kb += KC) {
      __syncthreads();  // the previous chunk is consumed
      for (int e = threadIdx.x; e < KC * D; e += blockDim.x) {
        const int kk = e / D, ch = e % D, jp = kb + kk;
        float kv = 0.0f, vv = 0.0f;
        if (jp < k_end) {
          if (pass == 0) {
            const int blk = p.block_table[(int64_t)s * p.bt_stride + jp / p.B];
            const uint8_t* plane = p.cache + ((int64_t)blk * p.H + h) * p.plane_bytes;
            if (jp < p.sink) {  // the first block's sink rows (jp < sink <= B)
              kv = sink_value(ks, plane, jp, ch, D);
              vv = sink_value(vs, plane, jp, ch, D);
            } else {
              kv = plane_value(ks, plane, jp % p.B, ch, D, h);
              vv = plane_value(vs, plane, jp % p.B, ch, D, h);
            }
          } else {
            const int64_t row = st0 + (jp - pos0);
            kv = load_act(p.sk, row * p.sk_sn + (int64_t)h * p.sk_sh + ch, p.q_dtype);
            vv = load_act(p.sv, row * p.sv_sn + (int64_t)h * p.sv_sh + ch, p.q_dtype);
          }
        }
        Ks[kk][ch] = kv;
        Vs[kk][ch] = vv;
      }
      __syncthreads();
      float sc[KC];
      float mx = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < KC; ++kk) {
        float part = 0.0f;
#pragma unroll
        for (int m = 0; m < CPL; ++m) part += qv[m] * Ks[kk][j + 8 * m];
        part += shfl_xor(part, 1);
        part += shfl_xor(part, 2);
        part += shfl_xor(part, 4);
        const int jp = kb + kk;
        const bool ok = valid && jp < k_end && (p.window == 0 || jp > pos - p.window) &&
                        (pass == 0 ? jp < Fr : (jp >= Fr && jp <= pos));
        sc[kk] = ok ? soft_cap(part, p.softcap_log2) : -INFINITY;
        mx = fmaxf(mx, sc[kk]);
      }
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = fast_exp2(m_run - m_use);
      l_run *= alpha;
#pragma unroll
      for (int m = 0; m < CPL; ++m) o[m] *= alpha;
#pragma unroll
      for (int kk = 0; kk < KC; ++kk) {
        const float pe = fast_exp2(sc[kk] - m_use);
        l_run += pe;
#pragma unroll
        for (int m = 0; m < CPL; ++m) o[m] += pe * Vs[kk][j + 8 * m];
      }
      m_run = m_new;
    }
  }
  if (valid) {
    const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;
#pragma unroll
    for (int m = 0; m < CPL; ++m)
      store_act(p.out, qrow * p.o_st + (int64_t)hq * p.o_sh + j + 8 * m, p.q_dtype, o[m] * inv);
  }
}

}  // namespace kvq_cuda
