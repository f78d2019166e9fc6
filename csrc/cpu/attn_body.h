// The paged-attention kernel body, compiled once per SIMD path. Included (and only
// included) by attn_avx512.cpp / attn_avx2.cpp / attn_scalar.cpp inside their own
// namespace, after they define the vector primitives:
//
//   W (lanes), VF, vzero, vset, vload, vstore, vadd, vsub, vmul, vfma(a,b,c)=a*b+c,
//   vmax(a,b) (b when either is NaN), vmin, vhmax, vhsum, vexp2,
//   vreduce(const VF a[W]) -> lane k = sum of a[k]'s lanes,
//   ld_f16 / ld_bf16 (W halves), ld_u8 (W bytes), ld_u4 (W/2 bytes), ld_u2 (W/4 bytes),
//   ld_e4m3 (W bytes, value * 2^-8), ld_e5m2 (W bytes).
//
// Algorithm (per task = one sequence, one kv head, a tile of query tokens, a range of key
// positions): the Q rows (all gq query heads of each query token, pre-scaled by
// softmax_scale*log2 e) stay in scratch; keys are visited in tiles of up to kTileTokens
// positions; an online softmax runs in the log2 domain. Two ways to consume a tile:
//  * fused (decode: one query token, gq <= W rows): K and V chunks are decoded in
//    registers (codes -> float, one fma with the chunk's scale/zero) right where the
//    Q.K and P.V FMAs need them; every row of the GQA group uses each decoded chunk, so
//    each block is read and decoded exactly once per kv head.
//  * scratch (prefill tiles, many rows): the tile's K rows are decoded once into an fp32
//    scratch, logits = Q.K^T with register blocking (MB rows x W/MB tokens, transposed
//    reduction), then V rows are decoded into the same scratch and accumulated with P.V.
// Each query row has a contiguous valid range of every tile (causal limit / residual
// staging boundary): masked entries never touch V, so a NaN in a token a query must not
// see cannot reach it. Headers are included by the translation unit before its target
// pragma.
//
// nuq codecs and codecs with outlier slots are decoded to fp32 rows when a tile is
// prepared (predecode_segment: level[code] * scale + zero through the layer's codebook, or
// code * scale + zero, then each outlier slot overwrites its channel) and consumed as the
// K_F32 kind by both paths.

constexpr int TT = kTileTokens;
constexpr int SL = kTileTokens;  // row stride of the logits tile
static_assert(SL % W == 0, "tile must be a whole number of vectors");

static inline float h2f(const uint8_t* base, int64_t idx) {
  uint16_t h;
  memcpy(&h, base + 2 * idx, 2);
  return kvq::fp16_to_float(h);
}
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline int iclamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// n fp16 values (unaligned bytes) -> floats * mul.
static inline void cvt_f16(const uint8_t* src, int n, float mul, float* dst) {
  int i = 0;
  const VF vm = vset(mul);
  for (; i + W <= n; i += W) vstore(dst + i, vmul(ld_f16((const uint16_t*)(src + 2 * i)), vm));
  for (; i < n; ++i) dst[i] = h2f(src, i) * mul;
}

// ---- a tile's K or V source: code rows + scales, decoded chunk by chunk ---------------------
enum Kind { K_F16 = 0, K_BF16, K_E4M3, K_E5M2, K_U8, K_U4, K_U2, K_F32 };
template <int KIND, bool VEC, bool PERM>
struct KT {};

struct TileSrc {
  const uint8_t* row[TT];  // codes of token t (int3: unpacked to one byte per code; K_F32:
                           // the token's D decoded floats)
  const float* sv[TT];     // VEC: D scales; else the token's scales, chunk c uses [c >> gshift]
  const float* zv[TT];
  int gshift;
};

static void unpack3(const uint8_t* row, int D, uint8_t* out) {
  for (int d = 0; d < D; d += 8) {
    const uint8_t* p = row + d / 8 * 3;
    const uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
    for (int i = 0; i < 8; ++i) out[d + i] = (uint8_t)((w >> (3 * i)) & 7u);
  }
}

template <int KIND>
static inline VF decode_codes(const uint8_t* row, int c) {
  if (KIND == K_F32) return vload((const float*)row + c * W);
  if (KIND == K_F16) return ld_f16((const uint16_t*)row + c * W);
  if (KIND == K_BF16) return ld_bf16((const uint16_t*)row + c * W);
  if (KIND == K_E4M3) return ld_e4m3(row + c * W);
  if (KIND == K_E5M2) return ld_e5m2(row + c * W);
  if (KIND == K_U8) return ld_u8(row + c * W);
  if (KIND == K_U4) return ld_u4(row + c * (W / 2));
  return ld_u2(row + c * (W / 4));
}

// Chunk c (channels c*W .. c*W+W-1) of token t, dequantized.
template <int KIND, bool VEC>
static inline VF decode(const TileSrc& ts, int t, int c) {
  const VF x = decode_codes<KIND>(ts.row[t], c);
  if (KIND == K_F16 || KIND == K_BF16 || KIND == K_F32) return x;
  if (VEC) return vfma(x, vload(ts.sv[t] + c * W), vload(ts.zv[t] + c * W));
  const int gi = c >> ts.gshift;
  if (KIND == K_E4M3 || KIND == K_E5M2) return vmul(x, vset(ts.sv[t][gi]));
  // sym: zero = -2^(b-1)*scale, so fma gives (code - 2^(b-1))*scale with one rounding
  return vfma(x, vset(ts.sv[t][gi]), vset(ts.zv[t][gi]));
}

