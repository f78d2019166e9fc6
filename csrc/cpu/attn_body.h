// The paged-attention kernel body, compiled once per SIMD path. Included (and only
// included) by attn_avx512.cpp / attn_avx2.cpp / attn_scalar.cpp inside their own
// namespace, after they define the vector primitives:
//
//   W (lanes), VF, vzero, vset, vload, vstore, vadd, vsub, vmul, vdiv, vfma(a,b,c)=a*b+c,
//   vmax(a,b) (b when either is NaN), vmin, vhmax, vhsum, vexp2,
//   vreduce(const VF a[W]) -> lane k = sum of a[k]'s lanes,
//   ld_f16 / ld_bf16 (W halves), ld_u8 (W bytes), ld_u4 (W/2 bytes), ld_u2 (W/4 bytes),
//   ld_e4m3 (W bytes, value * 2^-8), ld_e5m2 (W bytes);
//   for the integer Q.K: VI (W int32 lanes), ci_zero, ci_add, ci_dot<SMALL>, ci_tof,
//   CiWide / ci_wide / ci_dot_wide / kCiWideBias (8-bit codes), ci_bcast4, ci_field<SH>,
//   ci_tr8 (W rows' 4-byte words transposed), vq8_store;
//   KVQ_HAS_QK3 (1: also ci_units3, ci_tab3, ci_fields3, q8_perm64 and the KVQ_QK3_TARGET
//   attribute, for qk_int3: 3-bit codes read as stored, and fold_perm);
//   for the outlier slots: VM, ci_* loads, gathers and masks, vtab, vtr4_store / vtr4_load
//   (4 rows <-> W quads), vadd4;
//   KVQ_HAS_BF16DP (1: vdp_bf16, ci_loadu, KVQ_BF16_TARGET, for qk_bf16) and KVQ_HAS_PV_BF16
//   (1: PvPairs, pv_pairs_init, pv_pairs4 / 3 / 2 / 16, pv_dp, pv_bcast / pv_bcast1,
//   pv_store_bf16 and KVQ_PV_TARGET, for pv_bf16; with pv_pairs8, pv_dpi, pv_i16_unpair and
//   pv_store_i16 also its int16 weights of 8-bit values, pv_i16).
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
// Integer Q.K (fused decode path; int keys of 8/4/3/2 bits and nuq keys of 4/2 bits, nuq3
// where the path reads 3-bit codes as stored (AttnParams::qk3), with or without outlier
// slots; see "integer Q.K" below): the query rows are rounded to int8 once per task and
// each key token's logit is an integer dot product of codes (nuq: their levels as bytes)
// and int8 query (vpdpbusd) with one token per lane, scaled once per scale group; outlier
// slots are corrected after it.
//
// In the scratch path (prefill tiles) nuq codecs and codecs with outlier slots are decoded
// to fp32 rows when a tile is prepared (predecode_segment: level[code] * scale + zero
// through the layer's codebook, or code * scale + zero, then each outlier slot adds its
// correction to its channel) and consumed as the K_F32 kind. The fused path reads their
// codes in registers (nuq through the codebook, ld_t*; int3 through the identity table,
// K_N3) and adds each slot's correction sparsely (for_slots).

constexpr int TT = kTileTokens;
constexpr int SL = kTileTokens;  // row stride of the logits tile
constexpr int CW = 4 * W;         // codes per chunk of the integer Q.K (see "integer Q.K")
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
// K_B4: nuq 4-bit codes through a byte table (ts.blev; KVQ_HAS_PV_BYTE), the scale and zero
// rows in the byte levels' affine form (nuq_int_scales): the decode P.V of nuq4 values.
enum Kind { K_F16 = 0, K_BF16, K_E4M3, K_E5M2, K_U8, K_U4, K_U2, K_F32, K_N4, K_N3, K_N2, K_B4 };
template <int KIND, bool VEC, bool PERM>
struct KT {};

// The next tile's lines of one side (K or V: code rows, scales, zero-points, outlier slots),
// prefetched while this tile's kernels of that side run, a share per step: a burst of the
// whole tile (~320 lines for int4_group32 D=128) outruns the core's outstanding-miss slots,
// and every prefetch past them waits for a line to arrive. Kernels step() as they go (qk:
// per token; P.V: per token of each pass, pace() set for all passes); flush() issues the rest.
struct RowStream {
  static constexpr int kMaxRanges = 64;
  const uint8_t* beg[kMaxRanges];
  const uint8_t* end[kMaxRanges];
  const uint8_t* cur = nullptr;
  int nr = 0, r = 0;   // ranges, the one `cur` is in
  int64_t left = 0;    // lines not yet issued
  uint64_t rate = 0;   // lines per step, 16.16 fixed point
  uint64_t credit = 0;
  void clear() { nr = r = 0; left = 0; credit = 0; cur = nullptr; }
  void add(const uint8_t* p, int64_t bytes) {
    if (bytes <= 0) return;
    beg[nr] = p;  // nr < kMaxRanges: see the static_assert below
    end[nr] = p + bytes;
    if (nr++ == 0) cur = p;
    left += (bytes + 63) / 64;
  }
  void pace(int64_t steps) {  // spread what is left evenly over `steps` calls of step(1)
    rate = steps > 0 ? (((uint64_t)left << 16) + steps - 1) / steps : (uint64_t)left << 16;
    credit = 0;
  }
  // the next `lines` (<= left) lines, range by range
  __attribute__((always_inline)) void issue(int64_t lines) {
    left -= lines;
    while (lines > 0) {
      const int64_t in_range = (end[r] - cur + 63) >> 6;
      const int64_t c = lines < in_range ? lines : in_range;
      // prefetcht1: into L2, not L1 (see stream_rows)
      for (int64_t i = 0; i < c; ++i) __builtin_prefetch(cur + 64 * i, 0, 2);
      cur += 64 * c;
      lines -= c;
      if (cur >= end[r] && ++r < nr) cur = beg[r];
    }
  }
  __attribute__((always_inline)) void step(int k = 1) {
    if (left <= 0) return;
    credit += rate * (uint64_t)k;
    const int64_t due = (int64_t)(credit >> 16);
    if (due == 0) return;
    credit &= 65535;
    issue(due < left ? due : left);
  }
  void flush() {
    if (left > 0) issue(left);
  }
};

// A tile spans at most TT/16 + 2 blocks (block_size >= 16), 4 ranges each (scales, zeros,
// slots, codes): the stream never needs its overflow path.
static_assert(4 * (TT / 16 + 2) <= RowStream::kMaxRanges, "a tile's ranges fit a RowStream");

struct TileSrc {
  RowStream* next = nullptr;  // the next tile's lines of this side, or none
  const uint8_t* row[TT];  // codes of token t (int3 keys on the integer Q.K without qk3:
                           // repacked to 4 bits; K_F32: the token's D decoded floats)
  const float* sv[TT];     // VEC: D scales; else the token's scales, chunk c uses [c >> gshift]
  const float* zv[TT];
  const uint8_t* orow[TT];  // outlier slots of token t (fused path, codecs with outliers)
  int gshift;
  float lev[16];            // K_N*: lev[i] = level of code i mod 2^bits (set_levels)
  alignas(16) uint8_t blev[16];  // K_B4: the levels as bytes (IntKey::lut)
};

// ts.lev for a codec: nuq's codebook; int3's codes themselves (its packed rows are read
// like nuq3's, K_N3, with level c = c).
static inline void set_levels(const kvq::Codec& c, const float* levels, TileSrc& ts) {
  const int n = 1 << c.bits;
  for (int i = 0; i < 16; ++i)
    ts.lev[i] = c.encoding == kvq::ENC_NUQ && levels ? levels[i % n]
                : c.encoding == kvq::ENC_INT && c.bits == 3 ? (float)(i % n) : 0.0f;
}

// The 3 bytes of 8 packed 3-bit codes (code i in bits 3i..3i+2) as one word.
static inline uint32_t word3(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
}

template <int KIND>
static inline VF decode_codes(const TileSrc& ts, int t, int c) {
  const uint8_t* row = ts.row[t];
  const float* lev = ts.lev;
#if KVQ_HAS_PV_BYTE
  if (KIND == K_B4) return ld_b4(row + c * (W / 2), ts.blev);
#endif
  if (KIND == K_N4) return ld_t4(row + c * (W / 2), lev);
  if (KIND == K_N3) return ld_t3(row + c * (3 * W / 8), lev);
  if (KIND == K_N2) return ld_t2(row + c * (W / 4), lev);
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
  const VF x = decode_codes<KIND>(ts, t, c);
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
  float* cs;   // kTileChanRows * D per-channel scale rows
  float* cz;
  float st[2]; // static scale and its zero
  uint8_t* u8; // TT * D unpacked int3 codes
  float* f32;  // TT * D decoded values (nuq / outlier codecs)
  float* lut;  // 16 * D: per-channel lookup tables (nuq / outlier codecs, channel scales)
};

// A TileBufs carved from p (tile_buf_floats(D) floats, attn_common.h); returns the first
// float after it.
static inline float* carve_tile_bufs(float* p, int D, TileBufs& tb) {
  tb.s = p;
  tb.z = tb.s + (size_t)TT * (D / 16);
  tb.cs = tb.z + (size_t)TT * (D / 16);
  tb.cz = tb.cs + (size_t)kTileChanRows * D;
  tb.u8 = (uint8_t*)(tb.cz + (size_t)kTileChanRows * D);  // TT * D bytes
  tb.f32 = (float*)(tb.u8 + (size_t)TT * D);  // TT * D floats
  tb.lut = tb.f32 + (size_t)TT * D;            // 16 * D floats
  return tb.lut + (size_t)16 * D;
}

// Whether a codec is decoded to fp32 rows when its tile is prepared (K_F32): in the
// scratch path (prefill) nuq and outlier codecs are; the fused decode path reads their
// codes in registers (nuq: through the codebook table, ld_t*) and applies each outlier
// slot as a sparse correction (outlier_fix_k / outlier_fix_v).
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
      const uint32_t w = word3(p);
      for (int i = 0; i < 8; ++i) dst[d + i] = L(d + i, (w >> (3 * i)) & 7u);
    }
  }
}

// Rows [off, off+cnt) of a nuq or outlier codec's region -> fp32 rows of tb.f32 as tokens
// at.. of the tile: dense values as the reference computes them (value = table[code] *
// scale + zero, one rounding each: table = the codebook for nuq, code or code - 2^(b-1)
// for int; evaluated once per scale group into a small lookup table for b <= 4), then
// every outlier slot whose channel is below D adds its correction to that channel.
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
      if (ch < D) dst[ch] += kvq::fp16_to_float(v);
    }
    ts.row[at + i] = (const uint8_t*)dst;
  }
}

// Add rows [off, off+cnt) of one region of `plane` as tokens at.. of the tile.
static inline int perm_chan(int kind, int p);
static inline int ichan(int bits, int p);
constexpr int kPermInt = 100;  // perm kind kPermInt + bits: the integer Q.K code order
// The channel at each position of a permuted row, per perm kind, built once per process
// (the index formulas hold for any head size <= 512): cvt_f16_row runs for every per-channel
// scale row (KIVI keys: two rows per 32-token group), where per-element divisions cost ~6%.
// perm_inv_table: the position of each channel (the outlier slots of per-channel keys
// index their permuted scale rows by channel; int32 for the slots' gathers).
struct PermTables {
  int16_t t[5][512];
  int32_t inv[5][512];
  PermTables() {
    const int kinds[5] = {K_U4, K_U2, kPermInt + 8, kPermInt + 4, kPermInt + 2};
    for (int k = 0; k < 5; ++k)
      for (int p = 0; p < 512; ++p) {
        t[k][p] = (int16_t)(kinds[k] >= kPermInt ? ichan(kinds[k] - kPermInt, p)
                                                 : perm_chan(kinds[k], p));
        inv[k][t[k][p]] = p;
      }
  }
  static int index(int kind) {
    switch (kind) {
      case K_U4: return 0;
      case K_U2: return 1;
      case kPermInt + 8: return 2;
      case kPermInt + 4: return 3;
      default: return 4;
    }
  }
};
static const PermTables& perm_tables() {
  static const PermTables tables;
  return tables;
}
static const int16_t* perm_table(int kind) { return perm_tables().t[PermTables::index(kind)]; }
static const int32_t* perm_inv_table(int kind) {
  return perm_tables().inv[PermTables::index(kind)];
}
// Row x[D] (channel order) -> out[D] in the permuted order of `kind`: out[p] =
// x[perm_table(kind)[p]]. The orders are even/odd splits (vdeint): K_U4 of each 2W
// channels (evens, then odds), K_U2 of those again (channels 4i, 4i+1 | 4i+2, 4i+3 per half
// vector); the integer Q.K's code orders (ichan) of each CW = 4W channels: 4 bits once
// (evens, then odds), 2 bits twice (4i, 4i+1, 4i+2, 4i+3), 8 bits none.
static void permute_row(const float* x, int D, int kind, float* out) {
  if (kind == kPermInt + 8) {
    if (out != x) memcpy(out, x, sizeof(float) * D);
    return;
  }
  const bool code = kind >= kPermInt;
  const int chunk = code ? CW : 2 * W;
  if (D % chunk) {
    float tmp[512];
    memcpy(tmp, x, sizeof(float) * D);
    const int16_t* tab = perm_table(kind);
    for (int p = 0; p < D; ++p) out[p] = tmp[tab[p]];
    return;
  }
  for (int c = 0; c < D; c += chunk) {
    const float* s = x + c;
    float* d = out + c;
    VF e0, o0;
    vdeint(vload(s), vload(s + W), e0, o0);
    if (!code) {
      if (kind == K_U2) vdeint(e0, o0, e0, o0);
      vstore(d, e0), vstore(d + W, o0);
      continue;
    }
    VF e1, o1;
    vdeint(vload(s + 2 * W), vload(s + 3 * W), e1, o1);
    if (kind == kPermInt + 4) {
      vstore(d, e0), vstore(d + W, e1), vstore(d + 2 * W, o0), vstore(d + 3 * W, o1);
    } else {
      VF ee, eo, oe, oo;
      vdeint(e0, e1, ee, eo);
      vdeint(o0, o1, oe, oo);
      vstore(d, ee), vstore(d + W, oe), vstore(d + 2 * W, eo), vstore(d + 3 * W, oo);
    }
  }
}
// The inverse for the permuted V decode (K_U4 / K_U2): a[D] back to channel order, in place.
static void unpermute_row(float* a, int D, int kind) {
  if (D % (2 * W)) {
    float tmp[512];
    const int16_t* tab = perm_table(kind);
    for (int p = 0; p < D; ++p) tmp[tab[p]] = a[p];
    memcpy(a, tmp, sizeof(float) * D);
    return;
  }
  for (int c = 0; c < D; c += 2 * W) {
    VF e = vload(a + c), o = vload(a + c + W), x0, x1;
    if (kind == K_U2) vinter(e, o, e, o);
    vinter(e, o, x0, x1);
    vstore(a + c, x0), vstore(a + c + W, x1);
  }
}
// D fp16 values of a scale row -> dst in the permuted order of `kind` (kind < 0: as stored).
static void cvt_f16_row(const uint8_t* src, int D, int kind, float* dst) {
  if (kind < 0) return cvt_f16(src, D, 1.0f, dst);
  float tmp[512];
  cvt_f16(src, D, 1.0f, tmp);
  permute_row(tmp, D, kind, dst);
}

