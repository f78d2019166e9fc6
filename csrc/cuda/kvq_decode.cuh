// Split-KV ("flash-decoding") paged attention for sequences with one query token, reading
// quantized planes and dequantizing in registers straight into tensor-core fragments.
//
// Grid: x = page partition (max_parts of them) + 1 staging slot, y = kv head x head tile
// (up to 8 query heads of one GQA group per CTA, so K/V are read once for the group),
// z = sequence. 128 threads = 4 warps; warp w takes 16-token chunks w, w+4, ... of its
// partition. Per chunk (all 16 tokens inside one cache block):
//   S^T-free QK:  S[8 heads x 16 tokens] = Q[16(8 used) x D] * K^T, mma m16n8k16; lane
//                 (g, t) loads token g (and 8+g) of the chunk, channel quarter t (D/4
//                 channels, whole bytes for every bit width), so each K row is read by 4
//                 lanes with one vector load each. The pairs a lane holds in the B
//                 fragment are in the order its unpacking produces them; Q's A fragment
//                 is built with the same channel map (k_pair_lo/hi).
//   online softmax in fp32, log2 domain (Q is pre-scaled by softmax_scale * log2 e).
//   PV:           O^T[D x 8 heads] += V^T[D x 16 tokens] * P^T; the S accumulator of a lane
//                 is exactly the P^T B fragment it needs (no shuffles); lane (g, t) loads
//                 tokens 2t, 2t+1, 2t+8, 2t+9 of the chunk, channel slice g (D/8 channels).
// K and V values are dequantized in fp16 (bf16 for a bf16 cache): INT (code - off) * s + z
// and fp8 code * s with packed half2 math (codes via the 0x6400 magic / byte permutes).
// The 4 warps merge in shared memory; the CTA writes a normalised partial (or the final
// output when the sequence has a single partition and no staging). Staging tokens
// (residual window, positions >= floor(L/R)*R) are one more "partition", done with CUDA
// cores by the CTA at x == max_parts. reduce_kernel merges partitions by log-sum-exp.
// Attention sink (p.sink > 0): the partitions mask positions < sink and the staging CTA
// reads them from the first block's int8 sink rows instead (staging rows still win: a
// position >= F is read from staging).
#pragma once
#include "kvq_cuda_common.cuh"