// Buffers a tile's scales live in (per thread, inside the scratch).
struct TileBufs {
  float* s;    // TT * (D/16) per-token / per-group scales
  float* z;
  float* cs;   // 4 * D per-channel scale rows
  float* cz;
  float st[2]; // static scale and its zero
  uint8_t* u8; // TT * D unpacked int3 codes
  float* f32;  // TT * D decoded values (nuq / outlier codecs)
  float* lut;  // 16 * D: per-channel lookup tables (nuq / outlier codecs, channel scales)
};

// Whether a codec is decoded to fp32 rows when its tile is prepared (K_F32).
static inline bool predecoded(const kvq::Codec& c) {
  return c.encoding == kvq::ENC_NUQ || c.outliers > 0;
}

// Codes [d0, d1) of a row (d0, d1 multiples of 8) -> dst[d] = lut[code] (one table for
// the range) or lut[d * 16 + code] (PERCH: one 16-entry table per channel).
template <bool PERCH>
static inline void lut_row(const uint8_t* row, int bits, int d0, int d1, const float* lut,
                           float* dst) {
  auto L = [&](int d, uint32_t code) { return PERCH ? lut[d * 16 + code] : lut[code]; };
  if (bits == 4) {
    for (int d = d0; d < d1; d += 2) {
      const uint32_t b = row[d >> 1];
      dst[d] = L(d, b & 15u);
      dst[d + 1] = L(d + 1, b >> 4);
    }
  } else if (bits == 2) {
    for (int d = d0; d < d1; d += 4) {
      const uint32_t b = row[d >> 2];
      for (int i = 0; i < 4; ++i) dst[d + i] = L(d + i, (b >> (2 * i)) & 3u);
    }
  } else {  // 3 bits: 8 codes per 3 bytes
    for (int d = d0; d < d1; d += 8) {
      const uint8_t* p = row + d / 8 * 3;
      const uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
      for (int i = 0; i < 8; ++i) dst[d + i] = L(d + i, (w >> (3 * i)) & 7u);
    }
  }
}

// Rows [off, off+cnt) of a nuq or outlier codec's region -> fp32 rows of tb.f32 as tokens
// at.. of the tile: dense values as the reference computes them (value = table[code] *
// scale + zero, one rounding each: table = the codebook for nuq, code or code - 2^(b-1)
// for int; evaluated once per scale group into a small lookup table for b <= 4), then
// every outlier slot whose channel is below D replaces that channel.
static void predecode_segment(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                              int off, int cnt, int at, int D, float st, const float* levels,
                              TileBufs& tb, TileSrc& ts) {
  const int n = 1 << c.bits;
  float tab[256];
  const bool nuq = c.encoding == kvq::ENC_NUQ;
  const bool sym = !nuq && c.symmetric;
  for (int k = 0; k < n; ++k)
    tab[k] = nuq ? levels[k] : (float)(sym ? k - (n >> 1) : k);
  const bool small = c.bits <= 4;
  const uint8_t* data = plane + r.data_off;
  const bool zeros = r.zero_bytes > 0;
  float lut[16];
  int srow_loaded = -1;  // channel granularity: the scale row whose tables are in tb.lut
  for (int i = 0; i < cnt; ++i) {
    const int tok = off + i;
    const uint8_t* row = data + (int64_t)tok * r.row_bytes;
    float* dst = tb.f32 + (int64_t)(at + i) * D;
    auto dense = [&](int d0, int d1, float s, float z) {
      if (small) {
        for (int k = 0; k < n; ++k) lut[k] = tab[k] * s + z;
        lut_row<false>(row, c.bits, d0, d1, lut, dst);
      } else {
        for (int d = d0; d < d1; ++d) dst[d] = tab[row[d]] * s + z;
      }
    };
    switch (c.granularity) {
      case kvq::GRAN_TOKEN:
        dense(0, D, h2f(plane + r.scale_off, tok), zeros ? h2f(plane + r.zero_off, tok) : 0.0f);
        break;
      case kvq::GRAN_GROUP: {
        const int g = c.group, ng = D / g;
        for (int j = 0; j < ng; ++j) {
          const int64_t si = (int64_t)tok * ng + j;
          dense(j * g, (j + 1) * g, h2f(plane + r.scale_off, si),
                zeros ? h2f(plane + r.zero_off, si) : 0.0f);
        }
        break;
      }
      case kvq::GRAN_CHANNEL: {
        const int srow = tok / c.group;
        if (srow != srow_loaded) {
          cvt_f16(plane + r.scale_off + 2 * (int64_t)srow * D, D, 1.0f, tb.cs);
          if (zeros) cvt_f16(plane + r.zero_off + 2 * (int64_t)srow * D, D, 1.0f, tb.cz);
          else for (int d = 0; d < D; ++d) tb.cz[d] = 0.0f;
          if (small)
            for (int d = 0; d < D; ++d)
              for (int k = 0; k < n; ++k) tb.lut[d * 16 + k] = tab[k] * tb.cs[d] + tb.cz[d];
          srow_loaded = srow;
        }
        if (small) {
          lut_row<true>(row, c.bits, 0, D, tb.lut, dst);
        } else {
          for (int d = 0; d < D; ++d) dst[d] = tab[row[d]] * tb.cs[d] + tb.cz[d];
        }
        break;
      }
      default:  // tensor / head: static symmetric scale
        dense(0, D, st, 0.0f);
        break;
    }
    const uint8_t* o = plane + r.outlier_off + (int64_t)tok * c.outliers * 4;
    for (int j = 0; j < c.outliers; ++j) {
      uint16_t ch, v;
      memcpy(&ch, o + 4 * j, 2);
      memcpy(&v, o + 4 * j + 2, 2);
      if (ch < D) dst[ch] = kvq::fp16_to_float(v);
    }
    ts.row[at + i] = (const uint8_t*)dst;
  }
}