// How the integer Q.K reads a key codec that is not plain int8/4/2 codes (see "integer Q.K"):
// 3-bit codes repacked as 4-bit rows (AVX2: by pdep where it is fast; nuq3 keys stay on the
// fp32 Q.K there: with the repack and their outlier slots 15.2 vs 13.6 ms, 32/8/128 b4 8k);
// nuq levels through a byte table u[code] (lut), the value level * s + z then being
// u * (s * delta) + (z + s * lmin), an int code with those scale and zero rows.
// The byte levels span [0, 127], not [0, 255]: a pair of 7-bit levels times int8 query
// bytes cannot saturate AVX2's vpmaddubsw (2 * 127 * 127 < 2^15), so nuq keys take the same
// 3-instruction dot as 4/2-bit codes there instead of splitting bytes into 16-bit words (9);
// every path uses the same integers. A level moves by at most 1/254 of the codebook's range
// (~1/8 of the half-step of 16 evenly spaced levels).
constexpr int kNuqKeyLevelMax = 127;
// Values' byte levels (K_B4) are converted to float, not multiplied as bytes: the whole byte.
constexpr int kNuqValueLevelMax = 255;
// (IntKey also gives nuq 4-bit values this form where the P.V reads them as bytes: K_B4.)
struct IntKey {
  bool repack3;      // rows repacked to 4 bits when the tile is prepared (tb.u8)
  bool pdep;         // that repack by cvt3to4_row_pdep (KVQ_HAS_PDEP, fast_pdep)
  bool nuq;          // scale rows become s * delta, zero rows z + s * lmin
  float lmin, delta;
  uint8_t lut[16];   // u[code mod 2^bits] (nuq)
};

// A nuq codebook of 2^bits ascending levels as bytes u = rint((level - lmin) * top /
// (lmax - lmin)) into ik (lut, lmin, delta); false for a codebook with one level (the exact
// path then reads it).
static inline bool nuq_byte_form(const float* levels, int bits, int top, IntKey& ik) {
  const int n = 1 << bits;
  const float lmin = levels[0], lmax = levels[n - 1];
  if (!(lmax > lmin)) return false;
  const float inv = (float)top / (lmax - lmin);
  for (int i = 0; i < 16; ++i)
    ik.lut[i] = (uint8_t)iclamp((int)rintf((levels[i % n] - lmin) * inv), 0, top);
  ik.lmin = lmin;
  ik.delta = (lmax - lmin) / (float)top;
  return true;
}

// s, z (n floats each) -> s * delta, z + s * lmin (the nuq levels' affine byte form)
static inline void nuq_int_scales(const IntKey& ik, float* s, float* z, int n) {
  int i = 0;
  const VF d = vset(ik.delta), l = vset(ik.lmin);
  for (; i + W <= n; i += W) {
    const VF sv = vload(s + i);
    vstore(z + i, vadd(vload(z + i), vmul(sv, l)));
    vstore(s + i, vmul(sv, d));
  }
  for (; i < n; ++i) {
    z[i] = z[i] + s[i] * ik.lmin;
    s[i] = s[i] * ik.delta;
  }
}

// dst[i] = base + i * stride (elements), i in [0, n): 4 pointers a 256-bit store (every
// path has them; Zen 4 splits a 512-bit store in two anyway, and a 512-bit generic vector
// in the AVX2 body went through the stack, 3/4 of its prep_segment). Written as a plain
// loop the compiler built each vector of pointers from scalar adds and inserts; the tile's
// pointer arrays were ~half of prep_segment's samples (nuq3, 512 tokens, AVX-512 body).
template <class T>
static inline void fill_strided(const T** dst, const T* base, int64_t stride, int n) {
  typedef int64_t P4 __attribute__((vector_size(32)));
  const int64_t sb = stride * (int64_t)sizeof(T), b = (int64_t)(uintptr_t)base;
  P4 p = {b, b + sb, b + 2 * sb, b + 3 * sb};
  const P4 step = {4 * sb, 4 * sb, 4 * sb, 4 * sb};
  int i = 0;
  for (; i + 4 <= n; i += 4, p += step) memcpy(dst + i, &p, sizeof p);
  for (; i < n; ++i) dst[i] = base + i * stride;
}

// perm_kind: K_U4/K_U2 when the fused path decodes this side permuted, else -1.
// ik: the key side of a task on the integer Q.K when its codec needs a form (else nullptr).
static void prep_segment(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                         int off, int cnt, int at, int D, float st, TileBufs& tb, int& nch_rows,
                         TileSrc& ts, int perm_kind, const float* levels, bool dense,
                         const IntKey* ik = nullptr) {
  if (predecoded(c) && !dense) {
    predecode_segment(c, r, plane, off, cnt, at, D, st, levels, tb, ts);
    return;
  }
  if (c.outliers) {
    fill_strided(ts.orow + at, plane + r.outlier_off + (int64_t)off * c.outliers * 4,
                 c.outliers * 4, cnt);
  }
  const uint8_t* data = plane + r.data_off;
  const bool e4 = c.encoding == kvq::ENC_FP8_E4M3;
  const bool is_int = c.encoding == kvq::ENC_INT;
  const float off_sym = is_int && c.symmetric ? -(float)(1 << (c.bits - 1)) : 0.0f;
  // Locals for the tile's pointer arrays: stores through ts would make the compiler reload
  // r's fields every token (and it vectorized the pointer loops below into scatters).
  const int64_t rb = r.row_bytes;
  const uint8_t** rows = ts.row + at;
  if (ik && ik->repack3) {
    for (int i = 0; i < cnt; ++i) {
      uint8_t* u = tb.u8 + (int64_t)(at + i) * (D / 2);
#if KVQ_HAS_PDEP
      if (ik->pdep) cvt3to4_row_pdep(data + (int64_t)(off + i) * rb, D, u);
      else
#endif
      cvt3to4_row(data + (int64_t)(off + i) * rb, D, u);
      rows[i] = u;
    }
  } else {
    fill_strided(rows, data + (int64_t)off * rb, rb, cnt);
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
      if (ik && ik->nuq) nuq_int_scales(*ik, s, z, cnt * ng);
      fill_strided(ts.sv + at, (const float*)s, ng, cnt);
      fill_strided(ts.zv + at, (const float*)z, ng, cnt);
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
        cvt_f16_row(plane + r.scale_off + 2 * (int64_t)srow * D, D, perm_kind, s);
        if (r.zero_bytes) cvt_f16_row(plane + r.zero_off + 2 * (int64_t)srow * D, D, perm_kind, z);
        else for (int d = 0; d < D; ++d) z[d] = off_sym * s[d];
        if (ik && ik->nuq) nuq_int_scales(*ik, s, z, D);
        const float** svp = ts.sv + at + i;
        const float** zvp = ts.zv + at + i;
        for (int k = 0; k < n; ++k) svp[k] = s;
        for (int k = 0; k < n; ++k) zvp[k] = z;
        i += n;
      }
      return;
    }
    default:  // tensor / head: static scale
      tb.st[0] = st * mul;
      tb.st[1] = off_sym * st;
      ts.gshift = 30;
      const float** svp = ts.sv + at;
      const float** zvp = ts.zv + at;
      for (int i = 0; i < cnt; ++i) svp[i] = &tb.st[0];
      for (int i = 0; i < cnt; ++i) zvp[i] = &tb.st[1];
      return;
  }
}

