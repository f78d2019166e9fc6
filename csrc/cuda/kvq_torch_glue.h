// Tensor checks and parameter blocks for the CUDA ops, shared by the real binding
// (cuda_ops.cu) and the emulated CPU build used by tests (emu/emu_ops.cpp). Include after
// the torch headers; no CUDA runtime calls here.
#pragma once
#include <cstdlib>
#include <string>

#include "kvq_dispatch.cuh"
#include "kvq_torch_codec.h"

namespace kvq_cuda {

inline kvq::Codec codec_from(c10::IntArrayRef v) { return kvq::to_codec(v, "codec"); }

inline int32_t act_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DT_F32;
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    default: TORCH_CHECK(false, "vllm_kvq (CUDA): ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DT_F32;
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "vllm_kvq (CUDA): ", name, " is on ", t.device(),
              ", the cache on ", ref.device());
}

inline const float* static_scale_ptr(const at::Tensor& s, const at::Tensor& cache, const char* name, int* n) {
  *n = 0;
  if (!s.defined() || s.numel() == 0) return nullptr;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous(), "vllm_kvq (CUDA): ", name,
              " must be a contiguous float32 tensor");
  check_same_device(s, cache, name);
  *n = (int)s.numel();
  return s.data_ptr<float>();
}

// A nuq side's codebook: float32, contiguous, on the cache's device (its size is checked by
// make_side); null for an undefined or empty tensor (the other codecs take none).
inline const float* levels_ptr(const at::Tensor& t, const at::Tensor& cache, const char* name, int* n) {
  *n = 0;
  if (!t.defined() || t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1, "vllm_kvq (CUDA): ",
              name, " must be a contiguous float32 [2^bits] tensor");
  check_same_device(t, cache, name);
  *n = (int)t.numel();
  return t.data_ptr<float>();
}

inline kvq::Layout checked_layout(const at::Tensor& cache, const kvq::Codec& kc, const kvq::Codec& vc,
                                  int64_t D, const char* op) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.is_contiguous(),
              op, ": cache must be a contiguous uint8 [num_blocks, num_kv_heads, block_size, C] tensor");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0, op, ": cache must be 16-byte aligned");
  const kvq::Layout l = kvq::make_layout(kc, vc, (int32_t)D, (int32_t)cache.size(2));
  TORCH_CHECK(l.token_bytes == cache.size(3), op, ": cache has ", cache.size(3),
              " bytes per token, the format needs ", l.token_bytes);
  return l;
}

inline WriteParams make_write_params(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache,
                                     const at::Tensor& slots, c10::IntArrayRef kcv, c10::IntArrayRef vcv,
                                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                                     const at::Tensor& k_levels, const at::Tensor& v_levels) {
  const char* op = "vllm_kvq.write_cache (CUDA)";
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), op, ": key/value must be [N, H, D] of one shape");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, op, ": key/value need a contiguous last dim");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), op, ": key and value dtypes differ");
  const kvq::Codec kc = codec_from(kcv), vc = codec_from(vcv);
  const int64_t H = key.size(1), D = key.size(2);
  const kvq::Layout l = checked_layout(cache, kc, vc, D, op);
  TORCH_CHECK(cache.size(1) == H, op, ": cache has ", cache.size(1), " kv heads, key ", H);
  TORCH_CHECK((slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt) && slots.dim() == 1 &&
                  slots.is_contiguous(),
              op, ": slot_mapping must be a contiguous int64/int32 [N] tensor");
  const int64_t N = slots.size(0);  // key/value rows beyond N are ignored (vLLM pads them)
  TORCH_CHECK(key.size(0) >= N, op, ": slot_mapping has ", N, " entries, key only ", key.size(0), " rows");
  check_same_device(key, cache, "key");
  check_same_device(value, cache, "value");
  check_same_device(slots, cache, "slot_mapping");
  WriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_sn = key.stride(0); p.k_sh = key.stride(1);
  p.v_sn = value.stride(0); p.v_sh = value.stride(1);
  p.in_dtype = act_dtype(key, "key");
  p.cache = cache.data_ptr<uint8_t>();
  p.plane_bytes = l.plane_bytes;
  p.num_blocks = cache.size(0);
  p.H = (int32_t)H; p.D = (int32_t)D; p.B = (int32_t)cache.size(2);
  p.slots = slots.data_ptr();
  p.slots_i32 = slots.scalar_type() == at::kInt;
  p.N = (int32_t)N;
  int kn, vn, kln, vln;
  const float* ks = static_scale_ptr(k_scale, cache, "k_scale", &kn);
  const float* vs = static_scale_ptr(v_scale, cache, "v_scale", &vn);
  const float* kl = levels_ptr(k_levels, cache, "k_levels", &kln);
  const float* vl = levels_ptr(v_levels, cache, "v_levels", &vln);
  std::string e = make_side(kc, l.k, (int)D, p.B, ks, kn, (int)H, kl, kln, &p.side[0]);
  TORCH_CHECK(e.empty(), op, ": key codec: ", e);
  e = make_side(vc, l.v, (int)D, p.B, vs, vn, (int)H, vl, vln, &p.side[1]);
  TORCH_CHECK(e.empty(), op, ": value codec: ", e);
  p.error_flag = nullptr;
  return p;
}