namespace kvq_cuda {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeHeads = 8;  // query heads per decode CTA (n = 8 of the mma)
constexpr int kChunk = 16;       // tokens per warp step

// Keys [0, F) come from the pages, split into nparts partitions of pt keys (a multiple of
// 64, at least min_part_tokens, so that the longest sequences use all max_parts); keys
// [F, L) from the staging tensors.
struct SeqSplit {
  int L, F, pt, nparts;
  int nsink;  // positions [0, nsink) from the sink rows: min(sink, F)
  KVQ_DEV bool staged() const { return F < L || nsink > 0; }  // the staging CTA has work
};
KVQ_DEV SeqSplit seq_split(const AttnParams& p, int s) {
  SeqSplit r;
  r.L = p.seq_lens[s];
  r.F = r.L / p.R * p.R;
  const int even = ((r.F + p.max_parts - 1) / p.max_parts + 63) / 64 * 64;
  r.pt = even > p.min_part_tokens ? even : p.min_part_tokens;
  r.nparts = (r.F + r.pt - 1) / r.pt;
  r.nsink = p.sink < r.F ? p.sink : r.F;
  return r;
}
KVQ_DEV int64_t part_index(const AttnParams& p, int s, int hq, int slot) {
  return ((int64_t)s * p.Hq + hq) * (p.max_parts + 1) + slot;
}

// Staging keys of a decode sequence (at most R-1 of them) and the sink's positions, CUDA
// cores: warp w takes heads w, w+4 of the tile; lanes split the channels.
template <int D>
KVQ_DEV void decode_staging(const AttnParams& p, int s, int h, int g0, int ng, const SeqSplit& sp) {
  constexpr int CPL = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q0 = p.qsl[s];
  const int st0 = p.R > 1 ? p.ssl[s] : 0, pos0 = p.R > 1 ? p.spos0[s] : sp.L;
  const uint8_t* plane0 = sp.nsink ? p.cache + ((int64_t)p.block_table[(int64_t)s * p.bt_stride] * p.H + h) *
                                             p.plane_bytes : nullptr;
  for (int hh = warp; hh < ng; hh += kDecodeWarps) {
    const int hq = h * p.G + g0 + hh;
    float qv[CPL], o[CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      qv[i] = load_act(p.q, q0 * p.q_st + hq * p.q_sh + lane + 32 * i, p.q_dtype) * p.scale_log2;
      o[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int j0 = sp.F > pos0 ? sp.F : pos0;
    // positions [0, nsink) from the sink rows, then [j0, L) from staging
    for (int j = sp.nsink > 0 ? 0 : j0; j < sp.L; j = j + 1 == sp.nsink ? j0 : j + 1) {
      const bool sink = j < sp.nsink;
      const int64_t row = st0 + (j - pos0);
      const int64_t kb = row * p.sk_sn + (int64_t)h * p.sk_sh, vb = row * p.sv_sn + (int64_t)h * p.sv_sh;
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        dot += qv[i] * (sink ? sink_value(p.side[0], plane0, j, lane + 32 * i, D)
                             : load_act(p.sk, kb + lane + 32 * i, p.q_dtype));
#pragma unroll
      for (int mm = 16; mm >= 1; mm >>= 1) dot += shfl_xor(dot, mm);
      dot = soft_cap(dot, p.softcap_log2);
      const float mn = fmaxf(m, dot);
      const float alpha = fast_exp2(m - mn), pe = fast_exp2(dot - mn);
      l = l * alpha + pe;
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        o[i] = o[i] * alpha + pe * (sink ? sink_value(p.side[1], plane0, j, lane + 32 * i, D)
                                         : load_act(p.sv, vb + lane + 32 * i, p.q_dtype));
      m = mn;
    }
    const int64_t pi = part_index(p, s, hq, p.max_parts);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) p.part_o[pi * D + lane + 32 * i] = o[i] * inv;
    if (lane == 0) {
      p.part_ml[2 * pi] = m;
      p.part_ml[2 * pi + 1] = l;
    }
  }
}

// Register budget per head size (min CTAs per SM for ptxas): D=64 kernels need ~100-128.
template <int D>
constexpr int decode_min_ctas() { return D <= 64 ? 4 : 1; }

template <int D, int KK, int VK>
__global__ void __launch_bounds__(128, decode_min_ctas<D>()) decode_kernel(AttnParams p) {
  using KT = KindT<KK>;
  using VT = KindT<VK>;
  constexpr bool KBF = KT::bf, VBF = VT::bf;
  // K: lane quarter = QC channels = NSEG segments of 16; bytes and alignment of a load.
  constexpr int QC = D / 4, NSEG = QC / 16, NKC = D / 16;
  constexpr int KRB = D * KT::bits / 8, KQB = QC * KT::bits / 8, KQW = (KQB + 3) / 4;
  constexpr int KALIGN = cmin(16, cmin(pow2_part(KRB), pow2_part(KQB)));
  // V: lane slice = VC channels = NOCT octets; NMT m-tiles of 16 channels over the CTA.
  constexpr int VC = D / 8, NOCT = VC / 8, NMT = D / 16;
  constexpr int VRB = D * VT::bits / 8, VSB = VC * VT::bits / 8, VSW = (VSB + 3) / 4;
  constexpr int VALIGN = cmin(16, cmin(pow2_part(VRB), pow2_part(VSB)));
  static_assert(D % 64 == 0, "decode kernel: head size must be a multiple of 64");

  __shared__ float sm_o[kDecodeWarps][kDecodeHeads][D];
  __shared__ float sm_m[kDecodeWarps][kDecodeHeads], sm_l[kDecodeWarps][kDecodeHeads];
  __shared__ uint16_t sm_lut[2][kvq::kMaxNuqLevels];  // nuq codebooks (K, V) as fp16 bits

  const int part = blockIdx.x, s = blockIdx.z;
  const int h = blockIdx.y / p.dec_head_tiles;
  const int g0 = (blockIdx.y % p.dec_head_tiles) * kDecodeHeads;
  const int ng = p.G - g0 < kDecodeHeads ? p.G - g0 : kDecodeHeads;
  const int q0 = p.qsl[s];
  if (p.qsl[s + 1] - q0 != 1) return;  // CTA-uniform exits only (no barrier passed yet)
  const SeqSplit sp = seq_split(p, s);
  if (part == p.max_parts) {
    if (sp.staged()) decode_staging<D>(p, s, h, g0, ng, sp);
    return;
  }
  if (part >= sp.nparts) return;
  const int ka = part * sp.pt;
  const int kb = ka + sp.pt < sp.F ? ka + sp.pt : sp.F;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;  // mma group / thread-in-group
  const Side& ks = p.side[0];
  const Side& vs = p.side[1];
  if constexpr (KT::nuq || VT::nuq) {  // every CTA that gets here takes this barrier
    if (threadIdx.x < 2 * kvq::kMaxNuqLevels) {
      const int side = threadIdx.x / kvq::kMaxNuqLevels, i = threadIdx.x % kvq::kMaxNuqLevels;
      const Side& sd = side ? vs : ks;
      const bool nuq = side ? VT::nuq : KT::nuq;
      sm_lut[side][i] = nuq && i < (1 << sd.bits) ? (uint16_t)(pack2<false>(sd.levels[i], 0.0f) & 0xffffu) : 0;
    }
    __syncthreads();
  }

  // Q fragments (row r = query head g0 + r; rows 8..15 of the A operand are zero).
  uint32_t qa[NKC][2];
  {
    const bool rv = r < ng;
    const int64_t qb = (int64_t)q0 * p.q_st + (int64_t)(h * p.G + g0 + (rv ? r : 0)) * p.q_sh;
#pragma unroll
    for (int kc = 0; kc < NKC; ++kc) {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int P = 2 * kc + jj, seg = P / 8, pp = P % 8;
        const int base = c * QC + seg * 16;
        const float lo = rv ? load_act(p.q, qb + base + k_pair_lo<KK>(pp), p.q_dtype) * p.scale_log2 : 0.0f;
        const float hi = rv ? load_act(p.q, qb + base + k_pair_hi<KK>(pp), p.q_dtype) * p.scale_log2 : 0.0f;
        qa[kc][jj] = pack2<KBF>(lo, hi);
      }
    }
  }
  // Per-side constants.
  const uint32_t koff2 = h2_bcast((uint16_t)(0x6400 + (ks.symmetric ? 1 << (KT::bits - 1) : 0)));
  const uint32_t voff2 = h2_bcast((uint16_t)(0x6400 + (vs.symmetric ? 1 << (VT::bits - 1) : 0)));
  const uint32_t kstat = ks.static_scale ? h2_bcast(scale_half(ks.sscale[ks.sscale_n == 1 ? 0 : h], KK)) : 0u;
  const uint32_t vstat = vs.static_scale ? h2_bcast(scale_half(vs.sscale[vs.sscale_n == 1 ? 0 : h], VK)) : 0u;
  const bool kchan = ks.gran == kvq::GRAN_CHANNEL, vchan = vs.gran == kvq::GRAN_CHANNEL;

  float o_acc[NMT][4];
#pragma unroll
  for (int mt = 0; mt < NMT; ++mt) o_acc[mt][0] = o_acc[mt][1] = o_acc[mt][2] = o_acc[mt][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;

  // Raw codes of a chunk: K rows off+r, off+8+r (quarter c); V rows off+2c, +1, +8, +9
  // (slice r). The next chunk's are loaded before the current one is used (registers
  // double buffer) and its scale lines are prefetched into L1.
  constexpr int kStep = kDecodeWarps * kChunk;
  // Double-buffer only when the raw codes are few registers (low-bit kinds): for 16-bit
  // and D = 256 kinds one chunk is already many bytes in flight, and a second copy spills.
  constexpr int kRawWords = 2 * KQW + 4 * VSW;
  constexpr bool kPrefetch = kRawWords <= 32 && (D <= 128 || kRawWords <= 16);
  uint32_t kw[2][KQW], vw[4][VSW];
  const uint8_t* plane = nullptr;
  // V codes of a wide kind (16-bit, D = 256) are loaded only after QK: K's are dead then.
  constexpr bool kLateV = D >= 256 && kRawWords >= 64;
  auto load_v = [&](const uint8_t* pl, int o, uint32_t (&vq)[4][VSW]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = o + 2 * c + (i & 1) + 8 * (i >> 1);
      load_bytes<VSB, VALIGN>(pl + vs.data_off + tok * VRB + r * VSB, vq[i]);
    }
  };
  auto load_chunk = [&](int jj, uint32_t (&kq)[2][KQW], uint32_t (&vq)[4][VSW]) -> const uint8_t* {
    const int blk = p.block_table[(int64_t)s * p.bt_stride + jj / p.B];
    const int o = jj % p.B;
    const uint8_t* pl = p.cache + ((int64_t)blk * p.H + h) * p.plane_bytes;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
      load_bytes<KQB, KALIGN>(pl + ks.data_off + (o + 8 * tile + r) * KRB + c * KQB, kq[tile]);
    if constexpr (!kLateV) load_v(pl, o, vq);
    if constexpr (!KT::raw16 || !VT::raw16) {  // scale / zero lines of this chunk
      const Side& sd = (lane & 16) ? vs : ks;
      if (!sd.static_scale && sd.scale_cols) {
        const int row = sd.gran == kvq::GRAN_CHANNEL ? (o / sd.group) * D : o * sd.scale_cols;
        const int field = (lane & 8) && sd.has_zero ? sd.zero_off : sd.scale_off;
        const int span = sd.gran == kvq::GRAN_CHANNEL ? D : kChunk * sd.scale_cols;
        const int at = 2 * (row + (span * (lane & 7)) / 8);
        prefetch_l1(pl + field + at);
      }
    }
    return pl;
  };
  if (kPrefetch && ka + warp * kChunk < kb) plane = load_chunk(ka + warp * kChunk, kw, vw);

  for (int j0 = ka + warp * kChunk; j0 < kb; j0 += kStep) {
    const int off = j0 % p.B;
    uint32_t kw_n[2][KQW], vw_n[4][VSW];
    const uint8_t* plane_n = nullptr;
    if constexpr (kPrefetch) {
      if (j0 + kStep < kb) plane_n = load_chunk(j0 + kStep, kw_n, vw_n);
    } else {
      plane = load_chunk(j0, kw, vw);
    }

    // ---- S = Q K^T for tokens 8*tile + n
    float sacc[2][4];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) sacc[tile][0] = sacc[tile][1] = sacc[tile][2] = sacc[tile][3] = 0.0f;
#pragma unroll
    for (int seg = 0; seg < NSEG; ++seg) {
      uint32_t cs[8], cz[8];  // per-channel (KIVI) scale / zero pairs of this segment
      if constexpr (KT::is_int) {
        if (kchan) {
          const int base = ((off + r) / ks.group) * D + c * QC + seg * 16;
          uint32_t sw[8], zw[8];
          load_bytes<32, 16>(plane + ks.scale_off + 2 * base, sw);
          if (ks.has_zero) load_bytes<32, 16>(plane + ks.zero_off + 2 * base, zw);
          else {
#pragma unroll
            for (int i = 0; i < 8; ++i) zw[i] = 0u;
          }
#pragma unroll
          for (int pp = 0; pp < 8; ++pp) {
            const int lo = k_pair_lo<KK>(pp), hi = k_pair_hi<KK>(pp);
            const uint32_t sel = (uint32_t)(2 * (lo & 1)) | (uint32_t)(2 * (lo & 1) + 1) << 4 |
                                 (uint32_t)(4 + 2 * (hi & 1)) << 8 | (uint32_t)(5 + 2 * (hi & 1)) << 12;
            cs[pp] = prmt(sw[lo / 2], sw[hi / 2], sel);
            cz[pp] = prmt(zw[lo / 2], zw[hi / 2], sel);
          }
        }
      }
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        uint32_t hv[8];
        k_seg_codes<KK>(kw[tile], seg, hv);
        if constexpr (!KT::raw16) {
          uint32_t s2 = kstat, z2 = 0u;
          if (!ks.static_scale && !(KT::is_int && kchan)) {
            const int tr = off + 8 * tile + r;
            const int idx = tr * ks.scale_cols + ((c * QC + seg * 16) >> ks.gshift);
            s2 = h2_bcast(stored_scale_half(ld_u16(plane + ks.scale_off + 2 * idx), KK));
            if (ks.has_zero) z2 = h2_bcast(ld_u16(plane + ks.zero_off + 2 * idx));
          }
#pragma unroll
          for (int pp = 0; pp < 8; ++pp) {
            const bool ch = KT::is_int && kchan;
            hv[pp] = dequant2<KK>(hv[pp], koff2, ch ? cs[pp] : s2, ch ? cz[pp] : z2, sm_lut[0]);
          }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int kc = seg * 4 + kk;
          mma16816<KBF>(sacc[tile], qa[kc][0], 0u, qa[kc][1], 0u, hv[2 * kk], hv[2 * kk + 1]);
        }
      }
    }