// Add rows [off, off+cnt) of one region of `plane` as tokens at.. of the tile.
static inline int perm_chan(int kind, int p);
static void permute_row(float* x, int D, int kind) {
  float tmp[512];
  for (int d = 0; d < D; ++d) tmp[d] = x[d];
  for (int p = 0; p < D; ++p) x[p] = tmp[perm_chan(kind, p)];
}

// perm_kind: K_U4/K_U2 when the fused path decodes this side permuted, else -1.
static void prep_segment(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                         int off, int cnt, int at, int D, float st, TileBufs& tb, int& nch_rows,
                         TileSrc& ts, int perm_kind, const float* levels) {
  if (predecoded(c)) {
    predecode_segment(c, r, plane, off, cnt, at, D, st, levels, tb, ts);
    return;
  }
  const uint8_t* data = plane + r.data_off;
  const bool e4 = c.encoding == kvq::ENC_FP8_E4M3;
  const bool is_int = c.encoding == kvq::ENC_INT;
  const float off_sym = is_int && c.symmetric ? -(float)(1 << (c.bits - 1)) : 0.0f;
  for (int i = 0; i < cnt; ++i) {
    const uint8_t* row = data + (int64_t)(off + i) * r.row_bytes;
    if (is_int && c.bits == 3) {
      uint8_t* u = tb.u8 + (int64_t)(at + i) * D;
      unpack3(row, D, u);
      row = u;
    }
    ts.row[at + i] = row;
  }
  if (c.encoding == kvq::ENC_FP16 || c.encoding == kvq::ENC_BF16) return;
  const float mul = e4 ? 256.0f : 1.0f;  // ld_e4m3 gives value * 2^-8
  switch (c.granularity) {
    case kvq::GRAN_TOKEN:
    case kvq::GRAN_GROUP: {
      const int ng = c.granularity == kvq::GRAN_TOKEN ? 1 : D / c.group;
      ts.gshift = c.granularity == kvq::GRAN_TOKEN ? 30 : __builtin_ctz(c.group / W);
      float* s = tb.s + (int64_t)at * ng;
      float* z = tb.z + (int64_t)at * ng;
      cvt_f16(plane + r.scale_off + 2 * (int64_t)off * ng, cnt * ng, mul, s);
      if (r.zero_bytes) {
        cvt_f16(plane + r.zero_off + 2 * (int64_t)off * ng, cnt * ng, 1.0f, z);
      } else {
        for (int i = 0; i < cnt * ng; ++i) z[i] = off_sym * s[i];
      }
      for (int i = 0; i < cnt; ++i) {
        ts.sv[at + i] = s + i * ng;
        ts.zv[at + i] = z + i * ng;
      }
      return;
    }
    case kvq::GRAN_CHANNEL: {
      const int G = c.group;
      for (int i = 0; i < cnt;) {
        const int srow = (off + i) / G;
        const int n = imin(cnt - i, (srow + 1) * G - (off + i));
        float* s = tb.cs + (int64_t)nch_rows * D;
        float* z = tb.cz + (int64_t)nch_rows * D;
        ++nch_rows;
        cvt_f16(plane + r.scale_off + 2 * (int64_t)srow * D, D, 1.0f, s);
        if (r.zero_bytes) cvt_f16(plane + r.zero_off + 2 * (int64_t)srow * D, D, 1.0f, z);
        else for (int d = 0; d < D; ++d) z[d] = off_sym * s[d];
        if (perm_kind >= 0) {
          permute_row(s, D, perm_kind);
          permute_row(z, D, perm_kind);
        }
        for (int k = 0; k < n; ++k) {
          ts.sv[at + i + k] = s;
          ts.zv[at + i + k] = z;
        }
        i += n;
      }
      return;
    }
    default:  // tensor / head: static scale
      tb.st[0] = st * mul;
      tb.st[1] = off_sym * st;
      ts.gshift = 30;
      for (int i = 0; i < cnt; ++i) {
        ts.sv[at + i] = &tb.st[0];
        ts.zv[at + i] = &tb.st[1];
      }
      return;
  }
}

// Calls f(KT<kind, vec, perm>{}) for the codec; perm only applies to int4/int2.
template <class F>
static inline void with_kind(const kvq::Codec& c, bool perm, F&& f) {
  const bool vec = c.granularity == kvq::GRAN_CHANNEL;
  if (predecoded(c)) { f(KT<K_F32, false, false>{}); return; }
  switch (c.encoding) {
    case kvq::ENC_FP16: f(KT<K_F16, false, false>{}); return;
    case kvq::ENC_BF16: f(KT<K_BF16, false, false>{}); return;
    case kvq::ENC_FP8_E4M3: f(KT<K_E4M3, false, false>{}); return;
    case kvq::ENC_FP8_E5M2: f(KT<K_E5M2, false, false>{}); return;
    default: break;
  }
#define KVQ_VP(K)                                          \
  if (vec) {                                               \
    if (perm) f(KT<K, true, true>{}); else f(KT<K, true, false>{});   \
  } else {                                                 \
    if (perm) f(KT<K, false, true>{}); else f(KT<K, false, false>{}); \
  }                                                        \
  return;
  switch (c.bits) {
    case 4: KVQ_VP(K_U4)
    case 2: KVQ_VP(K_U2)
    default: if (vec) f(KT<K_U8, true, false>{}); else f(KT<K_U8, false, false>{}); return;
  }
#undef KVQ_VP
}

