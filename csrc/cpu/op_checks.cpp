// The argument checks every CPU op (write_cache, paged_attention, dequantize_pages) shares:
// one definition each, run once per op call before any ISA path sees the arguments.
#include <cmath>

#include "attn_common.h"
#include "op_checks.h"

namespace kvq_cpu {

using kvq::Codec;

int32_t dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DT_F32;
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    default:
      TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_codec(const Codec& c, int D, int B, const char* what) {
  TORCH_CHECK(c.outliers >= 0 && c.outliers <= 64 && c.outliers <= D, what, ": outliers=",
              c.outliers, " slots per token is not allowed; allowed: 0..64");
  TORCH_CHECK(c.outliers == 0 || c.encoding == kvq::ENC_INT || c.encoding == kvq::ENC_NUQ,
              what, ": outlier slots apply to int and nuq codecs only");
  TORCH_CHECK(c.outliers == 0 || D <= 512, what, ": outlier slots need head_dim <= 512");
  TORCH_CHECK(c.sink == 0 || c.sink == 1, what, ": sink=", c.sink,
              " is not allowed; allowed: 0 or 1 (first tokens kept as int8 rows)");
  TORCH_CHECK(c.sink == 0 || c.encoding == kvq::ENC_INT || c.encoding == kvq::ENC_NUQ, what,
              ": an attention sink applies to int and nuq codecs only");
  TORCH_CHECK(c.sink == 0 || D <= 512, what, ": an attention sink needs head_dim <= 512");
  switch (c.encoding) {
    case kvq::ENC_FP16:
    case kvq::ENC_BF16:
      TORCH_CHECK(c.bits == 16 && c.granularity == kvq::GRAN_NONE, what,
                  ": fp16/bf16 codec must be 16 bits with granularity none");
      break;
    case kvq::ENC_FP8_E4M3:
    case kvq::ENC_FP8_E5M2:
      TORCH_CHECK(c.bits == 8, what, ": fp8 codec must be 8 bits");
      TORCH_CHECK(c.granularity == kvq::GRAN_TENSOR || c.granularity == kvq::GRAN_HEAD ||
                      c.granularity == kvq::GRAN_TOKEN,
                  what, ": fp8 granularity must be tensor, head or token, got ",
                  c.granularity);
      break;
    case kvq::ENC_INT:
      TORCH_CHECK(c.bits == 2 || c.bits == 3 || c.bits == 4 || c.bits == 8, what,
                  ": int bits must be 2, 3, 4 or 8, got ", c.bits);
      TORCH_CHECK(c.granularity >= kvq::GRAN_TENSOR && c.granularity <= kvq::GRAN_CHANNEL,
                  what, ": int granularity must be tensor, head, token, group or channel");
      TORCH_CHECK(!(c.granularity <= kvq::GRAN_HEAD) || c.symmetric, what,
                  ": static (tensor/head) int scales must be symmetric");
      break;
    case kvq::ENC_NUQ:
      TORCH_CHECK(c.bits == 2 || c.bits == 3 || c.bits == 4, what,
                  ": nuq bits must be 2, 3 or 4, got ", c.bits);
      TORCH_CHECK(c.granularity >= kvq::GRAN_TOKEN && c.granularity <= kvq::GRAN_CHANNEL &&
                      !c.symmetric,
                  what, ": nuq granularity must be token, group or channel (asymmetric)");
      break;
    default: TORCH_CHECK(false, what, ": unknown encoding ", c.encoding);
  }
  if (c.granularity == kvq::GRAN_GROUP)
    TORCH_CHECK(c.group >= 16 && c.group % 16 == 0 && D % c.group == 0, what,
                ": channel group ", c.group, " must be a multiple of 16 dividing head_dim ",
                D);
  if (c.granularity == kvq::GRAN_CHANNEL)
    TORCH_CHECK(c.group >= 1 && B % c.group == 0, what, ": token group ", c.group,
                " must divide block_size ", B);
}

void check_codecs(const Codec& kc, const Codec& vc, int D, int B) {
  check_codec(kc, D, B, "k_codec");
  check_codec(vc, D, B, "v_codec");
  TORCH_CHECK(kc.sink == vc.sink, "k_codec sink=", kc.sink, " and v_codec sink=", vc.sink,
              " must agree: the attention sink keeps both the key and the value");
}

std::vector<float> codebook(const Codec& c, const at::Tensor& levels, const char* what) {
  if (c.encoding != kvq::ENC_NUQ) return {};
  const int n = 1 << c.bits;
  TORCH_CHECK(levels.defined() && levels.dim() == 1 && levels.numel() == n &&
                  levels.scalar_type() == at::kFloat && levels.device().is_cpu(),
              what, " must be a float32 CPU tensor of 2^bits=", n, " levels for codec nuq",
              c.bits, ", got ", levels.defined() ? levels.sizes() : at::IntArrayRef{});
  at::Tensor l = levels.contiguous();
  std::vector<float> out(l.data_ptr<float>(), l.data_ptr<float>() + n);
  for (int k = 0; k < n; ++k) {
    TORCH_CHECK(std::isfinite(out[k]) && out[k] >= -1.0f && out[k] <= 1.0f, what, "[", k,
                "] = ", out[k], " must be finite and within [-1, 1]");
    TORCH_CHECK(k == 0 || out[k] >= out[k - 1], what, " must be sorted ascending (level ",
                k, ")");
  }
  return out;
}

}  // namespace kvq_cpu
