// kvq_cpu::dequantize_pages: one sequence's K and V, read from its pages into dense
// [H, L, D] tensors (float32 / float16 / bfloat16), for the prefill path (vllm_kvq/prefill.py)
// that hands them to torch's flash attention.
//
// Every value is what the attention kernel (attn_body.h) and the reference
// (reference.py::decode_plane_region) compute, in fp32, rounded once to the output dtype:
//   fp16 / bf16       the stored value
//   fp8               fp8 * scale
//   int  asym         code * scale + zero      (code * fp16 scale is exact in fp32, so this
//   int  sym          (code - 2^(b-1)) * scale  equals the kernel's fma(code, scale, zero))
//   nuq               level[code] * scale + zero   (two roundings, as the kernel and the
//                                                   reference; the build has -ffp-contract=off)
// then every outlier slot whose channel is below D replaces its channel. Scales and zeros are
// fp16 (token, group, channel granularity) or the static per-head fp32 scale (tensor, head).
//
// Plain C++ (baseline target), OpenMP over (block, kv head, side).
#include <omp.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "kvq_layout.h"
#include "kvq_torch_codec.h"
#include "kvq_numeric.h"

namespace kvq_cpu {

// cache_write.cpp
void check_codec(const kvq::Codec& c, int D, int B, const char* what);
std::vector<float> codebook(const kvq::Codec& c, const at::Tensor& levels, const char* what);

namespace {

using kvq::Codec;
using kvq::Region;

inline float h2f(const uint8_t* base, int64_t idx) {
  uint16_t h;
  memcpy(&h, base + 2 * idx, 2);
  return kvq::fp16_to_float(h);
}

// One stored row of b-bit codes -> one byte per channel.
inline void unpack_codes(const uint8_t* row, int bits, int D, uint8_t* out) {
  switch (bits) {
    case 8:
      memcpy(out, row, D);
      return;
    case 4:
      for (int d = 0; d < D; d += 2) {
        const uint8_t b = row[d >> 1];
        out[d] = b & 15u;
        out[d + 1] = b >> 4;
      }
      return;
    case 2:
      for (int d = 0; d < D; d += 4) {
        const uint8_t b = row[d >> 2];
        out[d] = b & 3u;
        out[d + 1] = (b >> 2) & 3u;
        out[d + 2] = (b >> 4) & 3u;
        out[d + 3] = b >> 6;
      }
      return;
    case 3:
      for (int d = 0; d < D; d += 8) {
        const uint8_t* p = row + d / 8 * 3;
        const uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
        for (int i = 0; i < 8; ++i) out[d + i] = (uint8_t)((w >> (3 * i)) & 7u);
      }
      return;
    default:
      for (int d = 0; d < D; ++d) out[d] = (uint8_t)kvq::get_code(row, d, bits);
  }
}

// One side (K or V) of a layer: codec, region, the code -> base value table.
struct Side {
  Codec c;
  Region r;
  const float* st;   // [H] static scales
  float tab[256];    // value of a code before scale / zero: the fp8 value, the nuq level,
                     // code or code - 2^(b-1) (int)
  bool is_float;     // fp16 / bf16
  bool zeros;        // a zero-point is stored
};

Side make_side(const Codec& c, const Region& r, const float* st, const std::vector<float>& lv) {
  Side s;
  s.c = c;
  s.r = r;
  s.st = st;
  s.is_float = c.encoding == kvq::ENC_FP16 || c.encoding == kvq::ENC_BF16;
  s.zeros = r.zero_bytes > 0;
  const int n = s.is_float ? 0 : 1 << c.bits;
  for (int k = 0; k < n; ++k) {
    switch (c.encoding) {
      case kvq::ENC_FP8_E4M3:
      case kvq::ENC_FP8_E5M2: s.tab[k] = kvq::fp8_to_float((uint8_t)k, c.encoding); break;
      case kvq::ENC_NUQ: s.tab[k] = lv[k]; break;
      default: s.tab[k] = (float)(c.symmetric ? k - (n >> 1) : k); break;
    }
  }
  return s;
}

// Tokens [t0, t0 + cnt) of one region of `plane` -> fp32 rows dst[cnt][D].
void decode_rows(const Side& sd, int h, const uint8_t* plane, int t0, int cnt, int D,
                 float* dst) {
  const Codec& c = sd.c;
  const Region& r = sd.r;
  const uint8_t* data = plane + r.data_off;
  if (sd.is_float) {
    const bool bf = c.encoding == kvq::ENC_BF16;
    for (int i = 0; i < cnt; ++i) {
      const uint8_t* row = data + (int64_t)(t0 + i) * r.row_bytes;
      float* o = dst + (int64_t)i * D;
      for (int d = 0; d < D; ++d) {
        uint16_t v;
        memcpy(&v, row + 2 * d, 2);
        o[d] = bf ? kvq::bf16_to_float(v) : kvq::fp16_to_float(v);
      }
    }
    return;
  }
  const int n = 1 << c.bits;
  const bool small = n <= 16;
  const uint8_t* sc = plane + r.scale_off;
  const uint8_t* zr = plane + r.zero_off;
  uint8_t codes[512];
  float lut[16], cs[512], cz[512];
  int srow_loaded = -1;
  // dst[d] = tab[code] * s + z over channels [d0, d1) (z only when a zero is stored)
  auto dense = [&](float* o, int d0, int d1, float s, float z) {
    if (small) {
      if (sd.zeros) for (int k = 0; k < n; ++k) lut[k] = sd.tab[k] * s + z;
      else for (int k = 0; k < n; ++k) lut[k] = sd.tab[k] * s;
      for (int d = d0; d < d1; ++d) o[d] = lut[codes[d]];
    } else if (sd.zeros) {
      for (int d = d0; d < d1; ++d) o[d] = sd.tab[codes[d]] * s + z;
    } else {
      for (int d = d0; d < d1; ++d) o[d] = sd.tab[codes[d]] * s;
    }
  };
  for (int i = 0; i < cnt; ++i) {
    const int tok = t0 + i;
    float* o = dst + (int64_t)i * D;
    unpack_codes(data + (int64_t)tok * r.row_bytes, c.bits, D, codes);
    switch (c.granularity) {
      case kvq::GRAN_TOKEN:
        dense(o, 0, D, h2f(sc, tok), sd.zeros ? h2f(zr, tok) : 0.0f);
        break;
      case kvq::GRAN_GROUP: {
        const int g = c.group, ng = D / g;
        for (int j = 0; j < ng; ++j) {
          const int64_t si = (int64_t)tok * ng + j;
          dense(o, j * g, (j + 1) * g, h2f(sc, si), sd.zeros ? h2f(zr, si) : 0.0f);
        }
        break;
      }
      case kvq::GRAN_CHANNEL: {
        const int srow = tok / c.group;
        if (srow != srow_loaded) {
          for (int d = 0; d < D; ++d) {
            cs[d] = h2f(sc, (int64_t)srow * D + d);
            cz[d] = sd.zeros ? h2f(zr, (int64_t)srow * D + d) : 0.0f;
          }
          srow_loaded = srow;
        }
        if (sd.zeros) for (int d = 0; d < D; ++d) o[d] = sd.tab[codes[d]] * cs[d] + cz[d];
        else for (int d = 0; d < D; ++d) o[d] = sd.tab[codes[d]] * cs[d];
        break;
      }
      default:  // tensor / head: static scale, no zero
        dense(o, 0, D, sd.st[h], 0.0f);
        break;
    }
    const uint8_t* ol = plane + r.outlier_off + (int64_t)tok * c.outliers * 4;
    for (int j = 0; j < c.outliers; ++j) {
      uint16_t ch, v;
      memcpy(&ch, ol + 4 * j, 2);
      memcpy(&v, ol + 4 * j + 2, 2);
      if (ch < D) o[ch] = kvq::fp16_to_float(v);
    }
  }
}

template <typename T>
inline void store_rows(const float* src, int cnt, int D, T* out, int64_t row_stride) {
  for (int i = 0; i < cnt; ++i) {
    const float* s = src + (int64_t)i * D;
    T* o = out + (int64_t)i * row_stride;
    for (int d = 0; d < D; ++d) o[d] = static_cast<T>(s[d]);  // RNE, as torch's casts
  }
}

template <>
inline void store_rows<float>(const float* src, int cnt, int D, float* out, int64_t row_stride) {
  for (int i = 0; i < cnt; ++i) memcpy(out + (int64_t)i * row_stride, src + (int64_t)i * D,
                                       sizeof(float) * D);
}

template <typename T>
void run(const Side sides[2], const uint8_t* cache, int64_t c_sb, int64_t c_sh,
         const int32_t* blocks, int nblk, int L, int H, int B, int D, T* outs[2],
         const int64_t o_sh[2], const int64_t o_sl[2]) {
  const int64_t ntask = (int64_t)nblk * H * 2;
#pragma omp parallel
  {
    std::vector<float> buf((size_t)B * D);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < ntask; ++task) {
      const int side = (int)(task % 2);
      const int h = (int)(task / 2 % H);
      const int j = (int)(task / 2 / H);
      const int cnt = std::min(B, L - j * B);
      const uint8_t* plane = cache + (int64_t)blocks[j] * c_sb + (int64_t)h * c_sh;
      decode_rows(sides[side], h, plane, 0, cnt, D, buf.data());
      store_rows<T>(buf.data(), cnt, D,
                    outs[side] + h * o_sh[side] + (int64_t)j * B * o_sl[side], o_sl[side]);
    }
  }
}

using kvq::static_scales;
using kvq::to_codec;

}  // namespace