// Permuted decode order of int4/int2 ("PERM"): 2W channels are decoded as two vectors
// straight from their bytes (int4: low nibbles, then high nibbles; int2: see ld_u2x2), so
// position p of a decoded row holds channel perm_chan(p). Dot products do not care about
// channel order: the fused path permutes Q (and the V accumulators) once per task instead.
static inline int perm_chan(int kind, int p) {
  const int sc = p / (2 * W), k = (p / W) & 1, i = p % W;
  if (kind == K_U4) return 2 * W * sc + 2 * i + k;
  return 2 * W * sc + 4 * (i % (W / 2)) + 2 * k + (i >= W / 2 ? 1 : 0);
}
// Whether a codec can use the permuted decode with this head size.
static inline bool can_perm(const kvq::Codec& c, int D) {
  if (c.encoding != kvq::ENC_INT || (c.bits != 4 && c.bits != 2) || c.outliers) return false;
  if (D % (2 * W)) return false;
  return c.granularity != kvq::GRAN_GROUP || c.group % (2 * W) == 0;
}

// Decode step u of token t: chunk u (NV = 1) or, permuted, chunks 2u and 2u+1 (NV = 2).
// fp8 is decoded without its scale here: the fused path folds fp8 scales into Q / the
// logits (K) and into P / the accumulators (V) instead of one multiply per chunk.
template <int KIND, bool VEC, bool PERM>
static inline void decode_step(const TileSrc& ts, int t, int u, VF* out) {
  if (KIND == K_E4M3 || KIND == K_E5M2) {
    out[0] = decode_codes<KIND>(ts.row[t], u);
  } else if (!PERM) {
    out[0] = decode<KIND, VEC>(ts, t, u);
  } else {
    VF a, b;
    if (KIND == K_U4) ld_u4x2(ts.row[t] + u * W, a, b);
    else ld_u2x2(ts.row[t] + u * (W / 2), a, b);
    if (VEC) {
      const float* sp = ts.sv[t] + u * 2 * W;
      const float* zp = ts.zv[t] + u * 2 * W;
      out[0] = vfma(a, vload(sp), vload(zp));
      out[1] = vfma(b, vload(sp + W), vload(zp + W));
    } else {
      const int gi = (2 * u) >> ts.gshift;
      const VF vs = vset(ts.sv[t][gi]), vz = vset(ts.zv[t][gi]);
      out[0] = vfma(a, vs, vz);
      out[1] = vfma(b, vs, vz);
    }
  }
}

// Scratch path: decode tokens [0, nt) of the tile into out[nt][D].
template <int KIND, bool VEC>
static void decode_tile(const TileSrc& ts, int nt, int D, float* out) {  // natural order
  const int nch = D / W;
  for (int t = 0; t < nt; ++t)
    for (int c = 0; c < nch; ++c) vstore(out + (int64_t)t * D + c * W, decode<KIND, VEC>(ts, t, c));
}

// ---- fused decode path ---------------------------------------------------------------------
// S[m][t] = Q[m] . K[t] for MB rows (MB*TB = W accumulators), K decoded in registers.
template <int KIND, bool VEC, bool PERM, int MB>
static void qk_fused(const float* Q, const TileSrc& ts, int nt, int D, float* S) {
  constexpr int TB = W / MB, NV = PERM ? 2 : 1;
  const int nsteps = D / W / NV;
  for (int t0 = 0; t0 < nt; t0 += TB) {
    VF acc[W];
    for (int i = 0; i < W; ++i) acc[i] = vzero();
    int tk[TB];
    for (int ti = 0; ti < TB; ++ti) tk[ti] = imin(t0 + ti, nt - 1);
    for (int u = 0; u < nsteps; ++u) {
      VF kv[TB][NV];
      for (int ti = 0; ti < TB; ++ti) decode_step<KIND, VEC, PERM>(ts, tk[ti], u, kv[ti]);
      for (int mi = 0; mi < MB; ++mi)
        for (int v = 0; v < NV; ++v) {
          const VF qv = vload(Q + (int64_t)mi * D + (u * NV + v) * W);
          for (int ti = 0; ti < TB; ++ti)
            acc[mi * TB + ti] = vfma(qv, kv[ti][v], acc[mi * TB + ti]);
        }
    }
    float tmp[W];
    vstore(tmp, vreduce(acc));
    for (int mi = 0; mi < MB; ++mi)
      for (int ti = 0; ti < TB && t0 + ti < nt; ++ti) S[mi * SL + t0 + ti] = tmp[mi * TB + ti];
  }
}

// acc[m] += sum_{t in [a,b)} P[m][t] V[t] for MB rows, V decoded in registers; DS decode
// steps (DS*NV chunks) per pass.
template <int KIND, bool VEC, bool PERM, int MB, int DS>
static inline void pv_fused_block(const float* P, const TileSrc& ts, int a, int b, int D,
                                  int u0, float* acc) {
  constexpr int NV = PERM ? 2 : 1, DC = DS * NV;
  float* base = acc + (int64_t)u0 * NV * W;
  VF x[MB][DC];
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DC; ++k) x[mi][k] = vload(base + (int64_t)mi * D + k * W);
  for (int t = a; t < b; ++t) {
    VF v[DS][NV];
    for (int k = 0; k < DS; ++k) decode_step<KIND, VEC, PERM>(ts, t, u0 + k, v[k]);
    for (int mi = 0; mi < MB; ++mi) {
      const VF p = vset(P[mi * SL + t]);
      for (int k = 0; k < DS; ++k)
        for (int n = 0; n < NV; ++n) x[mi][k * NV + n] = vfma(p, v[k][n], x[mi][k * NV + n]);
    }
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DC; ++k) vstore(base + (int64_t)mi * D + k * W, x[mi][k]);
}