// Calls f(KT<kind, vec, perm>{}) for the codec; perm only applies to 4/2-bit int and nuq
// codes (can_perm). dense: the fused path (nuq / outlier codecs not predecoded). bytes: nuq
// 4-bit codes through the byte table (K_B4; its scale rows prepared for it).
template <class F>
static inline void with_kind(const kvq::Codec& c, bool perm, F&& f, bool dense = false,
                             [[maybe_unused]] bool bytes = false) {
  const bool vec = c.granularity == kvq::GRAN_CHANNEL;
  if (predecoded(c) && !dense) { f(KT<K_F32, false, false>{}); return; }
#define KVQ_VP(K)                                          \
  if (vec) {                                               \
    if (perm) f(KT<K, true, true>{}); else f(KT<K, true, false>{});   \
  } else {                                                 \
    if (perm) f(KT<K, false, true>{}); else f(KT<K, false, false>{}); \
  }                                                        \
  return;
  if (c.encoding == kvq::ENC_NUQ) {
    switch (c.bits) {
      case 4:
#if KVQ_HAS_PV_BYTE
        if (bytes) { KVQ_VP(K_B4) }
#endif
        KVQ_VP(K_N4)
      case 3: if (vec) f(KT<K_N3, true, false>{}); else f(KT<K_N3, false, false>{}); return;
      default: KVQ_VP(K_N2)
    }
  }
  switch (c.encoding) {
    case kvq::ENC_FP16: f(KT<K_F16, false, false>{}); return;
    case kvq::ENC_BF16: f(KT<K_BF16, false, false>{}); return;
    case kvq::ENC_FP8_E4M3: f(KT<K_E4M3, false, false>{}); return;
    case kvq::ENC_FP8_E5M2: f(KT<K_E5M2, false, false>{}); return;
    default: break;
  }
  switch (c.bits) {
    case 4: KVQ_VP(K_U4)
    case 2: KVQ_VP(K_U2)
    case 3:  // packed codes through the identity table (set_levels), like nuq3's
      if (vec) f(KT<K_N3, true, false>{}); else f(KT<K_N3, false, false>{});
      return;
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
// Whether a codec can use the permuted decode with this head size: int 4/2 bits; on the
// value side also nuq 4/2 bits (codes through the codebook table, ld_t4x2 / ld_t2x2) and
// outlier slots (outlier_fix_v adds them at their channel's position).
static inline bool can_perm(const kvq::Codec& c, int D, bool value_side = false) {
  const bool nuq = c.encoding == kvq::ENC_NUQ;
  if ((c.encoding != kvq::ENC_INT && !(value_side && nuq)) || (c.bits != 4 && c.bits != 2) ||
      (c.outliers && !value_side))
    return false;
  if (D % (2 * W)) return false;
  return c.granularity != kvq::GRAN_GROUP || c.group % (2 * W) == 0;
}

// Permuted decode step u of token t without scale and zero: the two chunks of 2W channels
// (can_perm's codecs: int codes, nuq levels).
template <int KIND>
static inline void decode_pair(const TileSrc& ts, int t, int u, VF& a, VF& b) {
  if (KIND == K_U4) ld_u4x2(ts.row[t] + u * W, a, b);
  else if (KIND == K_U2) ld_u2x2(ts.row[t] + u * (W / 2), a, b);
  else if (KIND == K_N4) ld_t4x2(ts.row[t] + u * W, ts.lev, a, b);
#if KVQ_HAS_PV_BYTE
  else if (KIND == K_B4) ld_b4x2(ts.row[t] + u * W, ts.blev, a, b);
#endif
  else ld_t2x2(ts.row[t] + u * (W / 2), ts.lev, a, b);
}

// Decode step u of token t: chunk u (NV = 1) or, permuted, chunks 2u and 2u+1 (NV = 2).
// fp8 is decoded without its scale here: the fused path folds fp8 scales into Q / the
// logits (K) and into P / the accumulators (V) instead of one multiply per chunk.
template <int KIND, bool VEC, bool PERM>
static inline void decode_step(const TileSrc& ts, int t, int u, VF* out) {
  if (KIND == K_E4M3 || KIND == K_E5M2) {
    out[0] = decode_codes<KIND>(ts, t, u);
  } else if (!PERM) {
    out[0] = decode<KIND, VEC>(ts, t, u);
  } else {
    VF a, b;
    decode_pair<KIND>(ts, t, u, a, b);
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
  for (int t = 0; t < nt; ++t) {
    for (int c = 0; c < nch; ++c) vstore(out + (int64_t)t * D + c * W, decode<KIND, VEC>(ts, t, c));
    if (ts.next) ts.next->step();
  }
}

// ---- outlier slots in the fused path -------------------------------------------------------
// Each slot stores channel ch of token t and the correction delta = x - (the dense decode
// there), written with the codes (kvq::Outlier), so the fused path adds it to what its
// dense decode gave: K: S[m][t] += Q[m][ch] * delta, V: acc[m][ch] += P[m][t] * delta. No
// code or scale is read back here. Slot j of W consecutive tokens is one vector (for_slots):
// the slot words sit at the constant stride of one segment of the tile (K: S and Q[m][ch]
// are then vectors too; V: the W products P * delta are added channel by channel, as two
// tokens may share a channel). A run across two segments takes the scalar batches
// (gather_outliers): (t, ch, delta) entries.
constexpr int kOutBatch = 4 * TT;
struct OutlierBatch {
  int t[kOutBatch], ch[kOutBatch];
  uint16_t delta16[kOutBatch + W];
  float delta[kOutBatch + W];
};

// Slots of tokens [t, b) into ob, at most kOutBatch entries (their count in n_out); returns
// the first token not gathered.
static int gather_outliers(int nout, const TileSrc& ts, int t, int b, int D, OutlierBatch& ob,
                           int& n_out) {
  int n = 0;  // a local: through n_out every store to ob would reload it
  for (; t < b && n + nout <= kOutBatch; ++t) {
    const uint8_t* o = ts.orow[t];
    for (int j = 0; j < nout; ++j) {
      uint32_t w;
      memcpy(&w, o + 4 * j, 4);  // kvq::Outlier: channel, then the fp16 correction
      const int ch = (int)(w & 0xFFFFu);
      if (ch >= D) continue;  // kNoOutlier
      ob.t[n] = t;
      ob.ch[n] = ch;
      ob.delta16[n] = (uint16_t)(w >> 16);
      ++n;
    }
  }
  for (int i = 0; i < n; i += W) vstore(ob.delta + i, ld_f16(ob.delta16 + i));
  n_out = n;
  return t;
}

// The byte stride of pointers p[lo..hi) when it is constant (and W strides fit int32).
template <class T>
static inline bool const_stride(T* const* p, int lo, int hi, int64_t& st) {
  st = hi - lo > 1 ? (int64_t)((const uint8_t*)p[lo + 1] - (const uint8_t*)p[lo]) : 0;
  return (const uint8_t*)p[hi - 1] - (const uint8_t*)p[lo] == st * (hi - 1 - lo) &&
         st < (1 << 24) && st > -(1 << 24);
}

// Calls run(t0, ch, ok, delta) for slot j of each W tokens [t0, t0 + W) (t0 a multiple of W)
// meeting [a, b): ok = the lanes with a token in [a, b) and a slot (ch < D), delta = the
// slot's correction there and 0 elsewhere; tokens of a run without a constant slot stride
// go to batch(lo, hi) instead.
template <class F, class G>
static void for_slots(const kvq::Codec& c, const TileSrc& ts, int a, int b, int D, F&& run,
                      G&& batch_fix) {
  const int nout = c.outliers;
  const VI iota = ci_iota(), vD = ci_set1(D), m16 = ci_set1(0xFFFF), s16 = ci_set1(16);
  for (int t0 = a / W * W; t0 < b; t0 += W) {
    const int lo = imax(a, t0), hi = imin(b, t0 + W);
    int64_t os;
    if (!const_stride(ts.orow, lo, hi, os)) {
      OutlierBatch ob;
      for (int t = lo, n = 0; t < hi;) {
        t = gather_outliers(nout, ts, t, hi, D, ob, n);
        batch_fix(ob, n);
      }
      continue;
    }
    const VM lanes = vm_and(ci_lt(ci_set1(lo - t0 - 1), iota), ci_lt(iota, ci_set1(hi - t0)));
    const VI lane = ci_add(iota, ci_set1(t0 - lo));  // lane i: token t0 + i, relative to lo
    const VI ooff = ci_mullo(lane, ci_set1((int)os));
    for (int j = 0; j < nout; ++j) {
      // one slot per token: W consecutive words (lanes before lo are masked off)
      const VI w = os == 4 ? ci_load(ts.orow[lo] - 4 * (lo - t0), lanes)
                           : ci_gather(ts.orow[lo] + 4 * j, ooff, lanes);
      const VI ch = ci_and(w, m16);
      const VM ok = vm_and(lanes, ci_lt(ch, vD));
      run(t0, ci_sel0(ok, ch), ok, vsel0(ok, ci_f16lo(ci_srlv(w, s16))));
    }
  }
}

// K: S[m][t] += Q[m][ch] * delta for every slot of tokens [0, nt). DN: the head size as a
// constant (64 / 128 / 256: vtab's lookups unrolled, no branch on D per row), 0: D at run
// time. The lambda works on locals: every vector store may alias (the intrinsics' types
// are may_alias), and through the closure M, D, Q and S were reloaded after each row.
template <int DN>
static void outlier_fix_k_d(const kvq::Codec& c, const TileSrc& ts, int nt, int M, int Drt,
                            const float* Q, float* S) {
  const int D = DN ? DN : Drt;
  for_slots(c, ts, 0, nt, D,
            [&](int t0, VI ch, VM ok, VF delta) {
              const int Ml = M, Dl = DN ? DN : D;
              const float* const Ql = Q;
              float* const sl = S + t0;
              for (int m = 0; m < Ml; ++m) {
                float* s = sl + m * SL;
                vstore(s, vfma(vtab(Ql + (int64_t)m * Dl, Dl, ch, ok), delta, vload(s)));
              }
            },
            [&](const OutlierBatch& ob, int n) {
              for (int m = 0; m < M; ++m) {
                const float* q = Q + (int64_t)m * D;
                float* s = S + m * SL;
                for (int i = 0; i < n; ++i) s[ob.t[i]] += q[ob.ch[i]] * ob.delta[i];
              }
            });
}
static void outlier_fix_k(const kvq::Codec& c, const TileSrc& ts, int nt, int M, int D,
                          const float* Q, float* S) {
  switch (D) {
    case 64: outlier_fix_k_d<64>(c, ts, nt, M, D, Q, S); return;
    case 128: outlier_fix_k_d<128>(c, ts, nt, M, D, Q, S); return;
    case 256: outlier_fix_k_d<256>(c, ts, nt, M, D, Q, S); return;
    default: outlier_fix_k_d<0>(c, ts, nt, M, D, Q, S); return;
  }
}
// V: acc[m][ch] += P[m][t] * delta for every slot of a task's tokens. The W products of a
// run are added as quads of rows (4 rows of one token, vtr4_store) into per-channel quads
// work[g][k][ch][4] (row group g = m / 4, k = token parity: two tokens hitting one channel
// chain only every other token): one 4-float add per token and row group instead of one
// scalar read-modify-write per token and row. The work lives through the whole task
// (outlier_v_begin zeroes it, outlier_fix_v adds each tile's slots, outlier_v_rescale
// follows the online softmax's rescaling of acc, outlier_v_merge adds it to acc once):
// zeroed and merged per tile, the merge's transposes and permutation were ~40% of the
// slots' cost at 32k tokens (nuq4, 9/3/64).
// work: outlier_v_floats(M, D) floats (M <= 16: at most TT * D, the tile's decode scratch,
// which a fused decode task does not otherwise use). kind: acc's order when the fused path
// decodes V permuted (K_U4 / K_U2), -1: channel order. work stays in channel order and
// each row's sums are permuted once at the merge (permute_row): a lookup per token and lane
// was ~6% of a nuq2 decode at 512 tokens.
constexpr int kVFixParity = 2;
constexpr int64_t outlier_v_group_floats(int D) { return (int64_t)kVFixParity * 4 * D; }
constexpr int64_t outlier_v_floats(int M, int D) {
  return ((M + 3) / 4) * outlier_v_group_floats(D) + 4 * (int64_t)D;  // + the merge's rows
}
static_assert(outlier_v_floats(W, 1) <= TT, "outlier_fix_v's work fits a tile's rows (KV)");
static void outlier_v_begin(int M, int D, float* work) {
  const int64_t n = ((M + 3) / 4) * outlier_v_group_floats(D);
  for (int64_t x = 0; x < n; ++x) work[x] = 0.0f;
}
// softmax_tile scaled row m's acc by corr[m] (its running max rose); its sums in work get
// the same factor.
static void outlier_v_rescale(int M, int D, const float* corr, float* work) {
  const int64_t gs = outlier_v_group_floats(D);
  for (int g = 0; g < (M + 3) / 4; ++g) {
    float f[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    bool any = false;
    for (int r = 0; r < 4 && 4 * g + r < M; ++r) {
      f[r] = corr[4 * g + r];
      any |= f[r] != 1.0f;
    }
    if (!any) continue;
    float pat[W];
    for (int i = 0; i < W; ++i) pat[i] = f[i % 4];
    const VF vf = vload(pat);
    float* wg = work + g * gs;
    for (int64_t x = 0; x < gs; x += W) vstore(wg + x, vmul(vload(wg + x), vf));
  }
}
static void outlier_fix_v(const kvq::Codec& c, const TileSrc& ts, int a, int b, int M, int D,
                          const float* P, float* acc, float* work, int kind) {
  const int G = (M + 3) / 4;
  const int64_t gs = outlier_v_group_floats(D);  // floats per row group
  const int32_t* pos = kind >= 0 ? perm_inv_table(kind) : nullptr;  // (the batch path's)
  // lane i's parity block: token parity i % kVFixParity (t0 is a multiple of W, even)
  static_assert(kVFixParity == 2 && W % 2 == 0, "par_off: lane parity is token parity");
  const VI par_off = ci_mullo(ci_and(ci_iota(), ci_set1(1)), ci_set1(4 * D));
  for_slots(c, ts, a, b, D,
            [&](int t0, VI ch, VM ok, VF delta) {
              // masked-off lanes add 0 to channel 0 (P there may be anything). Locals, and
              // each lane's quad offset computed as a vector: through the closure (every
              // vector store may alias it) the per-token address arithmetic was reloaded
              // and redone in scalar code, ~40% of this function.
              const int Ml = M, Gl = G;
              const int64_t gsl = gs;
              float* const wk = work;
              const float* const pl = P + t0;
              int32_t off[W];  // parity block + 4 * channel
              const VI c2 = ci_add(ch, ch);
              ci_store(off, ci_add(ci_add(c2, c2), par_off));
              for (int g = 0; g < Gl; ++g) {
                VF pd[4];
                for (int r = 0; r < 4; ++r) {
                  const int m = 4 * g + r;
                  pd[r] = m < Ml ? vsel0(ok, vmul(vload(pl + m * SL), delta)) : vzero();
                }
                float q[4 * W];
                vtr4_store(pd, q);
                float* const wg = wk + g * gsl;
                for (int i = 0; i < W; ++i) vadd4(wg + off[i], q + 4 * i);
              }
            },
            [&](const OutlierBatch& ob, int n) {
              for (int m = 0; m < M; ++m) {
                const float* p = P + m * SL;
                float* ac = acc + (int64_t)m * D;
                for (int i = 0; i < n; ++i)
                  ac[pos ? pos[ob.ch[i]] : ob.ch[i]] += p[ob.t[i]] * ob.delta[i];
              }
            });
}
static void outlier_v_merge(int M, int D, float* acc, float* work, int kind) {
  const int G = (M + 3) / 4;
  const int64_t gs = outlier_v_group_floats(D);
  float* rows = work + G * gs;  // a row group's sums, in channel order
  for (int g = 0; g < G; ++g) {
    const int nr = imin(4, M - 4 * g);
    for (int d = 0; d < D; d += W) {
      VF sum[4];
      vtr4_load(work + g * gs + 4 * d, sum);
      for (int k = 1; k < kVFixParity; ++k) {
        VF x[4];
        vtr4_load(work + g * gs + k * 4 * D + 4 * d, x);
        for (int r = 0; r < 4; ++r) sum[r] = vadd(sum[r], x[r]);
      }
      for (int r = 0; r < nr; ++r) vstore(rows + (int64_t)r * D + d, sum[r]);
    }
    for (int r = 0; r < nr; ++r) {
      float* x = rows + (int64_t)r * D;
      float* ar = acc + (int64_t)(4 * g + r) * D;
      if (kind >= 0) permute_row(x, D, kind, x);
      for (int d = 0; d < D; d += W) vstore(ar + d, vadd(vload(ar + d), vload(x + d)));
    }
  }
}

// ---- integer Q.K ---------------------------------------------------------------------------
// For int keys (8/4/3/2 bits) and nuq keys (4/3/2 bits; IntKey, int_qk_ok) the fused decode
// path computes logits in the integer domain. Once per task each query row q (already
// times softmax_scale*log2 e) is rounded to int8 with one scale per row:
//     qs = max|q| / 127,  q8 = rint(q * 127 / max|q|),  q^ = qs * q8.
// A key value is code * s + z (sym: z = -2^(b-1) s), so for a per-token / per-group scale
//     q^ . k = qs * sum_g s_g * (sum_{d in g} q8_d code_d) + sum_g z_g * (qs * sum_{d in g} q8_d)
// where the inner sums are exact integer dot products (vpdpbusd: u8 code x s8 query, or
// vpmaddubsw/vpmaddwd on AVX2, the same integers on every path). The result is the exact
// attention of the rounded query q^ (the staging keys of the task read q^ too), i.e. an
// approximation of the query, not of the cache: |q - q^| <= qs / 2 per element.
// Per-channel keys (GRAN_CHANNEL, KIVI): the channel scales fold into the query once per
// scale row: q' = q * s (rounded to int8 with its own row scale qs'), zsum = q . z exact, and
// each token's logit is qs' * (q'8 . code) + zsum.
// Measured error (benchmarks/int8_query_error.py: relative L2 error of each decode row's
// output vs KVQ_EXACT_QK=1, head_dim 64, 256 keys, random queries): per-token / per-group
// keys mean 5.7e-3..6.6e-3, max 1.4e-2 on random K/V, mean 1.6e-3..4.2e-3, max 2.7e-2 on
// captured SmolLM2-135M K/V (layers 0/15/29); per-channel keys (kivi4/kivi2) mean 1.3e-2,
// max 3.1e-2 random, mean 3.4e-3..4.6e-3, max 2.4e-2 captured. tests/test_kernels.py checks
// the kernels against a reference with the same rounding at the usual tight tolerances.
// KVQ_EXACT_QK=1 turns the integer Q.K off.
// The int8 query is stored in "code order" (ichan): a chunk of CW = 4W codes of CW
// consecutive channels, in the order one shift and one mask unpack a chunk's packed bytes
// (int4: the CW/2 low nibbles, then the high nibbles; int2: bit pair 0, 1, 2, 3 of its W
// bytes), so that each 4-byte word of the query multiplies one bit field of one 4-byte word
// of a key row (qk_int). (CW = 4W, defined at the top.)

static inline int ichan(int bits, int p) {
  const int c = p / CW, j = p % CW;
  if (bits == 8 || bits == 3) return p;
  if (bits == 4) return CW * c + (j < 2 * W ? 2 * j : 2 * (j - 2 * W) + 1);
  return CW * c + 4 * (j % W) + j / W;
}

// 3-bit keys the integer Q.K reads as stored (qk_int3; qk3: AttnParams::qk3): a group
// must be whole word triples (32 channels).
static inline bool int_qk_raw3(const kvq::Codec& c, bool qk3) {
  return qk3 && c.bits == 3 && (c.granularity != kvq::GRAN_GROUP || c.group % 32 == 0);
}
// The code width the integer Q.K reads a key codec with (3-bit codes it cannot read as
// stored are repacked to 4).
static inline int int_qk_bits(const kvq::Codec& c, bool qk3) {
  return c.bits == 3 && !int_qk_raw3(c, qk3) ? 4 : c.bits;
}
// The query's code order for that width (3 bits: channel order, like 8).
static inline int int_qk_order(int bits) { return kPermInt + (bits == 3 ? 8 : bits); }

// Whether the integer Q.K handles this key codec at this head size: int 8/4/3/2 and nuq
// 4/3/2 codes (nuq levels through a byte table, IntKey), with or without outlier slots
// (corrected after the integer dot products, like the fused path's). nuq3 keys only where
// 3-bit rows are read as stored (qk3): repacking them to 4 bits cost more than the integer
// dots save (Zen 4, 9/3/64 4 x 4k, one thread: 0.74 ms vs 0.68 on the fp32 path; AVX2 path
// 1.40 vs 1.08), while int3's fp32 path unpacks to bytes first and the repack wins (1.85 vs
// 3.06 ms).
#if KVQ_HAS_QK3
// Per-channel keys of 4/2-bit codes where the path permutes bytes (qk3; CW = 64): the query
// folds in channel order and each folded int8 row is permuted into the code order after
// (idx: ichan of one 64-channel chunk), one byte permute per 64 channels instead of the
// permuted fp32 copy (permute_row) of each scale row and zero row.
static KVQ_QK3_TARGET void fold_perm(int8_t* q8, int rows, int D, const uint8_t* idx) {
  for (int64_t x = 0; x < (int64_t)rows * D; x += 64) q8_perm64(q8 + x, idx, q8 + x);
}
#endif

static inline bool int_qk_ok(const kvq::Codec& c, int D, bool qk3) {
  if (c.encoding != kvq::ENC_INT && c.encoding != kvq::ENC_NUQ) return false;
  if (c.bits != 8 && c.bits != 4 && c.bits != 3 && c.bits != 2) return false;
  if (c.encoding == kvq::ENC_NUQ && c.bits == 3 && !int_qk_raw3(c, qk3)) return false;
  if (D % CW || D > 512) return false;
  switch (c.granularity) {
    case kvq::GRAN_TOKEN: case kvq::GRAN_TENSOR: case kvq::GRAN_HEAD: case kvq::GRAN_CHANNEL:
      return true;
    case kvq::GRAN_GROUP:  // every 4-byte word of a row within one group
      return c.group % (int_qk_raw3(c, qk3) ? 32 : 32 / int_qk_bits(c, qk3)) == 0 &&
             D % c.group == 0;
    default: return false;
  }
}

// The bit fields of one 4-byte word per token lane: x[k] = field k of every byte.
template <int BITS>
static inline void code_fields(VI w, VI* x) {
  if (BITS == 8) {
    x[0] = w;
  } else if (BITS == 4) {
    x[0] = ci_field<0>(w, 15);
    x[1] = ci_field<4>(w, 15);
  } else {
    x[0] = ci_field<0>(w, 3);
    x[1] = ci_field<2>(w, 3);
    x[2] = ci_field<4>(w, 3);
    x[3] = ci_field<6>(w, 3);
  }
}

// The key rows of tokens [t0, t0 + W) (past tb: the last one again) as ncol transposed row
// words: col[j] lane i = word j of token t0 + i's row (ci_tr8).
static inline void transpose_words(const TileSrc& ts, int t0, int tb, int ncol, VI* col) {
  const uint8_t* rows[W];
  for (int i = 0; i < W; ++i) rows[i] = ts.row[imin(t0 + i, tb - 1)];
  for (int j = 0; j < ncol; j += 8) ci_tr8(rows, 4 * j, imin(8, ncol - j), col + j);
}
// A token pass's logits after scale group g: the group's integer dot d = a0 + a1 (!GRP: the
// whole row's), times the group's transposed scales sT[g * TT + lane] (GRP), summed in
// group order (the reference's order).
template <bool GRP>
static inline VF qk_group_sum(VI a0, VI a1, int g, const float* sT, VF f) {
  const VF d = ci_tof(ci_add(a0, a1));
  if (!GRP) return d;
  return g == 0 ? vmul(d, vload(sT)) : vfma(d, vload(sT + g * TT), f);
}
// The first min(n, W) lanes of v to dst.
static inline void store_lanes(float* dst, VF v, int n) {
  if (n >= W) {
    vstore(dst, v);
  } else {
    float tmp[W];
    vstore(tmp, v);
    for (int i = 0; i < n; ++i) dst[i] = tmp[i];
  }
}

// S[m][t] for tokens [ta, tb) and MB rows (q8: MB rows of D bytes in code order), W tokens
// per pass, one token per int32 lane: the pass's key rows are transposed into 4-byte words
// (col[j] lane i = word j of token i's row) and each word's bit fields are multiplied with
// the query's matching 4-byte word broadcast to every lane (vpdpbusd: 4 u8 x s8 products per
// lane), so no horizontal reduction is needed.
//  !GRP: S = the integer dot q8 . code (as float);
//   GRP: S = sum over groups g (cpg words each) of sT[g][t] * (group g's integer dot), sT the
//        tile's scales transposed (TT floats per group), groups in order.
// Word j of a row holds channels [j * 32 / BITS, (j + 1) * 32 / BITS); within the query's
// chunk c = j / DPC its field k sits at word c * W + k * DPC + j % DPC.
// LUT (nuq, BITS < 8): each code c is replaced by lut[c] (a byte, vpshufb) before the dot.
template <int BITS, bool GRP, int MB, bool LUT>
static void qk_int(const int8_t* q8, int D, const TileSrc& ts, int ta, int tb, int cpg,
                   const float* sT, float* S, const uint8_t* lut) {
  constexpr int MR = MB < 4 ? MB : 4;  // rows per pass over the transposed words
  constexpr int NK = 8 / BITS;         // codes per byte
  constexpr int DPC = W * BITS / 8;    // row words per chunk of CW codes
  [[maybe_unused]] constexpr bool SMALL = BITS < 8;  // codes < 16, or nuq levels <= 127
  constexpr bool WIDE = BITS == 8 && !LUT;  // 8-bit codes: ci_dot_wide
  const VI tab = LUT ? ci_tab16(lut) : ci_zero();
  const int ncol = D * BITS / 32;
  const int per = GRP ? cpg : ncol, ngrp = ncol / per;
  VI col[128];
  // WIDE with a bias: kCiWideBias * each row's query sum over each group's channels
  // (word j: query bytes 4j..4j+3), added to the group's dot
  constexpr bool BIAS = WIDE && kCiWideBias != 0;
  int32_t qbias[BIAS ? MB : 1][BIAS ? 128 : 1];
  if (BIAS)
    for (int m = 0; m < MB; ++m)
      for (int g = 0; g < ngrp; ++g) {
        int32_t sum = 0;
        for (int b = 4 * g * per; b < 4 * (g + 1) * per; ++b) sum += q8[(int64_t)m * D + b];
        qbias[m][g] = kCiWideBias * sum;
      }
  for (int t0 = ta; t0 < tb; t0 += W) {
    transpose_words(ts, t0, tb, ncol, col);
    if (ts.next) ts.next->step(imin(W, tb - t0));
    for (int m0 = 0; m0 < MB; m0 += MR) {
      const int8_t* qm = q8 + (int64_t)m0 * D;
      VF f[MR];
      for (int r = 0; r < MR; ++r) f[r] = vzero();  // (ngrp >= 1; for the compiler)
      for (int g = 0; g < ngrp; ++g) {
        // two accumulator sets (alternate words / fields) halve each vpdpbusd chain
        VI a0[MR], a1[MR];
        for (int r = 0; r < MR; ++r) a0[r] = a1[r] = ci_zero();
        auto word = [&](int j, VI (&acc0)[MR], VI (&acc1)[MR]) {
          VI x[NK];
          code_fields<BITS>(col[j], x);
          if (LUT)
            for (int k = 0; k < NK; ++k) x[k] = ci_lut16(x[k], tab);
          const int8_t* qw = qm + 4 * ((j / DPC) * W + j % DPC);
          if constexpr (WIDE) {
            const CiWide c = ci_wide(x[0]);
            for (int r = 0; r < MR; ++r)
              acc0[r] = ci_dot_wide(acc0[r], c, ci_bcast4(qw + (int64_t)r * D));
          } else {
            for (int k = 0; k < NK; ++k)
              for (int r = 0; r < MR; ++r) {
                VI& acc = (k & 1) ? acc1[r] : acc0[r];
                acc = ci_dot<SMALL>(acc, x[k], ci_bcast4(qw + (int64_t)r * D + 4 * k * DPC));
              }
          }
        };
        int j = g * per;
        const int je = j + per;
        if (NK > 1) {
          for (; j < je; ++j) word(j, a0, a1);
        } else {
          for (; j + 2 <= je; j += 2) {
            word(j, a0, a1);
            word(j + 1, a1, a0);
          }
          if (j < je) word(j, a0, a1);
        }
        if (BIAS)
          for (int r = 0; r < MR; ++r) a0[r] = ci_add(a0[r], ci_set1(qbias[m0 + r][g]));
        for (int r = 0; r < MR; ++r) f[r] = qk_group_sum<GRP>(a0[r], a1[r], g, sT + t0, f[r]);
      }
      for (int r = 0; r < MR; ++r) store_lanes(S + (int64_t)(m0 + r) * SL + t0, f[r], tb - t0);
    }
  }
}

#if KVQ_HAS_QK3
// qk_int for 3-bit rows as stored: each row word triple (32 codes, 4 units of 8; ci_units3)
// gives 8 words of 4 codes as bytes through the 64-byte table tab3 (ci_fields3: nuq's byte
// levels, or the codes themselves), in channel order, so the query stays in channel order
// (int_qk_order). tpg: word triples per scale group (GRP).
template <bool GRP, int MB>
static KVQ_QK3_TARGET void qk_int3(const int8_t* q8, int D, const TileSrc& ts, int ta, int tb,
                                   int tpg, const float* sT, float* S, const uint8_t* lut) {
  constexpr int MR = MB < 4 ? MB : 4;
  const VI tab = ci_tab3(lut);
  const int ncol = D * 3 / 32, ntri = D / 32;
  const int per = GRP ? tpg : ntri, ngrp = ntri / per;
  VI col[48];
  for (int t0 = ta; t0 < tb; t0 += W) {
    transpose_words(ts, t0, tb, ncol, col);
    if (ts.next) ts.next->step(imin(W, tb - t0));
    for (int m0 = 0; m0 < MB; m0 += MR) {
      const int8_t* qm = q8 + (int64_t)m0 * D;
      VF f[MR];
      for (int r = 0; r < MR; ++r) f[r] = vzero();
      for (int g = 0; g < ngrp; ++g) {
        VI a0[MR], a1[MR];  // codes 0-3 / 4-7 of each unit: two dependency chains
        for (int r = 0; r < MR; ++r) a0[r] = a1[r] = ci_zero();
        for (int i = g * per; i < (g + 1) * per; ++i) {
          VI u[4];
          ci_units3(col[3 * i], col[3 * i + 1], col[3 * i + 2], u);
          for (int k = 0; k < 4; ++k) {
            VI x[2];
            ci_fields3(u[k], tab, x);
            const int8_t* qw = qm + 32 * i + 8 * k;  // channels 32i + 8k ..
            for (int r = 0; r < MR; ++r) {
              a0[r] = ci_dot<false>(a0[r], x[0], ci_bcast4(qw + (int64_t)r * D));
              a1[r] = ci_dot<false>(a1[r], x[1], ci_bcast4(qw + (int64_t)r * D + 4));
            }
          }
        }
        for (int r = 0; r < MR; ++r) f[r] = qk_group_sum<GRP>(a0[r], a1[r], g, sT + t0, f[r]);
      }
      for (int r = 0; r < MR; ++r) store_lanes(S + (int64_t)(m0 + r) * SL + t0, f[r], tb - t0);
    }
  }
}
#endif

// f(RowsT<MB>{}) for the integer Q.K's row blocks MBq (fused_rows: 1-4, 8, 16).
template <int N>
struct RowsT { static constexpr int value = N; };
template <class F>
static inline void with_row_block(int MBq, F&& f) {
  switch (MBq) {
    case 1: f(RowsT<1>{}); return;
    case 2: f(RowsT<2>{}); return;
    case 3: f(RowsT<3>{}); return;
    case 4: f(RowsT<4>{}); return;
    case 8: f(RowsT<8>{}); return;
    default: f(RowsT<16>{}); return;
  }
}
template <int BITS, bool GRP, bool LUT>
static void qk_int_rows(int MBq, const int8_t* q8, int D, const TileSrc& ts, int ta, int tb,
                        int cpg, const float* sT, float* S, const uint8_t* lut) {
  with_row_block(MBq, [&](auto mb) {
    qk_int<BITS, GRP, decltype(mb)::value, LUT>(q8, D, ts, ta, tb, cpg, sT, S, lut);
  });
}
template <int BITS>
static void qk_int_bits(bool grp, int MBq, const int8_t* q8, int D, const TileSrc& ts, int ta,
                        int tb, int cpg, const float* sT, float* S, const uint8_t* lut) {
  constexpr bool L = BITS < 8;  // a table only for packed codes (nuq 4/3/2 bits)
  if (L && lut) {
    if (grp) qk_int_rows<BITS, true, L>(MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
    else qk_int_rows<BITS, false, L>(MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
  } else {
    if (grp) qk_int_rows<BITS, true, false>(MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
    else qk_int_rows<BITS, false, false>(MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
  }
}
// bits: the code width of the rows (int_qk_bits); lut: nuq's byte table or nullptr.
static void qk_int_kind(int bits, bool grp, int MBq, const int8_t* q8, int D, const TileSrc& ts,
                        int ta, int tb, int cpg, const float* sT, float* S,
                        const uint8_t* lut) {
#if KVQ_HAS_QK3
  if (bits == 3) {  // cpg = group * 3 / 32 words: whole triples (int_qk_raw3)
    with_row_block(MBq, [&](auto mb) {
      constexpr int MB = decltype(mb)::value;
      if (grp) qk_int3<true, MB>(q8, D, ts, ta, tb, cpg / 3, sT, S, lut);
      else qk_int3<false, MB>(q8, D, ts, ta, tb, cpg / 3, sT, S, lut);
    });
    return;
  }
#endif
  if (bits == 8) qk_int_bits<8>(grp, MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
  else if (bits == 4) qk_int_bits<4>(grp, MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
  else qk_int_bits<2>(grp, MBq, q8, D, ts, ta, tb, cpg, sT, S, lut);
}

// Row x[D] (code order) -> q8 = rint(x * 127 / max|x|); returns the row scale max|x| / 127
// (0 for an all-zero row; NaN/Inf when x is not finite).
// max|x| over n floats (n % W == 0), NaN when any is not finite: vmax drops NaN, so a
// second sum of x * 0 (NaN exactly for a non-finite x) carries that.
static inline float abs_max_or_nan(const float* x, int64_t n) {
  VF mx = vzero(), nf = vzero();
  for (int64_t d = 0; d < n; d += W) {
    const VF v = vload(x + d);
    mx = vmax(mx, vmax(v, vsub(vzero(), v)));
    nf = vadd(nf, vmul(v, vzero()));
  }
  return vhsum(nf) != 0.0f ? NAN : vhmax(mx);
}

// 127 / max|x| (0 for an all-zero or non-finite row): q8 = rint(x * q8_inv(max|x|)).
static inline float q8_inv(float amax) {
  return amax > 0.0f && amax <= 3.0e38f ? 127.0f / amax : 0.0f;
}
// quantize_q8 with max|x| (or NaN) already known.
static inline float quantize_q8_amax(const float* x, int D, float amax, int8_t* q8) {
  const VF vi = vset(q8_inv(amax));
  for (int d = 0; d < D; d += W) vq8_store(vload(x + d), vi, q8 + d);
  return amax / 127.0f;
}

static inline float quantize_q8(const float* x, int D, int8_t* q8) {
  return quantize_q8_amax(x, D, abs_max_or_nan(x, D), q8);
}

// ---- fused decode path ---------------------------------------------------------------------
// Decode step u of token t without scale and zero: raw codes (int) or codebook levels (nuq).
template <int KIND, bool PERM>
static inline void decode_raw(const TileSrc& ts, int t, int u, VF* out) {
  if (PERM) {
    decode_pair<KIND>(ts, t, u, out[0], out[1]);
  } else {
    out[0] = decode_codes<KIND>(ts, t, u);
  }
}

// S[m][t] = Q[m] . K[t] for tokens [ta, tb) and MB rows (MB*TB = W accumulators), K decoded
// in registers. FOLD (KVQ_FOLD_QK; per-channel keys, a run of tokens sharing one scale row
// s, z): Q is the query times s (qk_fold_rows) and K is read as stored (decode_raw: the codes
// or nuq levels), S = Q . raw + zs[m] with zs = query . z: one FMA and two loads per chunk
// and token less than decoding each key (code * s + z) first.
template <int KIND, bool VEC, bool PERM, int MB, bool FOLD = false>
static void qk_fused(const float* Q, const TileSrc& ts, int ta, int tb, int D, float* S,
                     const float* zs = nullptr) {
  constexpr int TB = W / MB, NV = PERM ? 2 : 1;
  const int nsteps = D / W / NV;
  for (int t0 = ta; t0 < tb; t0 += TB) {
    if (ts.next) ts.next->step(imin(TB, tb - t0));
    VF acc[W];
    for (int i = 0; i < W; ++i) acc[i] = vzero();
    int tk[TB];
    for (int ti = 0; ti < TB; ++ti) tk[ti] = imin(t0 + ti, tb - 1);
    for (int u = 0; u < nsteps; ++u) {
      VF kv[TB][NV];
      for (int ti = 0; ti < TB; ++ti) {
        if (FOLD) decode_raw<KIND, PERM>(ts, tk[ti], u, kv[ti]);
        else decode_step<KIND, VEC, PERM>(ts, tk[ti], u, kv[ti]);
      }
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
      for (int ti = 0; ti < TB && t0 + ti < tb; ++ti)
        S[mi * SL + t0 + ti] = FOLD ? tmp[mi * TB + ti] + zs[mi] : tmp[mi * TB + ti];
  }
}

// Qf = Q * s and zs = Q . z for n rows of Q (stride D).
static inline void qk_fold_rows(const float* Q, int n, int D, const float* s, const float* z,
                                float* Qf, float* zs) {
  for (int m = 0; m < n; ++m) {
    VF a = vzero();
    for (int d = 0; d < D; d += W) {
      const VF q = vload(Q + (int64_t)m * D + d);
      vstore(Qf + (int64_t)m * D + d, vmul(q, vload(s + d)));
      a = vfma(q, vload(z + d), a);
    }
    zs[m] = vhsum(a);
  }
}

#if KVQ_HAS_BF16DP
// qk_fused for bf16 keys and a bf16 query: S[m][t] = scale * (Qb[m] . K[t]), Qb MB rows of
// D raw bf16 (rows >= M zero). vdpbf16ps multiplies the raw bf16 pairs (exact in fp32) into
// fp32 lanes: half of qk_fused's FMAs and no widening of K. The query is scaled after the
// dot, on the logit, since bf16 could not hold q * scale exactly.
template <int MB>
static KVQ_BF16_TARGET void qk_bf16(const uint16_t* Qb, const TileSrc& ts, int nt, int D,
                                    float scale, float* S) {
  constexpr int TB = W / MB;
  const int nsteps = D / (2 * W);
  for (int t0 = 0; t0 < nt; t0 += TB) {
    if (ts.next) ts.next->step(imin(TB, nt - t0));
    VF acc[W];
    for (int i = 0; i < W; ++i) acc[i] = vzero();
    const uint16_t* kr[TB];
    for (int ti = 0; ti < TB; ++ti) kr[ti] = (const uint16_t*)ts.row[imin(t0 + ti, nt - 1)];
    for (int u = 0; u < nsteps; ++u) {
      VI kv[TB];
      for (int ti = 0; ti < TB; ++ti) kv[ti] = ci_loadu(kr[ti] + u * 2 * W);
      for (int mi = 0; mi < MB; ++mi) {
        const VI qv = ci_loadu(Qb + (int64_t)mi * D + u * 2 * W);
        for (int ti = 0; ti < TB; ++ti)
          acc[mi * TB + ti] = vdp_bf16(acc[mi * TB + ti], qv, kv[ti]);
      }
    }
    float tmp[W];
    vstore(tmp, vmul(vreduce(acc), vset(scale)));
    for (int mi = 0; mi < MB; ++mi)
      for (int ti = 0; ti < TB && t0 + ti < nt; ++ti) S[mi * SL + t0 + ti] = tmp[mi * TB + ti];
  }
}
#endif

// acc[m] += sum_{t in [a,b)} P[m][t] V[t] for MB rows, V decoded in registers; DS decode
// steps (DS*NV chunks) per pass. U token sets: with U = 2 even and odd tokens go to their
// own accumulators (summed at the end), so each accumulator's FMA chain is half as long.
// Every accumulator is one dependency chain through the tile's tokens; with fewer than ~10
// of them (AVX2 with 3 query rows: 6) the pass waits on FMA latency, not throughput.
// FOLD (per-token / per-group / static scales of int and nuq values): the scale is folded
// into the weight, acc += (P[m][t] * s[t][g]) * code, with PS[(m * ngs + g) * SL + t] =
// P[m][t] * s[t][g] prepared by the caller, which also adds sum_t P[m][t] * z[t][g] once per
// group (pv_fold_prepare / pv_fold_finish): one FMA per chunk less than decoding.
template <int KIND, bool VEC, bool PERM, int MB, int DS, bool FOLD>
static inline void pv_fused_token(const float* P, const TileSrc& ts, int t, int u0,
                                  const int* goff, const float* PS, int ngs,
                                  VF (&x)[MB][DS * (PERM ? 2 : 1)]) {
  constexpr int NV = PERM ? 2 : 1;
  VF v[DS][NV];
  for (int k = 0; k < DS; ++k) {
    if (FOLD) decode_raw<KIND, PERM>(ts, t, u0 + k, v[k]);
    else decode_step<KIND, VEC, PERM>(ts, t, u0 + k, v[k]);
  }
  for (int mi = 0; mi < MB; ++mi) {
    if (FOLD) {
      const float* ps = PS + (int64_t)mi * ngs * SL + t;
      for (int k = 0; k < DS; ++k) {
        const VF p = vset(ps[goff[k]]);
        for (int n = 0; n < NV; ++n) x[mi][k * NV + n] = vfma(p, v[k][n], x[mi][k * NV + n]);
      }
    } else {
      const VF p = vset(P[mi * SL + t]);
      for (int k = 0; k < DS; ++k)
        for (int n = 0; n < NV; ++n) x[mi][k * NV + n] = vfma(p, v[k][n], x[mi][k * NV + n]);
    }
  }
}

template <int KIND, bool VEC, bool PERM, int MB, int DS, bool FOLD, int U>
static inline void pv_fused_block(const float* P, const TileSrc& ts, int a, int b, int D,
                                  int u0, float* acc, const float* PS, int ngs) {
  constexpr int NV = PERM ? 2 : 1, DC = DS * NV;
  float* base = acc + (int64_t)u0 * NV * W;
  VF x[U][MB][DC];
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DC; ++k) {
      x[0][mi][k] = vload(base + (int64_t)mi * D + k * W);
      for (int s = 1; s < U; ++s) x[s][mi][k] = vzero();
    }
  int goff[DS];
  for (int k = 0; k < DS; ++k) goff[k] = FOLD ? (((u0 + k) * NV) >> ts.gshift) * SL : 0;
  RowStream* const next = ts.next;
  int t = a;
  while (t + U <= b) {  // runs of 16 tokens, the next tile's lines streamed between them
    const int te = t + imin(16, (b - t) / U * U);
    if (next) next->step(te - t);
    for (; t < te; t += U)
      for (int s = 0; s < U; ++s)
        pv_fused_token<KIND, VEC, PERM, MB, DS, FOLD>(P, ts, t + s, u0, goff, PS, ngs, x[s]);
  }
  for (; t < b; ++t) pv_fused_token<KIND, VEC, PERM, MB, DS, FOLD>(P, ts, t, u0, goff, PS, ngs, x[0]);
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DC; ++k) {
      VF r = x[0][mi][k];
      for (int s = 1; s < U; ++s) r = vadd(r, x[s][mi][k]);
      vstore(base + (int64_t)mi * D + k * W, r);
    }
}

template <int KIND, bool VEC, bool PERM, int MB, bool FOLD>
static void pv_fused(const float* P, const TileSrc& ts, int a, int b, int D, float* acc,
                     const float* PS, int ngs) {
  // accumulators MB*DC + DC decoded chunks + 1 broadcast within the register file
  constexpr int NV = PERM ? 2 : 1;
  constexpr int NREG = W >= 16 ? 32 : 16;  // vector registers
  constexpr int REGS = W >= 16 ? 28 : 14;
  constexpr int DC0 = REGS / (MB + 1);
  constexpr int DC1 = DC0 >= 4 ? 4 : (DC0 < NV ? NV : DC0);
  constexpr int DC1R = DC1 / NV * NV;  // DC1 rounded to NV: chunks of one pass, one set
  // two token sets when one would leave the FMAs latency-bound (< 10 chains) and both fit:
  // 2 * MB * DC accumulators + DC decoded chunks + 1 broadcast (DCU: a multiple of NV <= 2)
  constexpr int DCU0 = (NREG - 1) / (2 * MB + 1);
  constexpr int DCU = (DCU0 >= 4 ? 4 : DCU0) / NV * NV;
  constexpr int U = (MB * DC1R < 10 && DCU >= 2) ? 2 : 1;
  constexpr int DS = U == 2 ? DCU / NV : DC1 / NV;
  const int nsteps = D / W / NV;
  if (ts.next) ts.next->pace((int64_t)(nsteps / DS + nsteps % DS) * (b - a));
  int u = 0;
  for (; u + DS <= nsteps; u += DS)
    pv_fused_block<KIND, VEC, PERM, MB, DS, FOLD, U>(P, ts, a, b, D, u, acc, PS, ngs);
  for (; u < nsteps; ++u)
    pv_fused_block<KIND, VEC, PERM, MB, 1, FOLD, U>(P, ts, a, b, D, u, acc, PS, ngs);
}

// Row counts the fused kernels are instantiated for (M is padded up to one of them).
static inline int fused_rows(int M) {
  if (M <= 4) return M;  // 3 rows: W/3 tokens per block (one idle accumulator at most)
  if (M <= 8) return 8;
  return 16;
}
template <bool FOLD = false, int KIND, bool VEC, bool PERM>
static void qk_fused_kind(KT<KIND, VEC, PERM>, int MBq, const float* Q, const TileSrc& ts,
                          int ta, int tb, int D, float* S, const float* zs = nullptr) {
  switch (MBq) {
    case 1: qk_fused<KIND, VEC, PERM, 1, FOLD>(Q, ts, ta, tb, D, S, zs); return;
    case 2: qk_fused<KIND, VEC, PERM, 2, FOLD>(Q, ts, ta, tb, D, S, zs); return;
    case 3: qk_fused<KIND, VEC, PERM, 3, FOLD>(Q, ts, ta, tb, D, S, zs); return;
    case 4: qk_fused<KIND, VEC, PERM, 4, FOLD>(Q, ts, ta, tb, D, S, zs); return;
    case 8: qk_fused<KIND, VEC, PERM, (8 <= W ? 8 : 1), FOLD>(Q, ts, ta, tb, D, S, zs); return;
    default: qk_fused<KIND, VEC, PERM, (16 <= W ? 16 : 1), FOLD>(Q, ts, ta, tb, D, S, zs); return;
  }
}
template <int KIND, bool VEC, bool PERM, bool FOLD>
static void pv_fused_rows(int M, const float* P, const TileSrc& ts, int a, int b, int D,
                          float* acc, const float* PS, int ngs) {
  switch (M) {
    case 1: pv_fused<KIND, VEC, PERM, 1, FOLD>(P, ts, a, b, D, acc, PS, ngs); return;
    case 2: pv_fused<KIND, VEC, PERM, 2, FOLD>(P, ts, a, b, D, acc, PS, ngs); return;
    case 3: pv_fused<KIND, VEC, PERM, 3, FOLD>(P, ts, a, b, D, acc, PS, ngs); return;
    case 4: pv_fused<KIND, VEC, PERM, 4, FOLD>(P, ts, a, b, D, acc, PS, ngs); return;
    case 8: pv_fused<KIND, VEC, PERM, 8, FOLD>(P, ts, a, b, D, acc, PS, ngs); return;
    default: pv_fused<KIND, VEC, PERM, (16 <= W ? 16 : 8), FOLD>(P, ts, a, b, D, acc, PS, ngs);
      return;
  }
}
// Kinds whose value is raw * scale + zero with a scale per token / group / layer.
template <int KIND, bool VEC>
constexpr bool foldable() {
  return !VEC && (KIND == K_U8 || KIND == K_U4 || KIND == K_U2 || KIND == K_N4 || KIND == K_B4 ||
                  KIND == K_N3 || KIND == K_N2);
}
template <int KIND, bool VEC, bool PERM>
static void pv_fused_kind(KT<KIND, VEC, PERM>, int M, const float* P, const TileSrc& ts, int a,
                          int b, int D, float* acc, const float* PS = nullptr, int ngs = 0) {
  if (foldable<KIND, VEC>() && PS)
    pv_fused_rows<KIND, VEC, PERM, foldable<KIND, VEC>()>(M, P, ts, a, b, D, acc, PS, ngs);
  else
    pv_fused_rows<KIND, VEC, PERM, false>(M, P, ts, a, b, D, acc, PS, ngs);
}
// Row counts pv_bf16 runs (MBp); 16 rows stay on pv_fused.
static inline bool pv_bf16_rows(int MB) { return MB <= 4 || MB == 8; }
// 3-bit values pv_bf16 reads (4/2-bit ones: can_perm's): 2W channels a step, one scale each,
// rows of at least 16 bytes (pv_pairs3 reads each step's 12 as 16 inside the row).
static inline bool pv_bf16_3bit(const kvq::Codec& c, int D) {
  return c.bits == 3 && (c.encoding == kvq::ENC_INT || c.encoding == kvq::ENC_NUQ) &&
         D % (2 * W) == 0 && D * 3 / 8 >= 16 &&
         (c.granularity != kvq::GRAN_GROUP || c.group % (2 * W) == 0);
}
#if KVQ_HAS_PV_BF16
// pv_fused's FOLD for 4/3/2-bit values (int codes, nuq levels; 4/2 bits permuted) with bf16
// weights: PW[(m * ngs + g) * SL + t] = bf16(P[m][t] * s[t][g]) (the caller's PS rounded),
// two tokens per vdpbf16ps, their values as bf16 pairs through the codec's table
// (pv_pairs4 / 3 / 2: int codes < 16 are exact in bf16, nuq levels are rounded to it).
// Half of pv_fused's FMAs. Taken for a bf16 query only (AttnParams::pv_bf16, attn_body's
// caller): its output is rounded to bf16 anyway, as flash attention rounds its P to the
// value dtype; KVQ_EXACT_PV=1 keeps the fp32 weights.
template <int BITS, int MB, int DS, bool SINGLE, typename X>
static inline KVQ_PV_TARGET void pv_bf16_pair(const PvPairs& c, const TileSrc& ts, int t,
                                              int u0, const uint16_t* const* pw, int64_t rs,
                                              X (&x)[MB][2 * DS]) {
  constexpr int STEP = BITS == 16 ? 4 * W : BITS * W / 4;  // bytes per step of 2W channels
  const uint8_t* r0 = ts.row[t];
  const uint8_t* r1 = SINGLE ? r0 : ts.row[t + 1];
  VI v[2 * DS];
  for (int k = 0; k < DS; ++k) {
    const int off = (u0 + k) * STEP;
    if (BITS == 16) pv_pairs16(c, r0 + off, r1 + off, v[2 * k], v[2 * k + 1]);
    else if (BITS == 8) pv_pairs8(r0 + off, r1 + off, v[2 * k], v[2 * k + 1]);
    else if (BITS == 4) pv_pairs4(c, r0 + off, r1 + off, v[2 * k], v[2 * k + 1]);
    else if (BITS == 3) pv_pairs3(c, r0, r1, off, v[2 * k], v[2 * k + 1]);
    else pv_pairs2(c, r0 + off, r1 + off, v[2 * k], v[2 * k + 1]);
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DS; ++k) {
      const uint16_t* p = pw[k] + mi * rs + t;
      const VI w = SINGLE ? pv_bcast1(p) : pv_bcast(p);  // one token: weight 0 beside it
      for (int n = 2 * k; n < 2 * k + 2; ++n) {
        if constexpr (BITS == 8) x[mi][n] = pv_dpi(x[mi][n], w, v[n]);
        else x[mi][n] = pv_dp(x[mi][n], w, v[n]);
      }
    }
}
// pv_bf16's weights of rows [0, M) with ng scale groups: PW[(m * ng + g) * SL + t] =
// bf16(P[m][t] * s[t][g]), t in [0, nt) (W at a time; sT / zT rows g * sstride; no sT:
// bf16(P[m][t]), the weights of bf16 values), and for a full tile zp[m * ng + g] =
// sum_t P[m][t] * (z[t][g] + mid * s[t][g]) (W sums per vreduce).
static KVQ_PV_TARGET void pv_bf16_weights(const float* S, int M, int ng, const float* sT,
                                          const float* zT, int sstride, int nt, bool full,
                                          float mid, uint16_t* PW, float* zp) {
  const VF vm = vset(mid);
  VF zs[W];
  int n = 0, r0 = 0;  // sums pending, the first row-group they belong to
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < ng; ++g) {
      const float* sg = sT + g * sstride;
      const float* zg = zT + g * sstride;
      const float* pr = S + m * SL;
      uint16_t* pw = PW + ((int64_t)m * ng + g) * SL;
      VF z = vzero();
      for (int t = 0; t < nt; t += W) {
        const VF pv = vload(pr + t);
        if (!sT) {
          pv_store_bf16(pw + t, pv);
          continue;
        }
        const VF sv = vload(sg + t);
        pv_store_bf16(pw + t, vmul(pv, sv));
        if (full) z = vfma(pv, vfma(vm, sv, vload(zg + t)), z);
      }
      if (!full) continue;
      zs[n++] = z;
      if (n == W || (m == M - 1 && g == ng - 1)) {
        for (int i = n; i < W; ++i) zs[i] = vzero();
        float tmp[W];
        vstore(tmp, vreduce(zs));
        for (int i = 0; i < n; ++i) zp[r0 + i] = tmp[i];
        r0 += n;
        n = 0;
      }
    }
}
// 8-bit values (pv_i16's int16 weights): int32 sums from zero, scaled by wsc once per block.
template <bool I16> struct PvAcc { typedef VF type; };
template <> struct PvAcc<true> { typedef VI type; };
template <int BITS, int MB, int DS>
static KVQ_PV_TARGET void pv_bf16_block(const PvPairs& c, const uint16_t* PW, const TileSrc& ts,
                                        int a, int b, int D, int u0, float* acc, int ngs,
                                        const float* wsc) {
  constexpr int DC = 2 * DS;
  float* base = acc + (int64_t)u0 * 2 * W;
  typename PvAcc<BITS == 8>::type x[MB][DC];
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DC; ++k) {
      if constexpr (BITS == 8) x[mi][k] = ci_zero();
      else x[mi][k] = vload(base + (int64_t)mi * D + k * W);
    }
  const uint16_t* pw[DS];
  int gk[DS];
  for (int k = 0; k < DS; ++k) {
    gk[k] = ((u0 + k) * 2) >> ts.gshift;
    pw[k] = PW + gk[k] * SL;
  }
  const int64_t rs = (int64_t)ngs * SL;
  RowStream* const next = ts.next;
  int t = a;
  while (t + 2 <= b) {  // runs of 16 tokens, the next tile's lines streamed between them
    const int te = t + imin(16, (b - t) & ~1);
    if (next) next->step(te - t);
    for (; t < te; t += 2) pv_bf16_pair<BITS, MB, DS, false>(c, ts, t, u0, pw, rs, x);
  }
  if (t < b) pv_bf16_pair<BITS, MB, DS, true>(c, ts, t, u0, pw, rs, x);
  for (int mi = 0; mi < MB; ++mi)
    for (int k = 0; k < DS; ++k) {
      float* ar = base + (int64_t)mi * D + 2 * k * W;
      if constexpr (BITS == 8) {
        const VF sc = vset(wsc[mi * ngs + gk[k]]);
        VI lo, hi;
        pv_i16_unpair(c, x[mi][2 * k], x[mi][2 * k + 1], lo, hi);
        vstore(ar, vfma(ci_tof(lo), sc, vload(ar)));
        vstore(ar + W, vfma(ci_tof(hi), sc, vload(ar + W)));
      } else {
        vstore(ar, x[mi][2 * k]);
        vstore(ar + W, x[mi][2 * k + 1]);
      }
    }
}
template <int BITS, int MB>
static KVQ_PV_TARGET void pv_bf16(const PvPairs& c, const uint16_t* PW, const TileSrc& ts, int a,
                                  int b, int D, float* acc, int ngs, const float* wsc) {
  // MB * 2DS accumulators (<= 16: enough independent chains) + 2DS values + the constants
  constexpr int DS = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  const int nsteps = D / (2 * W);
  if (ts.next) ts.next->pace((int64_t)(nsteps / DS + nsteps % DS) * (b - a));
  int u = 0;
  for (; u + DS <= nsteps; u += DS)
    pv_bf16_block<BITS, MB, DS>(c, PW, ts, a, b, D, u, acc, ngs, wsc);
  for (; u < nsteps; ++u) pv_bf16_block<BITS, MB, 1>(c, PW, ts, a, b, D, u, acc, ngs, wsc);
}
// BITS 16 / 4 / 3 / 2: bf16 weights PW through the table tab; 8: pv_i16's int16 weights PW
// with their scales wsc.
template <int BITS>
static KVQ_PV_TARGET void pv_bf16_bits(int MB, const float* tab, const uint16_t* PW,
                                       const TileSrc& ts, int a, int b, int D, float* acc,
                                       int ngs, const float* wsc = nullptr) {
  const PvPairs c = pv_pairs_init(BITS, tab);
  switch (MB) {
    case 1: pv_bf16<BITS, 1>(c, PW, ts, a, b, D, acc, ngs, wsc); return;
    case 2: pv_bf16<BITS, 2>(c, PW, ts, a, b, D, acc, ngs, wsc); return;
    case 3: pv_bf16<BITS, 3>(c, PW, ts, a, b, D, acc, ngs, wsc); return;
    case 4: pv_bf16<BITS, 4>(c, PW, ts, a, b, D, acc, ngs, wsc); return;
    default: pv_bf16<BITS, 8>(c, PW, ts, a, b, D, acc, ngs, wsc); return;
  }
}

// pv_i16: pv_fused's FOLD for 8-bit int values with int16 weights (a bf16 query's decode,
// like pv_bf16): for each row m and scale group g the tile's weights w[t] = P[m][t] * s[t][g]
// are rounded against their largest over the row's range [a, b): PW[(m * ngs + g) * SL + t]
// = rint(w[t] / wsc), wsc[m * ngs + g] = max |w| / 32767. Two tokens' codes (u8,
// zero-extended) per vpdpwssd lane (pv_bf16 with BITS 8), summed exactly in int32 through the
// tile, scaled once per block; codes * scale + zero as in pv_fused (zp: sum_t P[m][t] *
// z[t][g]). Each weight moves by at most 2^-16 of the tile's largest (pv_bf16's bf16 weights:
// 2^-9 of each), half of pv_fused's multiply-adds and a quarter of its conversions. A
// non-finite weight makes wsc NaN (the fp32 path would give inf / NaN too). KVQ_EXACT_PV=1
// keeps the fp32 weights.
static_assert((int64_t)kTileTokens * 32767 * 255 < (int64_t{1} << 31), "pv_i16's int32 sums");
static void pv_i16_weights(const float* S, int M, int ng, const float* sT, const float* zT,
                           int sstride, int a, int b, bool full, uint16_t* PW, float* wsc,
                           float* zp) {
  const int t0 = a / W * W;
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < ng; ++g) {
      const float* sg = sT + g * sstride;
      const float* pr = S + m * SL;
      VF mx = vzero(), bad = vzero();  // bad: 0 * w, NaN where w is not finite
      for (int t = t0; t < b; t += W) {
        const VM in = (VM)(vm_first(b - t) & ~vm_first(a > t ? a - t : 0));
        const VF w = vsel0(in, vmul(vload(pr + t), vload(sg + t)));
        mx = vmax(vmax(w, vsub(vzero(), w)), mx);
        bad = vfma(w, vzero(), bad);
      }
      const float wmax = vhmax(mx), sc = wmax / 32767.0f;
      const bool finite = vhsum(bad) == 0.0f;
      wsc[m * ng + g] = finite ? sc : NAN;
      const VF inv = vset(finite && wmax > 0.0f ? 32767.0f / wmax : 0.0f);
      uint16_t* pw = PW + ((int64_t)m * ng + g) * SL;
      for (int t = t0; t < b; t += W)
        pv_store_i16(pw + t, vmul(vmul(vload(pr + t), vload(sg + t)), inv));
      if (full) {
        const float* zg = zT + g * sstride;
        VF z = vzero();
        for (int t = 0; t < b; t += W) z = vfma(vload(pr + t), vload(zg + t), z);
        zp[m * ng + g] = vhsum(z);
      }
    }
}
#endif

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
// x [D] -> row elem_off of base in dtype dt, rounded once to nearest even (torch's casts).
static inline void store_row_f(void* base, int32_t dt, int64_t elem_off, int D, const float* x) {
  if (dt == DT_F32) {
    memcpy((float*)base + elem_off, x, sizeof(float) * D);
  } else {
    uint16_t* p = (uint16_t*)base + elem_off;
    if (dt == DT_BF16) for (int d = 0; d < D; d += W) st_bf16(p + d, vload(x + d));
    else for (int d = 0; d < D; d += W) st_f16(p + d, vload(x + d));
  }
}

// The rotation of rotated formats: fwht_row / scale_row, used by run_task's fused rotation
// and by the hadamard op (hadamard_rows_impl).
#include "hadamard_body.h"

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

// The attention sink's int8 rows are read by window_rows_body.h's dequantize_row_i8_f32.
namespace sink_row {
#include "window_rows_body.h"
}  // namespace sink_row
using sink_row::dequantize_row_i8_f32;

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
// Logit soft-capping (Gemma 2), in the log2 domain: x -> c tanh(x / c) with c = cap * log2 e
// (so it commutes with the log2 scaling), tanh(y) = 1 - 2 / (e^2y + 1). Every lane of the
// row: entries outside a row's valid range are never used.
static inline void soft_cap_row(float* s, int nch, float c) {
  const VF vc = vset(c), k = vset(2.0f * 1.4426950408889634f / c), one = vset(1.0f),
           two = vset(2.0f);
  for (int i = 0; i < nch; ++i) {
    const VF e = vexp2(vmul(vload(s + i * W), k));
    vstore(s + i * W, vmul(vc, vsub(one, vdiv(two, vadd(e, one)))));
  }
}

// skip0: the tile's token 0 is a sequence's position 0, read from its sink row instead
// (run_task_impl): left out of every row whose range starts there (weight exactly 0).
// corr (optional, M floats): the factor each row's acc was scaled by (1: none), for sums
// kept beside acc (outlier_v_rescale).
static void softmax_tile(float* S, int M, int nt, const int* lo, const int* hi, float* mrow,
                         float* lrow, float* acc, int D, float cap, bool skip0 = false,
                         float* corr = nullptr) {
  const int nch = (nt + W - 1) / W;
  for (int m = 0; m < M; ++m) {
    float* s = S + m * SL;
    const int a = lo[m], b = hi[m];
    if (corr) corr[m] = 1.0f;
    if (a >= b) continue;
    if (cap > 0.0f) soft_cap_row(s, nch, cap);
    if (skip0 && a == 0) s[0] = -INFINITY;  // (run_task_impl keeps such rows' b > 1)
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
        const float c = exp2f(mold - mx);
        if (corr) corr[m] = c;
        lrow[m] *= c;
        const VF vc = vset(c);
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


// Every line of the next tile is asked for (planes are in random order, and on the Zen 4
// VM the hardware prefetcher fetched almost nothing of them: prefetching every 2nd line was
// 1.8x slower than every line). With the pages in DRAM, as a served model's are (every
// layer's cache), this keeps the loads in flight. As one burst per tile it gave (2 threads,
// 16 x 32k, 9/3/64) bf16 24.3 -> 18.1 ms, int4_group32 18.9 -> 13.5; issued a share per
// kernel step (RowStream) instead, 4 x 32k, 32/8/128: bf16 21.3 -> 14.0, int4_group32
// 15.7 -> 7.1 ms, with no cost where the pages are in cache (512 tokens: 0.99-1.07).
// The lines go to L2 (prefetcht1), not L1 (prefetcht0): on the Zen 4 VM each t0 prefetch
// held one of the core's few L1 miss slots until its line arrived, so the prefetches
// themselves stalled (a third of qk_int<8>'s samples) and one core read ~7-9 GB/s; L2's miss
// queue is deeper and an L1 miss to L2 is cheap. 4 x 32k, 32/8/128, one thread: bf16 60 ->
// 40-45 ms, int8_token 41 -> 23-24, int4_group32 28 -> 24-25 (t2: the same within noise).
// Rows [off, off+cnt) of a region: scales and zero-points (separate streams of the plane:
// without them their first touch stalls the tile's preparation), outlier slots, codes.
static inline void stream_rows(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                               int off, int cnt, int D, RowStream& out) {
  if (r.scale_bytes) {
    int64_t b, n;
    if (c.granularity == kvq::GRAN_CHANNEL) {
      b = (int64_t)(off / c.group) * D * 2;
      n = (int64_t)((off + cnt - 1) / c.group - off / c.group + 1) * D * 2;
    } else {
      b = (int64_t)off * r.scale_cols * 2;
      n = (int64_t)cnt * r.scale_cols * 2;
    }
    out.add(plane + r.scale_off + b, n);
    if (r.zero_bytes) out.add(plane + r.zero_off + b, n);
  }
  if (c.outliers)
    out.add(plane + r.outlier_off + (int64_t)off * c.outliers * 4, (int64_t)cnt * c.outliers * 4);
  out.add(plane + r.data_off + (int64_t)off * r.row_bytes, (int64_t)cnt * r.row_bytes);
}

// A tile's per-group scales or zeros, [t][g] rows of ng floats (contiguous over the tile, as
// prep_segment writes them) -> out[g * TT + t] (entries t >= nt: whatever the gather reads
// inside the scratch).
static inline void transpose_tile(const float* src, int nt, int ng, float* out) {
  if (vtranspose_groups(src, nt, ng, out)) return;
  for (int g = 0; g < ng; ++g)
    for (int t = 0; t < nt; t += W) vstore(out + g * TT + t, vgather(src + (int64_t)t * ng + g, ng));
}

// ---- one task ----------------------------------------------------------------------------
// Per-channel keys on the integer Q.K: the end of the run of tokens from t sharing t's
// scale row. Each scale row of a tile has its own buffer (prep_segment), so equal pointers
// bound a run: a step of W, then a binary search in the last step.
static inline int run_end(const float* const* sv, int t, int nt) {
  const float* p = sv[t];
  int e = t + 1;
  while (e + W - 1 < nt && sv[e + W - 1] == p) e += W;
  int hi = imin(nt, e + W - 1);  // sv[hi] != p (or hi == nt); sv[e - 1] == p
  while (e < hi) {
    const int mid = (e + hi) / 2;
    if (sv[mid] == p) e = mid + 1; else hi = mid;
  }
  return e;
}

// The per-channel fold of MR query rows q (stride D) with one scale row: q' = q * s,
// rounded to int8 (q8, row scales qs), and zsum = q . z, the rows interleaved so their max
// chains overlap; q' is computed again for the rounding rather than stored and reloaded.
// max|q'| = max(max q', -min q'). A non-finite scale makes zsum NaN through s * 0 (one
// product per channel, shared by the rows), and with it every logit of the run, as the
// exact path would; a q' that overflows (finite query and scale) makes max|q'| and so qs
// inf, and the run's logits qs * 0 + zsum NaN too.
template <int MR>
static inline void fold_rows(const float* q, int D, const float* sc, const float* zc,
                             float* qs, float* zsum, int8_t* q8) {
  VF zs[MR], mx[MR], mn[MR], nf = vzero();
  for (int r = 0; r < MR; ++r) zs[r] = mx[r] = mn[r] = vzero();
  for (int d = 0; d < D; d += W) {
    const VF s = vload(sc + d), z = vload(zc + d);
    nf = vfma(s, vzero(), nf);
    for (int r = 0; r < MR; ++r) {
      const VF qv = vload(q + (int64_t)r * D + d), x = vmul(qv, s);
      mx[r] = vmax(mx[r], x);
      mn[r] = vmin(mn[r], x);
      zs[r] = vfma(qv, z, zs[r]);
    }
  }
  const float nan_or_0 = vhsum(nf);
  VF inv[MR];
  for (int r = 0; r < MR; ++r) {
    const float amax = vhmax(vmax(mx[r], vsub(vzero(), mn[r])));  // one reduction, same max
    inv[r] = vset(q8_inv(amax));
    qs[r] = amax / 127.0f;  // quantize_q8_amax's
    zsum[r] = vhsum(zs[r]) + nan_or_0;
  }
  for (int d = 0; d < D; d += W) {
    const VF s = vload(sc + d);
    for (int r = 0; r < MR; ++r)
      vq8_store(vmul(vload(q + (int64_t)r * D + d), s), inv[r], q8 + (int64_t)r * D + d);
  }
}

static void run_task_impl(const AttnParams& P, const AttnTask& T, float* scratch) {
  const int D = P.D, gq = P.gq, B = P.B, R = P.R;
  const int M = T.nq * gq;
  const int Mp = M < W ? W : M;  // rows allocated (fused kernels pad up to W rows)
  // Fused decode path: one query token (all rows share one valid range), rows fit a block.
  const bool fused = T.nq == 1 && M <= W;
  const int MBq = fused ? fused_rows(M) : 0;
  const int MBp = fused ? (M <= 4 ? M : fused_rows(M)) : 0;
  const bool vperm = fused && can_perm(P.vc, D, true);
  const int vpk = vperm ? (P.vc.bits == 4 ? K_U4 : K_U2) : -1;
  // integer Q.K (below)
  bool iqk = fused && T.decode && P.int_qk && int_qk_ok(P.kc, D, P.qk3);
  // bf16 keys and a bf16 query: the decode Q.K by vdpbf16ps on the raw query (qk_bf16);
  // decodes only, like the int8 query, so a prefill chunk computes what a whole prefill does
  const bool qbf = KVQ_HAS_BF16DP && fused && T.decode && P.bf16dp && !P.rot_q &&
                   P.kc.encoding == kvq::ENC_BF16 &&
                   P.dtype == DT_BF16 && D % (2 * W) == 0;

  float* Q = scratch;
  float* Qk = Q + (size_t)Mp * D;  // Q in the K side's decode order (permuted or = Q)
  float* acc = Qk + (size_t)Mp * D;
  float* S = acc + (size_t)Mp * D;
  float* KV = S + (size_t)Mp * SL;
  TileBufs tb;
  float* mrow = carve_tile_bufs(KV + (size_t)TT * D, D, tb);
  float* lrow = mrow + Mp;
  int* lo = (int*)(lrow + Mp);
  int* hi = lo + Mp;
  int* Fq = hi + Mp;
  int* pq = Fq + Mp;
  // integer Q.K
  int8_t* q8 = (int8_t*)(pq + Mp);                  // Mp * D int8 query (code order)
  float* qsc = (float*)(q8 + (size_t)Mp * D);       // Mp row scales
  float* qsum = qsc + Mp;                           // Mp * ng: qs * group sums of q8
  float* zt = qsum + (size_t)Mp * (D / 4);          // TT * ng: the tile's zeros, transposed
  float* skT = zt + (size_t)TT * (D / 4);           // TT * ng: the tile's scales, transposed
  // P.V with folded value scales
  float* PS = skT + (size_t)TT * (D / 4);          // Mp * (D/16) * SL weights P * s
  float* vsT = PS + (size_t)Mp * (D / 16) * SL;     // (D/16) * TT value scales, transposed
  float* vzT = vsT + (size_t)(D / 16) * TT;         // (D/16) * TT value zeros, transposed
  float* zp = vzT + (size_t)(D / 16) * TT;          // Mp * (D/16): sum_t P z
  // per-channel keys on the integer Q.K: each scale row's fold of the tile (fold_rows)
  float* run_qs = zp + (size_t)Mp * (D / 16);       // kTileChanRows * Mp row scales
  float* run_zs = run_qs + (size_t)kTileChanRows * Mp;  // kTileChanRows * Mp: q . z
  int8_t* run_q8 = (int8_t*)(run_zs + (size_t)kTileChanRows * Mp);  // kTileChanRows * Mp * D
  // per-channel keys on the fp32 Q.K: the query with a run's scale row folded in (Mp * D)
  [[maybe_unused]] float* qfold =
      (float*)(((uintptr_t)(run_q8 + (size_t)kTileChanRows * Mp * D) + 63) & ~(uintptr_t)63);

  for (int i = 0; i < T.nq; ++i) {
    const int p = T.pos0 + i;
    pq[i] = p;
    Fq[i] = (p + 1) / R * R;
    for (int g = 0; g < gq; ++g) {
      const int m = i * gq + g, hq = T.h * gq + g;
      float* q = Q + (int64_t)m * D;
      const int64_t qo = (int64_t)(T.tok0 + i) * P.q_st + (int64_t)hq * P.q_sh;
      if (!P.rot_q) {
        load_row_f(P.q, P.dtype, qo, D, P.scale_log2, q);
      } else {  // rotation.rotate's fp32 transform (the row not rounded), then the scale
        load_row_f(P.q, P.dtype, qo, D, 1.0f, q);
        scale_row(q, P.rot_sc, D);
        fwht_row(q, D);
        const VF sl = vset(P.scale_log2);
        for (int d = 0; d < D; d += W) vstore(q + d, vmul(vload(q + d), sl));
      }
    }
  }
  // Rows the kernels read: a fused decode runs MBq / MBp rows (M of them real), the other
  // paths Mp; zeroing only those saves a 16-row clear per task (12 KB at D = 64).
  const int Mz = fused ? std::max(M, std::max(MBq, MBp)) : Mp;
  for (int64_t x = (int64_t)M * D; x < (int64_t)Mz * D; ++x) Q[x] = 0.0f;
  for (int64_t x = 0; x < (int64_t)Mz * D; ++x) acc[x] = 0.0f;
  for (int64_t x = 0; x < (int64_t)Mz * SL; ++x) S[x] = 0.0f;
  for (int m = 0; m < Mp; ++m) {
    mrow[m] = -INFINITY;
    lrow[m] = 0.0f;
  }
  // The fused path's value outlier slots: their sums live in KV (the scratch path's tile
  // rows, unused by a fused task) through the paged loop (outlier_fix_v).
  const bool vfix = fused && P.vc.outliers > 0;
  if (vfix) outlier_v_begin(M, D, KV);
  // fp8 scales in the fused path: static ones fold into Q (K) and into acc after the paged
  // loop (V); per-token ones into the logits (K) and into P (V).
  const bool kfp8 = fused && (P.kc.encoding == kvq::ENC_FP8_E4M3 ||
                              P.kc.encoding == kvq::ENC_FP8_E5M2);
  const bool vfp8 = fused && (P.vc.encoding == kvq::ENC_FP8_E4M3 ||
                              P.vc.encoding == kvq::ENC_FP8_E5M2);
  const bool ktok = P.kc.granularity == kvq::GRAN_TOKEN, vtok = P.vc.granularity == kvq::GRAN_TOKEN;
  // P.V with the value scale folded into P (see pv_fused_block FOLD)
  const bool vfold = fused && (P.vc.encoding == kvq::ENC_INT || P.vc.encoding == kvq::ENC_NUQ) &&
                     P.vc.granularity != kvq::GRAN_CHANNEL && P.vc.granularity != kvq::GRAN_NONE;
  const int vng = P.vc.granularity == kvq::GRAN_GROUP ? D / P.vc.group : 1;
  if (vfold)  // rows >= M of the folded weights stay 0 (the kernels run MBp >= M rows)
    for (int64_t x = (int64_t)M * vng * SL; x < (int64_t)MBp * vng * SL; ++x) PS[x] = 0.0f;
  // bf16 weights for the decode P.V of a bf16 query (pv_bf16), in PS's storage: PW rows
  // indexed like PS's, rows >= M zero. Its table holds the codes (nuq: levels) minus their
  // midpoint vmid, and the zero-point sums take z + vmid * s: the rounded weights then
  // multiply values centred on the token's range, not up to twice its largest value.
  const bool vbf = KVQ_HAS_PV_BF16 && vfold && T.decode && P.pv_bf16 && P.dtype == DT_BF16 &&
                   pv_bf16_rows(MBp) && (vperm || pv_bf16_3bit(P.vc, D));
  // bf16 values: the same with P itself (no scales, values as stored)
  const bool vbv = KVQ_HAS_PV_BF16 && fused && T.decode && P.pv_bf16 && P.dtype == DT_BF16 &&
                   P.vc.encoding == kvq::ENC_BF16 && D % (2 * W) == 0 && pv_bf16_rows(MBp);
  // int16 weights for the decode P.V of a bf16 query on 8-bit int values (pv_i16), in PS's
  // storage like PW; pvi_sc: their scales per row and group
  const bool vi16 = KVQ_HAS_PV_BF16 && vfold && T.decode && P.pv_i16 && P.dtype == DT_BF16 &&
                    P.vc.encoding == kvq::ENC_INT && P.vc.bits == 8 && D % (2 * W) == 0 &&
                    (P.vc.granularity != kvq::GRAN_GROUP || P.vc.group % (2 * W) == 0) &&
                    pv_bf16_rows(MBp) && MBp * vng <= 128;
  [[maybe_unused]] float pvi_sc[128];
  uint16_t* PW = (uint16_t*)PS;
  [[maybe_unused]] float pvtab[16];
  float vmid = 0.0f;
  if (vbf || vi16)
    for (int64_t x = (int64_t)M * vng * SL; x < (int64_t)MBp * vng * SL; ++x) PW[x] = 0;
  if (vi16)
    for (int x = M * vng; x < MBp * vng; ++x) pvi_sc[x] = 0.0f;
  if (vbf) {
    const int n = 1 << P.vc.bits;
    float lmin = INFINITY, lmax = -INFINITY;
    for (int i = 0; i < 16; ++i) {
      pvtab[i] = P.vc.encoding == kvq::ENC_NUQ ? (P.v_levels ? P.v_levels[i % n] : 0.0f)
                                               : (float)(i % n);
      lmin = std::min(lmin, pvtab[i]);
      lmax = std::max(lmax, pvtab[i]);
    }
    vmid = 0.5f * (lmin + lmax);
    for (int i = 0; i < 16; ++i) pvtab[i] -= vmid;
  }
  // Integer Q.K: only for finite query rows (a NaN/Inf query takes the exact path, which
  // propagates it like the reference).
  if (iqk) iqk = abs_max_or_nan(Q, (int64_t)M * D) <= 3.0e38f;  // NaN compares false
  // The key codec's form for the integer Q.K (IntKey): nuq levels as bytes u = rint((level -
  // lmin) * kNuqKeyLevelMax / (lmax - lmin)) (a codebook with one level stays on the exact
  // path).
  IntKey ik{};
  ik.repack3 = P.kc.bits == 3 && !int_qk_raw3(P.kc, P.qk3);
  ik.pdep = P.fast_pdep != 0;
  ik.nuq = P.kc.encoding == kvq::ENC_NUQ;
  if (iqk && ik.nuq) iqk = nuq_byte_form(P.k_levels, P.kc.bits, kNuqKeyLevelMax, ik);
  const IntKey* ikp = iqk && (P.kc.bits == 3 || ik.nuq) ? &ik : nullptr;
  // nuq 4-bit values in the fused P.V on a path without a 16-float table lookup (pv_byte):
  // byte levels over [0, kNuqValueLevelMax] (K_B4, IntKey's affine form of the value scale
  // rows). Each level moves by at most 1/510 of the codebook's range.
  IntKey vik{};
  vik.nuq = true;
  const bool vbyte = KVQ_HAS_PV_BYTE && fused && P.pv_byte && !vbf &&
                     P.vc.encoding == kvq::ENC_NUQ && P.vc.bits == 4 && P.v_levels &&
                     nuq_byte_form(P.v_levels, 4, kNuqValueLevelMax, vik);
  const uint8_t* klut = iqk && ik.nuq ? ik.lut : nullptr;
  const bool ichn = iqk && P.kc.granularity == kvq::GRAN_CHANNEL;
  const bool igrp = iqk && P.kc.granularity == kvq::GRAN_GROUP;
  const int kbits = int_qk_bits(P.kc, P.qk3);
  const int kord = int_qk_order(kbits);  // the int8 query's code order
  const int ng = igrp ? D / P.kc.group : 1;
  const bool kperm = fused && !iqk && can_perm(P.kc, D);
  // per-channel keys folded in channel order, then the folded bytes permuted (fold_perm)
  const bool kfperm = KVQ_HAS_QK3 && ichn && P.qk3 && CW == 64 && (kbits == 4 || kbits == 2);
  [[maybe_unused]] uint8_t fidx[64];
  if (kfperm)
    for (int p = 0; p < 64; ++p) fidx[p] = (uint8_t)ichan(kbits, p);
  const int kpk = kperm ? (P.kc.bits == 4 ? K_U4 : K_U2) : (ichn && !kfperm ? kord : -1);
  // Per-channel int / nuq keys on the fp32 fused Q.K (nuq3 keys; any per-channel keys with
  // KVQ_EXACT_QK=1): on the paths with KVQ_FOLD_QK each scale row is folded into the query
  // (qk_fused's FOLD; W / MBq tokens a block: 8, 4, 2, 2 or 1, whole blocks per 32- or
  // 16-token group).
  [[maybe_unused]] const bool kfold =
      KVQ_FOLD_QK && fused && !iqk && !qbf && P.kc.granularity == kvq::GRAN_CHANNEL &&
      (P.kc.encoding == kvq::ENC_INT || P.kc.encoding == kvq::ENC_NUQ);
  if (iqk) {
    // Q in code order (the kernels read MBq rows); per-token / per-group / static keys: the
    // int8 rows, their scales, qs * (each group's sum of q8), and Q itself rounded (the
    // staging keys read the rounded query too). Groups are >= W channels: whole vectors.
    if (!kfperm)  // (kfperm: the folds read Q)
      for (int m = 0; m < MBq; ++m) permute_row(Q + (int64_t)m * D, D, kord, Qk + (int64_t)m * D);
    if (!ichn) {
      const int gv = igrp ? P.kc.group / W : D / W;  // vectors per group
      for (int m = 0; m < MBq; ++m) {
        const float amax = abs_max_or_nan(Qk + (int64_t)m * D, D);
        qsc[m] = quantize_q8_amax(Qk + (int64_t)m * D, D, amax, q8 + (int64_t)m * D);
        if (m >= M) continue;  // zero rows: q8 = 0
        float* qr = Q + (int64_t)m * D;
        const VF inv = vset(q8_inv(amax)), sc = vset(qsc[m]);
        for (int g = 0; g < ng; ++g) {
          VF sum = vzero();
          for (int c = g * gv; c < (g + 1) * gv; ++c) {
            const VF r = vround(vmul(vload(qr + c * W), inv));  // the integers q8 holds
            sum = vadd(sum, r);
            vstore(qr + c * W, vmul(r, sc));
          }
          qsum[m * ng + g] = vhsum(sum) * qsc[m];  // integer sums: exact in any order
        }
      }
    }
  } else if (kperm) {
    for (int m = 0; m < Mp; ++m) permute_row(Q + (int64_t)m * D, D, kpk, Qk + (int64_t)m * D);
  } else if (kfp8 && !ktok) {
    const float f = P.k_scale[T.h] * (P.kc.encoding == kvq::ENC_FP8_E4M3 ? 256.0f : 1.0f);
    for (int64_t x = 0; x < (int64_t)Mp * D; ++x) Qk[x] = Q[x] * f;
  } else {
    Qk = Q;
  }
  // qk_bf16's rows of the raw query (MBq rows, zero past M) in Qk's own storage, unused
  // since Qk = Q for bf16 keys
  uint16_t* Qb = (uint16_t*)(Q + (size_t)Mp * D);
  if (qbf)
    for (int m = 0; m < MBq; ++m) {
      const uint16_t* src = (const uint16_t*)P.q + (int64_t)T.tok0 * P.q_st +
                            (int64_t)(T.h * gq + m) * P.q_sh;
      for (int d = 0; d < D; ++d) Qb[(int64_t)m * D + d] = m < M ? src[d] : 0;
    }

  // Paged keys: query i reads positions < F_i (position 0 from the sink with sink0).
  const bool sink0 = P.lay.k.sink_bytes > 0 && T.kbeg == 0 && T.kend > 0;
  const int32_t* btrow = P.bt + (int64_t)T.s * P.bt_stride;
  const uint8_t* hbase = P.cache + (int64_t)T.h * P.c_sh;
  const float kst = P.k_scale[T.h], vst = P.v_scale[T.h];
  struct Seg { const uint8_t* plane; int off, cnt, at; };
  Seg segs[TT / 16 + 2];
  TileSrc ks, vs;
  RowStream kstream, vstream;
  ks.next = &kstream;
  vs.next = &vstream;
  ks.gshift = vs.gshift = 30;
  set_levels(P.kc, P.k_levels, ks);
  set_levels(P.vc, P.v_levels, vs);
  memcpy(vs.blev, vik.lut, 16);  // lut[0] == 0 (ld_b4)
  for (int j = T.kbeg; j < T.kend;) {
    const int jt0 = j;
    int nt = 0, ns = 0, nkc = 0;
    while (nt < TT && j < T.kend) {
      const int blk = j / B, off = j % B;
      const int cnt = imin(imin(TT - nt, B - off), T.kend - j);
      const uint8_t* plane = hbase + (int64_t)btrow[blk] * P.c_sb;
      segs[ns++] = Seg{plane, off, cnt, nt};
      prep_segment(P.kc, P.lay.k, plane, off, cnt, nt, D, kst, tb, nkc, ks, kpk, P.k_levels,
                   fused, ikp);
      nt += cnt;
      j += cnt;
    }
    // The next tile's lines (K and V), streamed in while this one is computed.
    kstream.clear();
    vstream.clear();
    for (int jn = j, left = TT; jn < T.kend && left > 0;) {
      const int off = jn % B, cnt = imin(imin(left, B - off), T.kend - jn);
      const uint8_t* np = hbase + (int64_t)btrow[jn / B] * P.c_sb;
      stream_rows(P.kc, P.lay.k, np, off, cnt, D, kstream);
      stream_rows(P.vc, P.lay.v, np, off, cnt, D, vstream);
      jn += cnt;
      left -= cnt;
    }
    kstream.pace(nt);
    vstream.pace(nt);
    for (int m = 0; m < M; ++m) {
      // a decode's window starts at kbeg (lo = 0); prefill rows start later, one by one
      lo[m] = P.window ? iclamp(pq[m / gq] - P.window + 1 - jt0, 0, nt) : 0;
      hi[m] = iclamp(Fq[m / gq] - jt0, 0, nt);
      if (sink0 && jt0 == 0 && lo[m] == 0 && hi[m] == 1) hi[m] = 0;  // only position 0
    }
    if (iqk && ichn) {
      // Per-channel scales: each scale row folds into the query (fold_rows) for its run of
      // tokens. Every fold of the tile first, then the runs' Q.K: a fold's reductions,
      // division and rounding are one long dependency chain its run's Q.K waits on, and
      // folded one run at a time the chains were serialized with the dot products.
      int rbeg[kTileChanRows + 1], nrun = 0;
      for (int t = 0; t < nt; ++nrun) {
        const int e = run_end(ks.sv, t, nt);
        const float* sc = ks.sv[t];
        const float* zc = ks.zv[t];
        rbeg[nrun] = t;
        for (int m = 0; m < MBq; m += 4)  // (with_row_block: mr is 1..4 here)
          with_row_block(imin(4, MBq - m), [&](auto r) {
            const int64_t x = (int64_t)nrun * MBq + m;
            fold_rows<decltype(r)::value>((kfperm ? Q : Qk) + (int64_t)m * D, D, sc, zc,
                                          run_qs + x, run_zs + x, run_q8 + x * D);
          });
#if KVQ_HAS_QK3
        if (kfperm) fold_perm(run_q8 + (int64_t)nrun * MBq * D, MBq, D, fidx);
#endif
        t = e;
      }
      rbeg[nrun] = nt;
      for (int r = 0; r < nrun; ++r) {
        const int t = rbeg[r], e = rbeg[r + 1];
        qk_int_kind(kbits, false, MBq, run_q8 + (int64_t)r * MBq * D, D, ks, t, e, 0, nullptr,
                    S, klut);
        for (int m = 0; m < M; ++m) {  // locals: through run_qs/zs (may alias S) it was scalar
          const float a = run_qs[r * MBq + m], b = run_zs[r * MBq + m];
          const VF va = vset(a), vb = vset(b);
          float* sm = S + m * SL;
          int u = t;
          for (; u + W <= e; u += W) vstore(sm + u, vfma(vload(sm + u), va, vb));
          for (; u < e; ++u) sm[u] = sm[u] * a + b;
        }
      }
    } else if (iqk) {
      if (igrp) transpose_tile(ks.sv[0], nt, ng, skT);
      qk_int_kind(kbits, igrp, MBq, q8, D, ks, 0, nt, P.kc.group * kbits / 32, skT, S, klut);
      if (igrp) {
        transpose_tile(ks.zv[0], nt, ng, zt);
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < nt; t += W) {
            VF a = vmul(vload(S + m * SL + t), vset(qsc[m]));
            for (int g = 0; g < ng; ++g)
              a = vfma(vload(zt + g * TT + t), vset(qsum[m * ng + g]), a);
            vstore(S + m * SL + t, a);
          }
      } else if (ktok) {  // one scale per token: contiguous over the tile
        const float* sp = ks.sv[0];
        const float* zp = ks.zv[0];
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < nt; t += W)
            vstore(S + m * SL + t,
                   vfma(vmul(vload(S + m * SL + t), vset(qsc[m])), vload(sp + t),
                        vmul(vload(zp + t), vset(qsum[m]))));
      } else {  // static scale
        for (int m = 0; m < M; ++m) {
          const float a = qsc[m] * ks.sv[0][0], b = ks.zv[0][0] * qsum[m];
          for (int t = 0; t < nt; ++t) S[m * SL + t] = S[m * SL + t] * a + b;
        }
      }
    } else if (qbf) {
#if KVQ_HAS_BF16DP
      with_row_block(MBq, [&](auto r) {
        qk_bf16<decltype(r)::value>(Qb, ks, nt, D, P.scale_log2, S);
      });
#endif
    } else if (fused) {
#if KVQ_FOLD_QK
      if (kfold) {
        // each run of tokens sharing a scale row: the row folded into the query
        for (int t = 0; t < nt;) {
          const int e = run_end(ks.sv, t, nt);
          float zs[W];
          qk_fold_rows(Qk, MBq, D, ks.sv[t], ks.zv[t], qfold, zs);
          with_kind(P.kc, kperm,
                    [&](auto k) { qk_fused_kind<true>(k, MBq, qfold, ks, t, e, D, S, zs); },
                    true);
          t = e;
        }
      } else
#endif
      with_kind(P.kc, kperm, [&](auto k) { qk_fused_kind(k, MBq, Qk, ks, 0, nt, D, S); }, true);
      if (P.kc.outliers) outlier_fix_k(P.kc, ks, nt, M, D, Qk, S);
      if (kfp8 && ktok)
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < nt; ++t) S[m * SL + t] *= ks.sv[t][0];
    } else {
      with_kind(P.kc, false, [&](auto k) { decode_tile_kind(k, ks, nt, D, KV); });
      qk_tile(Q, M, KV, nt, D, S);
    }
    // The integer Q.K's outlier slots: per-token / per-group / static keys with the rounded
    // query (Q holds it), per-channel keys with the exact one (like their zero-points).
    if (iqk && P.kc.outliers) outlier_fix_k(P.kc, ks, nt, M, D, Q, S);
    kstream.flush();
    float corr[W];  // (vfix: M <= W)
    softmax_tile(S, M, nt, lo, hi, mrow, lrow, acc, D, P.softcap_log2, sink0 && jt0 == 0,
                 vfix ? corr : nullptr);
    if (vfix) outlier_v_rescale(M, D, corr, KV);
    int nvc = 0;
    for (int k = 0; k < ns; ++k)
      prep_segment(P.vc, P.lay.v, segs[k].plane, segs[k].off, segs[k].cnt, segs[k].at, D, vst,
                   tb, nvc, vs, vpk, P.v_levels, fused, vbyte ? &vik : nullptr);
    if (fused) {
      if (vfp8 && vtok)
        for (int m = 0; m < M; ++m)
          for (int t = lo[0]; t < hi[0]; ++t) S[m * SL + t] *= vs.sv[t][0];
      const int a = lo[0], b = hi[0];
      if (a < b && vfold) {
        // PS[m][g][t] = P[m][t] * s[t][g]; zp[m][g] = sum_{t in [a,b)} P[m][t] * z[t][g]
        const float *sT, *zT;
        int sstride;
        if (P.vc.granularity == kvq::GRAN_GROUP) {
          transpose_tile(vs.sv[0], nt, vng, vsT);
          transpose_tile(vs.zv[0], nt, vng, vzT);
          sT = vsT; zT = vzT; sstride = TT;
        } else if (P.vc.granularity == kvq::GRAN_TOKEN) {
          sT = vs.sv[0]; zT = vs.zv[0]; sstride = 0;
        } else {  // static scale
          for (int t = 0; t < nt; ++t) { vsT[t] = vs.sv[0][0]; vzT[t] = vs.zv[0][0]; }
          sT = vsT; zT = vzT; sstride = 0;
        }
        const bool full = a == 0 && b == nt && nt % W == 0;
#if KVQ_HAS_PV_BF16
        if (vbf) pv_bf16_weights(S, M, vng, sT, zT, sstride, nt, full, vmid, PW, zp);
        if (vi16) pv_i16_weights(S, M, vng, sT, zT, sstride, a, b, full, PW, pvi_sc, zp);
#endif
        for (int m = 0; m < M; ++m)
          for (int g = 0; g < vng; ++g) {
            const float* sg = sT + g * sstride;
            const float* zg = zT + g * sstride;
            const float* pr = S + m * SL;
            if (!vbf && !vi16) {
              float* ps = PS + ((int64_t)m * vng + g) * SL;
              VF zs = vzero();
              for (int t = 0; t < nt; t += W) {
                const VF pv = vload(pr + t);
                vstore(ps + t, vmul(pv, vload(sg + t)));
                if (full) zs = vfma(pv, vload(zg + t), zs);
              }
              zp[m * vng + g] = vhsum(zs);
            }
            if (!full) {
              float z = 0.0f;
              for (int t = a; t < b; ++t) z += pr[t] * (zg[t] + vmid * sg[t]);
              zp[m * vng + g] = z;
            }
          }
#if KVQ_HAS_PV_BF16
        if (vbf) {
          if (P.vc.bits == 4) pv_bf16_bits<4>(MBp, pvtab, PW, vs, a, b, D, acc, vng);
          else if (P.vc.bits == 3) pv_bf16_bits<3>(MBp, pvtab, PW, vs, a, b, D, acc, vng);
          else pv_bf16_bits<2>(MBp, pvtab, PW, vs, a, b, D, acc, vng);
        } else if (vi16) {
          pv_bf16_bits<8>(MBp, nullptr, PW, vs, a, b, D, acc, vng, pvi_sc);
        } else
#endif
        with_kind(P.vc, vperm,
                  [&](auto k) { pv_fused_kind(k, MBp, S, vs, a, b, D, acc, PS, vng); }, true,
                  vbyte);
        const int gsh = vs.gshift;
        for (int m = 0; m < M; ++m)
          for (int c = 0; c < D / W; ++c) {
            float* ar = acc + (int64_t)m * D + c * W;
            vstore(ar, vadd(vload(ar), vset(zp[m * vng + (c >> gsh)])));
          }
      } else if (a < b && vbv) {
#if KVQ_HAS_PV_BF16
        // bf16 values: P rounded to bf16 (PW rows m * SL), 2 tokens per vdpbf16ps
        pv_bf16_weights(S, MBp, 1, nullptr, nullptr, 0, b, false, 0.0f, PW, nullptr);
        pv_bf16_bits<16>(MBp, nullptr, PW, vs, a, b, D, acc, 1);
#endif
      } else if (a < b) {
        with_kind(P.vc, vperm,
                  [&](auto k) { pv_fused_kind(k, MBp, S, vs, a, b, D, acc); }, true, vbyte);
      }
      if (vfix && lo[0] < hi[0])
        outlier_fix_v(P.vc, vs, lo[0], hi[0], M, D, S, acc, KV, vperm ? vpk : -1);
    } else {
      with_kind(P.vc, false, [&](auto k) { decode_tile_kind(k, vs, nt, D, KV); });
      pv_tile(S, M, KV, lo, hi, D, acc);
    }
    vstream.flush();
  }

  if (vfix) outlier_v_merge(M, D, acc, KV, vperm ? vpk : -1);
  if (vfp8 && !vtok) {
    const float f = P.v_scale[T.h] * (P.vc.encoding == kvq::ENC_FP8_E4M3 ? 256.0f : 1.0f);
    for (int64_t x = 0; x < (int64_t)M * D; ++x) acc[x] *= f;
  }
  if (vperm)  // accumulators back to channel order
    for (int m = 0; m < M; ++m) unpermute_row(acc + (int64_t)m * D, D, vpk);

  // The attention sink: position 0 from the sequence's first block's int8 rows, for the
  // queries that read it from the pages (the tile loop above left it out).
  if (sink0) {
    bool any = false;
    for (int m = 0; m < M; ++m) {
      const int i = m / gq;
      lo[m] = 0;
      hi[m] = Fq[i] > 0 && (!P.window || pq[i] - P.window + 1 <= 0);
      any |= hi[m] > 0;
    }
    if (any) {
      const uint8_t* plane = hbase + (int64_t)btrow[0] * P.c_sb;
      dequantize_row_i8_f32(plane + P.lay.k.sink_off, D, KV);
      qk_tile(Q, M, KV, 1, D, S);
      softmax_tile(S, M, 1, lo, hi, mrow, lrow, acc, D, P.softcap_log2);
      dequantize_row_i8_f32(plane + P.lay.v.sink_off, D, KV);
      pv_tile(S, M, KV, lo, hi, D, acc);
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
      softmax_tile(S, M, nt, lo, hi, mrow, lrow, acc, D, P.softcap_log2);
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
    float* a = acc + (int64_t)m * D;
    const int64_t o = (int64_t)(T.tok0 + i) * P.o_st + (int64_t)hq * P.o_sh;
    if (P.rot_out) {  // rotation.unrotate's transform on the fp32 row, then one rounding
      const VF vi = vset(inv);
      for (int d = 0; d < D; d += W) vstore(a + d, vmul(vload(a + d), vi));
      fwht_row(a, D);
      scale_row(a, P.rot_sc, D);
      store_row_f(P.out, P.dtype, o, D, a);
    } else if (P.dtype == DT_F32) {
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

// ---- prefill dequantization (dequant.cpp) ---------------------------------------------------
// Rows [0, cnt) of one region of a (block, kv head) plane -> rows of `out` (row_stride
// elements apart, dtype DT_F32 / DT_BF16 / DT_F16), decoded exactly as the scratch path
// decodes a prefill tile (the kernel's and the reference's fp32 values), then rounded once
// to nearest even (torch's casts). scratch: decode_scratch_floats(D) floats.
static void decode_rows_impl(const kvq::Codec& c, const kvq::Region& r, const uint8_t* plane,
                             int cnt, int D, float st, const float* levels, float* scratch,
                             void* out, int32_t dtype, int64_t row_stride) {
  TileBufs tb;
  float* rows = carve_tile_bufs(scratch, D, tb);  // one tile's values, fp32
  TileSrc ts;
  ts.gshift = 30;
  set_levels(c, levels, ts);
  for (int t0 = 0; t0 < cnt; t0 += TT) {
    const int n = imin(TT, cnt - t0);
    int nch_rows = 0;
    prep_segment(c, r, plane, t0, n, 0, D, st, tb, nch_rows, ts, -1, levels, false);
    // contiguous fp32 rows are decoded in place, anything else through `rows`
    const bool dense = dtype == DT_F32 && row_stride == D;
    float* dst = dense ? (float*)out + (int64_t)t0 * D : rows;
    with_kind(c, false, [&](auto k) { decode_tile_kind(k, ts, n, D, dst); });
    for (int t = 0; t < n && !dense; ++t)
      store_row_f(out, dtype, (int64_t)(t0 + t) * row_stride, D, rows + (int64_t)t * D);
  }
}