    // ---- online softmax over this chunk (row r = head r, lanes c hold tokens 2c.., 8+2c..)
    float sc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = j0 + 8 * (i >> 1) + 2 * c + (i & 1);
      const float v = soft_cap(sacc[i >> 1][i & 1], p.softcap_log2);
      sc[i] = tok < kb && tok >= sp.nsink ? v : -INFINITY;
    }
    float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
    mx = fmaxf(mx, shfl_xor(mx, 1));
    mx = fmaxf(mx, shfl_xor(mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = fast_exp2(m_run - m_use);  // 0 while m_run is -inf
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(sc[i] - m_use);
    l_run = l_run * alpha + (pr[0] + pr[1]) + (pr[2] + pr[3]);
    m_run = m_new;
    const float alpha_a = shfl(alpha, 8 * c), alpha_b = shfl(alpha, 8 * c + 4);  // heads 2c, 2c+1
#pragma unroll
    for (int mt = 0; mt < NMT; ++mt) {
      o_acc[mt][0] *= alpha_a; o_acc[mt][1] *= alpha_b;
      o_acc[mt][2] *= alpha_a; o_acc[mt][3] *= alpha_b;
    }
    const uint32_t pb0 = pack2<VBF>(pr[0], pr[1]), pb1 = pack2<VBF>(pr[2], pr[3]);

    // ---- O^T += V^T P^T
    if constexpr (kLateV) load_v(plane, off, vw);
    bool tv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = j0 + 2 * c + (i & 1) + 8 * (i >> 1);
      tv[i] = tok < kb && tok >= sp.nsink;
    }
#pragma unroll
    for (int o = 0; o < NOCT; ++o) {
      uint32_t vv[2][8];
#pragma unroll
      for (int tp = 0; tp < 2; ++tp) {
        v_oct_codes<VK>(vw[2 * tp], vw[2 * tp + 1], o, vv[tp]);
        const uint32_t mask = (tv[2 * tp] ? 0x0000ffffu : 0u) | (tv[2 * tp + 1] ? 0xffff0000u : 0u);
        if constexpr (VT::raw16) {
#pragma unroll
          for (int k = 0; k < 8; ++k) vv[tp][k] &= mask;
        } else {
          const int ta = off + 8 * tp + 2 * c;
          const int cb = r * VC + 8 * o;
          if (VT::is_int && vchan) {
            const int base = (ta / vs.group) * D + cb;
            uint32_t sw[4], zw[4] = {0u, 0u, 0u, 0u};
            load_bytes<16, 16>(plane + vs.scale_off + 2 * base, sw);
            if (vs.has_zero) load_bytes<16, 16>(plane + vs.zero_off + 2 * base, zw);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const uint32_t sel = (k & 1) ? 0x3232u : 0x1010u;
              vv[tp][k] = dequant2<VK>(vv[tp][k], voff2, prmt(sw[k / 2], 0u, sel),
                                       prmt(zw[k / 2], 0u, sel), sm_lut[1]) & mask;
            }
          } else {
            uint32_t s2 = vstat, z2 = 0u;
            if (!vs.static_scale) {
              const int col = cb >> vs.gshift;
              const int ia = ta * vs.scale_cols + col, ib = (ta + 1) * vs.scale_cols + col;
              s2 = h2_pack(stored_scale_half(ld_u16(plane + vs.scale_off + 2 * ia), VK),
                           stored_scale_half(ld_u16(plane + vs.scale_off + 2 * ib), VK));
              if (vs.has_zero)
                z2 = h2_pack(ld_u16(plane + vs.zero_off + 2 * ia), ld_u16(plane + vs.zero_off + 2 * ib));
            }
#pragma unroll
            for (int k = 0; k < 8; ++k)
              vv[tp][k] = dequant2<VK>(vv[tp][k], voff2, s2, z2, sm_lut[1]) & mask;
          }
        }
      }
#pragma unroll
      for (int kq = 0; kq < 4; ++kq)
        mma16816<VBF>(o_acc[4 * o + kq], vv[0][2 * kq], vv[0][2 * kq + 1], vv[1][2 * kq],
                      vv[1][2 * kq + 1], pb0, pb1);
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int tile = 0; tile < 2; ++tile)
#pragma unroll
        for (int i = 0; i < KQW; ++i) kw[tile][i] = kw_n[tile][i];