template <int KIND, bool VEC, bool PERM, int MB>
static void pv_fused(const float* P, const TileSrc& ts, int a, int b, int D, float* acc) {
  // accumulators MB*DC + DC decoded chunks + 1 broadcast within the register file
  constexpr int NV = PERM ? 2 : 1;
  constexpr int REGS = W >= 16 ? 28 : 14;
  constexpr int DC0 = REGS / (MB + 1);
  constexpr int DC = DC0 >= 4 ? 4 : (DC0 < NV ? NV : DC0);
  constexpr int DS = DC / NV;
  const int nsteps = D / W / NV;
  int u = 0;
  for (; u + DS <= nsteps; u += DS) pv_fused_block<KIND, VEC, PERM, MB, DS>(P, ts, a, b, D, u, acc);
  for (; u < nsteps; ++u) pv_fused_block<KIND, VEC, PERM, MB, 1>(P, ts, a, b, D, u, acc);
}

// Row counts the fused kernels are instantiated for (M is padded up to one of them).
static inline int fused_rows(int M) {
  if (M <= 4) return M == 3 ? 4 : M;
  if (M <= 8) return 8;
  return 16;
}
template <int KIND, bool VEC, bool PERM>
static void qk_fused_kind(KT<KIND, VEC, PERM>, int MBq, const float* Q, const TileSrc& ts,
                          int nt, int D, float* S) {
  switch (MBq) {
    case 1: qk_fused<KIND, VEC, PERM, 1>(Q, ts, nt, D, S); return;
    case 2: qk_fused<KIND, VEC, PERM, 2>(Q, ts, nt, D, S); return;
    case 4: qk_fused<KIND, VEC, PERM, 4>(Q, ts, nt, D, S); return;
    case 8: qk_fused<KIND, VEC, PERM, (8 <= W ? 8 : 1)>(Q, ts, nt, D, S); return;
    default: qk_fused<KIND, VEC, PERM, (16 <= W ? 16 : 1)>(Q, ts, nt, D, S); return;
  }
}
template <int KIND, bool VEC, bool PERM>
static void pv_fused_kind(KT<KIND, VEC, PERM>, int M, const float* P, const TileSrc& ts, int a,
                          int b, int D, float* acc) {
  switch (M) {
    case 1: pv_fused<KIND, VEC, PERM, 1>(P, ts, a, b, D, acc); return;
    case 2: pv_fused<KIND, VEC, PERM, 2>(P, ts, a, b, D, acc); return;
    case 3: pv_fused<KIND, VEC, PERM, 3>(P, ts, a, b, D, acc); return;
    case 4: pv_fused<KIND, VEC, PERM, 4>(P, ts, a, b, D, acc); return;
    case 8: pv_fused<KIND, VEC, PERM, 8>(P, ts, a, b, D, acc); return;
    default: pv_fused<KIND, VEC, PERM, (16 <= W ? 16 : 8)>(P, ts, a, b, D, acc); return;
  }
}
template <int KIND, bool VEC, bool PERM>
static void decode_tile_kind(KT<KIND, VEC, PERM>, const TileSrc& ts, int nt, int D, float* out) {
  decode_tile<KIND, VEC>(ts, nt, D, out);
}

// Full-precision rows (query, staging) of any input dtype -> fp32, times `mul`.
static inline void load_row_f(const void* base, int32_t dt, int64_t elem_off, int D, float mul,
                              float* out) {
  const VF vm = vset(mul);
  if (dt == DT_F32) {
    const float* p = (const float*)base + elem_off;
    for (int d = 0; d < D; d += W) vstore(out + d, vmul(vload(p + d), vm));
  } else if (dt == DT_F16) {
    const uint16_t* p = (const uint16_t*)base + elem_off;
    for (int d = 0; d < D; d += W) vstore(out + d, vmul(ld_f16(p + d), vm));
  } else {
    const uint16_t* p = (const uint16_t*)base + elem_off;
    for (int d = 0; d < D; d += W) vstore(out + d, vmul(ld_bf16(p + d), vm));
  }
}

// ---- logits: S[m][t] = Q[m] . K[t] ------------------------------------------------------
template <int MB>
static inline void qk_block(const float* Q, const float* K, int nt, int D, float* S) {
  constexpr int TB = W / MB;
  VF acc[W];
  for (int i = 0; i < W; ++i) acc[i] = vzero();
  const float* kp[TB];
  for (int ti = 0; ti < TB; ++ti) kp[ti] = K + (int64_t)(ti < nt ? ti : nt - 1) * D;
  for (int d = 0; d < D; d += W) {
    VF kv[TB];
    for (int ti = 0; ti < TB; ++ti) kv[ti] = vload(kp[ti] + d);
    for (int mi = 0; mi < MB; ++mi) {
      const VF qv = vload(Q + (int64_t)mi * D + d);
      for (int ti = 0; ti < TB; ++ti) acc[mi * TB + ti] = vfma(qv, kv[ti], acc[mi * TB + ti]);
    }
  }
  float tmp[W];
  vstore(tmp, vreduce(acc));
  for (int mi = 0; mi < MB; ++mi)
    for (int ti = 0; ti < nt && ti < TB; ++ti) S[mi * SL + ti] = tmp[mi * TB + ti];
}