// Fills p and plan; the caller provides the workspace (plan.workspace_bytes()) and stream.
inline AttnParams make_attn_params(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache,
                                   const at::Tensor& bt, const at::Tensor& seq_lens, const at::Tensor& qsl,
                                   const at::Tensor& sk, const at::Tensor& sv, const at::Tensor& ssl,
                                   const at::Tensor& sp0, int64_t R, int64_t window,
                                   double softmax_scale, double logits_soft_cap,
                                   c10::IntArrayRef kcv, c10::IntArrayRef vcv, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale, const at::Tensor& k_levels,
                                   const at::Tensor& v_levels, int num_sms, bool force_generic,
                                   int part_tokens_override, AttnPlan* plan) {
  const char* op = "vllm_kvq.paged_attention (CUDA)";
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, op, ": query must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              op, ": out must match query's shape and dtype");
  const kvq::Codec kc = codec_from(kcv), vc = codec_from(vcv);
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const kvq::Layout l = checked_layout(cache, kc, vc, D, op);
  const int64_t H = cache.size(1);
  TORCH_CHECK(Hq % H == 0, op, ": query heads ", Hq, " not a multiple of kv heads ", H);
  TORCH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.stride(1) == 1, op, ": block_table must be int32 [S, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(), op, ": seq_lens must be contiguous int32 [S]");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(bt.size(0) >= S, op, ": block_table has fewer rows than seq_lens");
  TORCH_CHECK(qsl.scalar_type() == at::kInt && qsl.is_contiguous() && qsl.numel() == S + 1, op, ": query_start_loc must be contiguous int32 [S+1]");
  TORCH_CHECK(R >= 1, op, ": residual_chunk must be >= 1");
  TORCH_CHECK(window >= 0 && (window == 0 || R <= window), op, ": sliding_window ", window,
              " must be 0 (none) or >= residual_chunk ", R);
  TORCH_CHECK(logits_soft_cap >= 0 && std::isfinite(logits_soft_cap), op, ": logits_soft_cap ",
              logits_soft_cap, " must be finite and >= 0 (0: none)");
  for (const at::Tensor* t : {(const at::Tensor*)&out, &q, &bt, &seq_lens, &qsl})
    check_same_device(*t, cache, "an attention input");
  AttnParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.q_st = q.stride(0); p.q_sh = q.stride(1);
  p.o_st = out.stride(0); p.o_sh = out.stride(1);
  p.q_dtype = act_dtype(q, "query");
  p.cache = cache.data_ptr<uint8_t>();
  p.plane_bytes = l.plane_bytes;
  p.H = (int32_t)H; p.Hq = (int32_t)Hq; p.D = (int32_t)D; p.B = (int32_t)cache.size(2);
  p.G = (int32_t)(Hq / H);
  p.block_table = bt.data_ptr<int32_t>();
  p.bt_stride = bt.stride(0);
  p.max_blocks = (int32_t)bt.size(1);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.qsl = qsl.data_ptr<int32_t>();
  p.S = (int32_t)S; p.T = (int32_t)T;
  p.R = (int32_t)R;
  p.window = (int32_t)window;
  if (R > 1) {
    TORCH_CHECK(sk.dim() == 3 && sv.sizes() == sk.sizes() && sk.size(1) == H && sk.size(2) == D &&
                    sk.stride(2) == 1 && sv.stride(2) == 1,
                op, ": staging_k/v must be [Ns, num_kv_heads, D] with a contiguous last dim");
    TORCH_CHECK(sk.scalar_type() == q.scalar_type() && sv.scalar_type() == q.scalar_type(), op,
                ": staging tensors must have the query's dtype");
    TORCH_CHECK(ssl.scalar_type() == at::kInt && ssl.is_contiguous() && ssl.numel() >= S &&
                    sp0.scalar_type() == at::kInt && sp0.is_contiguous() && sp0.numel() >= S,
                op, ": staging_start_loc and staging_pos0 must be contiguous int32 with S entries");
    for (const at::Tensor* t : {&sk, &sv, &ssl, &sp0}) check_same_device(*t, cache, "a staging input");
    p.sk = sk.data_ptr(); p.sv = sv.data_ptr();
    p.sk_sn = sk.stride(0); p.sk_sh = sk.stride(1);
    p.sv_sn = sv.stride(0); p.sv_sh = sv.stride(1);
    p.ssl = ssl.data_ptr<int32_t>();
    p.spos0 = sp0.data_ptr<int32_t>();
  }
  p.scale_log2 = (float)(softmax_scale * 1.4426950408889634);
  p.softcap_log2 = (float)(logits_soft_cap * 1.4426950408889634);
  int kn, vn, kln, vln;
  const float* ks = static_scale_ptr(k_scale, cache, "k_scale", &kn);
  const float* vs = static_scale_ptr(v_scale, cache, "v_scale", &vn);
  const float* kl = levels_ptr(k_levels, cache, "k_levels", &kln);
  const float* vl = levels_ptr(v_levels, cache, "v_levels", &vln);
  std::string e = make_side(kc, l.k, (int)D, p.B, ks, kn, (int)H, kl, kln, &p.side[0]);
  TORCH_CHECK(e.empty(), op, ": key codec: ", e);
  e = make_side(vc, l.v, (int)D, p.B, vs, vn, (int)H, vl, vln, &p.side[1]);
  TORCH_CHECK(e.empty(), op, ": value codec: ", e);
  const char* env = std::getenv("KVQ_CUDA_ATTN");
  if (env && std::string(env) == "generic") force_generic = true;
  e = plan_attention(p, kind_of(kc), kind_of(vc), num_sms, force_generic, plan);
  TORCH_CHECK(e.empty(), op, ": ", e);
  if (part_tokens_override > 0 && p.decode_fast) {  // tests: partitions of exactly this size
    TORCH_CHECK(part_tokens_override % 64 == 0, op, ": partition size must be a multiple of 64");
    const int64_t max_ctx = (int64_t)p.max_blocks * p.B;
    p.min_part_tokens = part_tokens_override;
    p.max_parts = (int32_t)((max_ctx + part_tokens_override - 1) / part_tokens_override);
    TORCH_CHECK(p.max_parts <= kMaxParts, op, ": too many partitions");
    if (p.max_parts < 1) p.max_parts = 1;
    const size_t slots = (size_t)p.S * p.Hq * (p.max_parts + 1);
    plan->part_o_floats = slots * p.D;
    plan->part_ml_floats = slots * 2;
  }
  return p;
}

}  // namespace kvq_cuda