#pragma unroll
      for (int t4 = 0; t4 < 4; ++t4)
#pragma unroll
        for (int i = 0; i < VSW; ++i) vw[t4][i] = vw_n[t4][i];
      plane = plane_n;
    }
  }

  // ---- merge the 4 warps, normalise, write
  l_run += shfl_xor(l_run, 1);
  l_run += shfl_xor(l_run, 2);
  if (c == 0) {
    sm_m[warp][r] = m_run;
    sm_l[warp][r] = l_run;
  }
#pragma unroll
  for (int mt = 0; mt < NMT; ++mt) {
    const int ch = r * VC + 2 * mt;
    sm_o[warp][2 * c][ch] = o_acc[mt][0];
    sm_o[warp][2 * c + 1][ch] = o_acc[mt][1];
    sm_o[warp][2 * c][ch + 1] = o_acc[mt][2];
    sm_o[warp][2 * c + 1][ch + 1] = o_acc[mt][3];
  }
  __syncthreads();
  const bool direct = sp.nparts == 1 && !sp.staged();
  for (int e = threadIdx.x; e < ng * D; e += blockDim.x) {
    const int hh = e / D, ch = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, sm_m[w][hh]);
    const float Mu = M == -INFINITY ? 0.0f : M;
    float lsum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float wt = fast_exp2(sm_m[w][hh] - Mu);
      lsum += wt * sm_l[w][hh];
      acc += wt * sm_o[w][hh][ch];
    }
    const float val = lsum > 0.0f ? acc / lsum : 0.0f;
    const int hq = h * p.G + g0 + hh;
    if (direct) {
      store_act(p.out, (int64_t)q0 * p.o_st + (int64_t)hq * p.o_sh + ch, p.q_dtype, val);
    } else {
      const int64_t pi = part_index(p, s, hq, part);
      p.part_o[pi * D + ch] = val;
      if (ch == 0) {
        p.part_ml[2 * pi] = M;
        p.part_ml[2 * pi + 1] = lsum;
      }
    }
  }
}