static void qk_tile(const float* Q, int M, const float* K, int nt, int D, float* S) {
  int m = 0;
  for (; m + 4 <= M; m += 4)
    for (int t = 0; t < nt; t += W / 4)
      qk_block<4>(Q + (int64_t)m * D, K + (int64_t)t * D, nt - t, D, S + m * SL + t);
  for (; m + 2 <= M; m += 2)
    for (int t = 0; t < nt; t += W / 2)
      qk_block<2>(Q + (int64_t)m * D, K + (int64_t)t * D, nt - t, D, S + m * SL + t);
  for (; m < M; ++m)
    for (int t = 0; t < nt; t += W)
      qk_block<1>(Q + (int64_t)m * D, K + (int64_t)t * D, nt - t, D, S + m * SL + t);
}

// ---- online softmax over one tile: S becomes P ------------------------------------------
static void softmax_tile(float* S, int M, int nt, const int* lo, const int* hi, float* mrow,
                         float* lrow, float* acc, int D) {
  const int nch = (nt + W - 1) / W;
  for (int m = 0; m < M; ++m) {
    float* s = S + m * SL;
    const int a = lo[m], b = hi[m];
    if (a >= b) continue;
    const bool full = a == 0 && b == nt && nt % W == 0;
    float mx;
    if (full) {
      VF v = vload(s);
      for (int c = 1; c < nch; ++c) v = vmax(v, vload(s + c * W));
      mx = vhmax(v);
    } else {
      mx = -INFINITY;
      for (int t = a; t < b; ++t) mx = fmaxf(mx, s[t]);
    }
    float mold = mrow[m];
    if (mx > mold) {
      if (mold != -INFINITY) {
        const float corr = exp2f(mold - mx);
        lrow[m] *= corr;
        const VF vc = vset(corr);
        float* ar = acc + (int64_t)m * D;
        for (int d = 0; d < D; d += W) vstore(ar + d, vmul(vload(ar + d), vc));
      }
      mrow[m] = mx;
      mold = mx;
    }
    const VF vm = vset(mold);
    if (full) {
      VF sum = vzero();
      for (int c = 0; c < nch; ++c) {
        const VF p = vexp2(vsub(vload(s + c * W), vm));
        vstore(s + c * W, p);
        sum = vadd(sum, p);
      }
      lrow[m] += vhsum(sum);
    } else {
      for (int c = 0; c < nch; ++c) vstore(s + c * W, vexp2(vsub(vload(s + c * W), vm)));
      float sum = 0.0f;
      for (int t = a; t < b; ++t) sum += s[t];
      lrow[m] += sum;
    }
  }
}

// ---- acc[m] += sum_t P[m][t] V[t], t in [a, b) ------------------------------------------
template <int MB, int DC>
static inline void pv_block(const float* P, const float* V, int a, int b, int D, int d0,
                            float* acc) {
  VF x[MB][DC];
  for (int mi = 0; mi < MB; ++mi)
    for (int c = 0; c < DC; ++c) x[mi][c] = vload(acc + (int64_t)mi * D + d0 + c * W);
  for (int t = a; t < b; ++t) {
    VF v[DC];
    for (int c = 0; c < DC; ++c) v[c] = vload(V + (int64_t)t * D + d0 + c * W);
    for (int mi = 0; mi < MB; ++mi) {
      const VF p = vset(P[mi * SL + t]);
      for (int c = 0; c < DC; ++c) x[mi][c] = vfma(p, v[c], x[mi][c]);
    }
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int c = 0; c < DC; ++c) vstore(acc + (int64_t)mi * D + d0 + c * W, x[mi][c]);
}

template <int MB>
static inline void pv_rows(const float* P, const float* V, int a, int b, int D, float* acc) {
  constexpr int DC = MB == 4 ? (W >= 16 ? 4 : 2) : 4;
  const int nch = D / W;
  int c = 0;
  for (; c + DC <= nch; c += DC) pv_block<MB, DC>(P, V, a, b, D, c * W, acc);
  for (; c < nch; ++c) pv_block<MB, 1>(P, V, a, b, D, c * W, acc);
}

static void pv_tile(const float* P, int M, const float* V, const int* lo, const int* hi, int D,
                    float* acc) {
  int m = 0;
  while (m < M) {
    const int a = lo[m], b = hi[m];
    auto same = [&](int k) {
      for (int i = 1; i < k; ++i)
        if (lo[m + i] != a || hi[m + i] != b) return false;
      return true;
    };
    if (a >= b) { ++m; continue; }
    if (m + 4 <= M && same(4)) {
      pv_rows<4>(P + m * SL, V, a, b, D, acc + (int64_t)m * D);
      m += 4;
    } else if (m + 2 <= M && same(2)) {
      pv_rows<2>(P + m * SL, V, a, b, D, acc + (int64_t)m * D);
      m += 2;
    } else {
      pv_rows<1>(P + m * SL, V, a, b, D, acc + (int64_t)m * D);
      m += 1;
    }
  }
}


// The start of each stream (planes are in random order); the hardware prefetcher follows.
static inline void prefetch_rows(const uint8_t* p, int64_t n) {
  n = n < 512 ? n : 512;
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}