void dequantize_pages(const at::Tensor& cache, const at::Tensor& block_row, int64_t num_tokens,
                      const std::vector<int64_t>& k_codec, const std::vector<int64_t>& v_codec,
                      const at::Tensor& k_scale, const at::Tensor& v_scale,
                      const at::Tensor& k_levels, const at::Tensor& v_levels, at::Tensor& out_k,
                      at::Tensor& out_v) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.device().is_cpu(),
              "cache must be a uint8 CPU tensor [num_blocks, H, block_size, C]");
  const int nb = (int)cache.size(0), H = (int)cache.size(1), B = (int)cache.size(2);
  const int64_t C = cache.size(3);
  TORCH_CHECK(out_k.dim() == 3 && out_v.dim() == 3, "out_k/out_v must be [H, L, D]");
  const int D = (int)out_k.size(2);
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 512, "head_dim ", D,
              " must be a multiple of 16 in [16, 512]");
  TORCH_CHECK(B % 16 == 0 && B > 0, "block_size ", B, " must be a multiple of 16");
  const Codec kc = to_codec(k_codec, "k_codec"), vc = to_codec(v_codec, "v_codec");
  check_codec(kc, D, B, "k_codec");
  check_codec(vc, D, B, "v_codec");
  const kvq::Layout lay = kvq::make_layout(kc, vc, D, B);
  TORCH_CHECK(C == lay.token_bytes, "cache last dim is ", C, " bytes but this format needs ",
              lay.token_bytes);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == C && cache.stride(1) >= (int64_t)B * C,
              "each (block, kv_head) plane of the cache must be contiguous");
  const int L = (int)num_tokens;
  TORCH_CHECK(L >= 0, "num_tokens ", num_tokens, " must be >= 0");
  for (const at::Tensor* o : {&out_k, &out_v}) {
    TORCH_CHECK(o->size(0) == H && o->size(1) >= L && o->size(2) == D, "out_k/out_v must be [H=",
                H, ", >= num_tokens=", L, ", D=", D, "], got ", o->sizes());
    TORCH_CHECK(o->stride(2) == 1, "out_k/out_v last dim must be contiguous");
    TORCH_CHECK(o->scalar_type() == out_k.scalar_type(), "out_k and out_v must share a dtype");
    TORCH_CHECK(o->device().is_cpu(), "out_k/out_v must be CPU tensors");
  }
  const int nblk = (L + B - 1) / B;
  TORCH_CHECK(block_row.scalar_type() == at::kInt && block_row.dim() == 1 &&
                  block_row.stride(0) == 1 && block_row.size(0) >= nblk,
              "block_row must be a contiguous int32 [>= ", nblk, "] tensor, got ",
              block_row.scalar_type(), " ", block_row.sizes());
  const int32_t* blocks = block_row.data_ptr<int32_t>();
  for (int j = 0; j < nblk; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < nb, "block_row[", j, "] = ", blocks[j],
                " is outside the cache's ", nb, " blocks");
  if (L == 0) return;
  const std::vector<float> ks = static_scales(kc, k_scale, H, "k_scale");
  const std::vector<float> vs = static_scales(vc, v_scale, H, "v_scale");
  const std::vector<float> kl = codebook(kc, k_levels, "k_levels");
  const std::vector<float> vl = codebook(vc, v_levels, "v_levels");
  const Side sides[2] = {make_side(kc, lay.k, ks.data(), kl), make_side(vc, lay.v, vs.data(), vl)};
  const int64_t o_sh[2] = {out_k.stride(0), out_v.stride(0)};
  const int64_t o_sl[2] = {out_k.stride(1), out_v.stride(1)};
  const uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t c_sb = cache.stride(0), c_sh = cache.stride(1);
  switch (out_k.scalar_type()) {
    case at::kFloat: {
      float* outs[2] = {out_k.data_ptr<float>(), out_v.data_ptr<float>()};
      run<float>(sides, cp, c_sb, c_sh, blocks, nblk, L, H, B, D, outs, o_sh, o_sl);
      break;
    }
    case at::kBFloat16: {
      c10::BFloat16* outs[2] = {out_k.data_ptr<c10::BFloat16>(), out_v.data_ptr<c10::BFloat16>()};
      run<c10::BFloat16>(sides, cp, c_sb, c_sh, blocks, nblk, L, H, B, D, outs, o_sh, o_sl);
      break;
    }
    case at::kHalf: {
      c10::Half* outs[2] = {out_k.data_ptr<c10::Half>(), out_v.data_ptr<c10::Half>()};
      run<c10::Half>(sides, cp, c_sb, c_sh, blocks, nblk, L, H, B, D, outs, o_sh, o_sl);
      break;
    }
    default:
      TORCH_CHECK(false, "out_k/out_v must be float32, float16 or bfloat16, got ",
                  out_k.scalar_type());
  }
}

}  // namespace kvq_cpu