// Merge the partitions of every decode sequence: grid (S, Hq), 128 threads.
constexpr int kMaxParts = 1024;
__global__ void __launch_bounds__(128) reduce_kernel(AttnParams p) {
  __shared__ float wts[kMaxParts + 1];
  __shared__ float inv_total;
  const int s = blockIdx.x, hq = blockIdx.y;
  const int q0 = p.qsl[s];
  if (p.qsl[s + 1] - q0 != 1) return;
  const SeqSplit sp = seq_split(p, s);
  const bool stage = sp.staged();
  if (sp.nparts == 1 && !stage) return;  // written by the decode kernel
  const int nslots = sp.nparts + (stage ? 1 : 0);
  auto slot_of = [&](int i) { return i < sp.nparts ? i : p.max_parts; };
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int i = 0; i < nslots; ++i) M = fmaxf(M, p.part_ml[2 * part_index(p, s, hq, slot_of(i))]);
    const float Mu = M == -INFINITY ? 0.0f : M;
    float tot = 0.0f;
    for (int i = 0; i < nslots; ++i) {
      const int64_t pi = part_index(p, s, hq, slot_of(i));
      const float wt = fast_exp2(p.part_ml[2 * pi] - Mu) * p.part_ml[2 * pi + 1];
      wts[i] = wt;
      tot += wt;
    }
    inv_total = tot > 0.0f ? 1.0f / tot : 0.0f;
  }
  __syncthreads();
  for (int ch = threadIdx.x; ch < p.D; ch += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < nslots; ++i) acc += wts[i] * p.part_o[part_index(p, s, hq, slot_of(i)) * p.D + ch];
    store_act(p.out, (int64_t)q0 * p.o_st + (int64_t)hq * p.o_sh + ch, p.q_dtype, acc * inv_total);
  }
}

}  // namespace kvq_cuda