// ---- one task ----------------------------------------------------------------------------
static void run_task_impl(const AttnParams& P, const AttnTask& T, float* scratch) {
  const int D = P.D, gq = P.gq, B = P.B, R = P.R;
  const int M = T.nq * gq;
  const int Mp = M < W ? W : M;  // rows allocated (fused kernels pad up to W rows)
  // Fused decode path: one query token (all rows share one valid range), rows fit a block.
  const bool fused = T.nq == 1 && M <= W;
  const int MBq = fused ? fused_rows(M) : 0;
  const int MBp = fused ? (M <= 4 ? M : fused_rows(M)) : 0;
  const bool kperm = fused && can_perm(P.kc, D), vperm = fused && can_perm(P.vc, D);
  const int kpk = kperm ? (P.kc.bits == 4 ? K_U4 : K_U2) : -1;
  const int vpk = vperm ? (P.vc.bits == 4 ? K_U4 : K_U2) : -1;

  float* Q = scratch;
  float* Qk = Q + (size_t)Mp * D;  // Q in the K side's decode order (permuted or = Q)
  float* acc = Qk + (size_t)Mp * D;
  float* S = acc + (size_t)Mp * D;
  float* KV = S + (size_t)Mp * SL;
  TileBufs tb;
  tb.s = KV + (size_t)TT * D;
  tb.z = tb.s + (size_t)TT * (D / 16);
  tb.cs = tb.z + (size_t)TT * (D / 16);
  tb.cz = tb.cs + (size_t)4 * D;
  float* mrow = tb.cz + (size_t)4 * D;
  float* lrow = mrow + Mp;
  int* lo = (int*)(lrow + Mp);
  int* hi = lo + Mp;
  int* Fq = hi + Mp;
  int* pq = Fq + Mp;
  tb.u8 = (uint8_t*)(pq + Mp);  // TT * D bytes
  tb.f32 = (float*)(tb.u8 + (size_t)TT * D);  // TT * D floats
  tb.lut = tb.f32 + (size_t)TT * D;            // 16 * D floats

  for (int i = 0; i < T.nq; ++i) {
    const int p = T.pos0 + i;
    pq[i] = p;
    Fq[i] = (p + 1) / R * R;
    for (int g = 0; g < gq; ++g) {
      const int m = i * gq + g, hq = T.h * gq + g;
      load_row_f(P.q, P.dtype, (int64_t)(T.tok0 + i) * P.q_st + (int64_t)hq * P.q_sh, D,
                 P.scale_log2, Q + (int64_t)m * D);
    }
  }
  for (int64_t x = (int64_t)M * D; x < (int64_t)Mp * D; ++x) Q[x] = 0.0f;
  for (int64_t x = 0; x < (int64_t)Mp * D; ++x) acc[x] = 0.0f;
  for (int64_t x = 0; x < (int64_t)Mp * SL; ++x) S[x] = 0.0f;
  for (int m = 0; m < Mp; ++m) {
    mrow[m] = -INFINITY;
    lrow[m] = 0.0f;
  }
  // fp8 scales in the fused path: static ones fold into Q (K) and into acc after the paged
  // loop (V); per-token ones into the logits (K) and into P (V).
  const bool kfp8 = fused && (P.kc.encoding == kvq::ENC_FP8_E4M3 ||
                              P.kc.encoding == kvq::ENC_FP8_E5M2);
  const bool vfp8 = fused && (P.vc.encoding == kvq::ENC_FP8_E4M3 ||
                              P.vc.encoding == kvq::ENC_FP8_E5M2);
  const bool ktok = P.kc.granularity == kvq::GRAN_TOKEN, vtok = P.vc.granularity == kvq::GRAN_TOKEN;
  if (kperm) {
    for (int m = 0; m < Mp; ++m)
      for (int p = 0; p < D; ++p) Qk[(int64_t)m * D + p] = Q[(int64_t)m * D + perm_chan(kpk, p)];
  } else if (kfp8 && !ktok) {
    const float f = P.k_scale[T.h] * (P.kc.encoding == kvq::ENC_FP8_E4M3 ? 256.0f : 1.0f);
    for (int64_t x = 0; x < (int64_t)Mp * D; ++x) Qk[x] = Q[x] * f;
  } else {
    Qk = Q;
  }

  // Paged keys: query i reads positions < F_i.
  const int32_t* btrow = P.bt + (int64_t)T.s * P.bt_stride;
  const uint8_t* hbase = P.cache + (int64_t)T.h * P.c_sh;
  const float kst = P.k_scale[T.h], vst = P.v_scale[T.h];
  struct Seg { const uint8_t* plane; int off, cnt, at; };
  Seg segs[TT / 16 + 2];
  TileSrc ks, vs;
  ks.gshift = vs.gshift = 30;
  for (int j = T.kbeg; j < T.kend;) {
    const int jt0 = j;
    int nt = 0, ns = 0, nkc = 0;
    while (nt < TT && j < T.kend) {
      const int blk = j / B, off = j % B;
      const int cnt = imin(imin(TT - nt, B - off), T.kend - j);
      const uint8_t* plane = hbase + (int64_t)btrow[blk] * P.c_sb;
      segs[ns++] = Seg{plane, off, cnt, nt};
      prep_segment(P.kc, P.lay.k, plane, off, cnt, nt, D, kst, tb, nkc, ks, kpk, P.k_levels);
      nt += cnt;
      j += cnt;
    }
    // Prefetch the next tile's code rows (K and V) while this one is computed.
    for (int jn = j, left = TT; jn < T.kend && left > 0;) {
      const int off = jn % B, cnt = imin(imin(left, B - off), T.kend - jn);
      const uint8_t* np = hbase + (int64_t)btrow[jn / B] * P.c_sb;
      prefetch_rows(np + P.lay.k.data_off + (int64_t)off * P.lay.k.row_bytes,
                    cnt * P.lay.k.row_bytes);
      prefetch_rows(np + P.lay.v.data_off + (int64_t)off * P.lay.v.row_bytes,
                    cnt * P.lay.v.row_bytes);
      jn += cnt;
      left -= cnt;
    }
    for (int m = 0; m < M; ++m) {
      lo[m] = 0;
      hi[m] = iclamp(Fq[m / gq] - jt0, 0, nt);
    }
    if (fused) {
      with_kind(P.kc, kperm, [&](auto k) { qk_fused_kind(k, MBq, Qk, ks, nt, D, S); });
      if (kfp8 && ktok)
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < nt; ++t) S[m * SL + t] *= ks.sv[t][0];
    } else {
      with_kind(P.kc, false, [&](auto k) { decode_tile_kind(k, ks, nt, D, KV); });
      qk_tile(Q, M, KV, nt, D, S);
    }
    softmax_tile(S, M, nt, lo, hi, mrow, lrow, acc, D);
    int nvc = 0;
    for (int k = 0; k < ns; ++k)
      prep_segment(P.vc, P.lay.v, segs[k].plane, segs[k].off, segs[k].cnt, segs[k].at, D, vst,
                   tb, nvc, vs, vpk, P.v_levels);
    if (fused) {
      if (vfp8 && vtok)
        for (int m = 0; m < M; ++m)
          for (int t = lo[0]; t < hi[0]; ++t) S[m * SL + t] *= vs.sv[t][0];
      if (lo[0] < hi[0])
        with_kind(P.vc, vperm,
                  [&](auto k) { pv_fused_kind(k, MBp, S, vs, lo[0], hi[0], D, acc); });
    } else {
      with_kind(P.vc, false, [&](auto k) { decode_tile_kind(k, vs, nt, D, KV); });
      pv_tile(S, M, KV, lo, hi, D, acc);
    }
  }

  if (vfp8 && !vtok) {
    const float f = P.v_scale[T.h] * (P.vc.encoding == kvq::ENC_FP8_E4M3 ? 256.0f : 1.0f);
    for (int64_t x = 0; x < (int64_t)M * D; ++x) acc[x] *= f;
  }
  if (vperm) {  // accumulators back to channel order
    for (int m = 0; m < M; ++m) {
      float* a = acc + (int64_t)m * D;
      for (int p = 0; p < D; ++p) KV[perm_chan(vpk, p)] = a[p];
      for (int d = 0; d < D; ++d) a[d] = KV[d];
    }
  }

  // Staging: query i reads positions [F_i, p_i] in full precision.
  if (T.staging) {
    int jb = INT32_MAX, je = 0;  // union of [F_i, p_i] over the tile's queries
    for (int i = 0; i < T.nq; ++i)
      if (Fq[i] <= pq[i]) {
        jb = Fq[i] < jb ? Fq[i] : jb;
        je = pq[i] + 1 > je ? pq[i] + 1 : je;
      }
    for (int j = jb; j < je; j += TT) {
      const int nt = imin(TT, je - j);
      for (int t = 0; t < nt; ++t)
        load_row_f(P.sk, P.s_dtype, (T.stg_base + j + t) * P.sk_st + (int64_t)T.h * P.sk_sh, D,
                   1.0f, KV + (int64_t)t * D);
      for (int m = 0; m < M; ++m) {
        lo[m] = iclamp(Fq[m / gq] - j, 0, nt);
        hi[m] = iclamp(pq[m / gq] + 1 - j, 0, nt);
      }
      qk_tile(Q, M, KV, nt, D, S);
      softmax_tile(S, M, nt, lo, hi, mrow, lrow, acc, D);
      for (int t = 0; t < nt; ++t)
        load_row_f(P.sv, P.s_dtype, (T.stg_base + j + t) * P.sv_st + (int64_t)T.h * P.sv_sh, D,
                   1.0f, KV + (int64_t)t * D);
      pv_tile(S, M, KV, lo, hi, D, acc);
    }
  }

  if (T.part >= 0) {  // partial result: m[M], l[M], acc[M][D], combined by the driver
    float* dst = P.partials + T.part;
    for (int m = 0; m < M; ++m) {
      dst[m] = mrow[m];
      dst[M + m] = lrow[m];
    }
    memcpy(dst + 2 * M, acc, sizeof(float) * (size_t)M * D);
    return;
  }
  for (int m = 0; m < M; ++m) {
    const int i = m / gq, hq = T.h * gq + m % gq;
    const float inv = lrow[m] != 0.0f ? 1.0f / lrow[m] : 0.0f;  // NaN stays NaN
    const float* a = acc + (int64_t)m * D;
    const int64_t o = (int64_t)(T.tok0 + i) * P.o_st + (int64_t)hq * P.o_sh;
    if (P.dtype == DT_F32) {
      float* dst = (float*)P.out + o;
      const VF vi = vset(inv);
      for (int d = 0; d < D; d += W) vstore(dst + d, vmul(vload(a + d), vi));
    } else if (P.dtype == DT_F16) {
      uint16_t* dst = (uint16_t*)P.out + o;
      for (int d = 0; d < D; ++d) dst[d] = out_fp16(a[d] * inv);
    } else {
      uint16_t* dst = (uint16_t*)P.out + o;
      for (int d = 0; d < D; ++d) dst[d] = kvq::float_to_bf16(a[d] * inv);
    }
  }
}
