// kvq_cpu::paged_attention: argument checks, work split and SIMD dispatch. The kernel
// body is attn_body.h, compiled per SIMD path (attn_avx512.cpp, attn_avx2.cpp,
// attn_scalar.cpp); this file is compiled for the baseline target.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "attn_common.h"
#include "cpu_ops.h"
#include "op_checks.h"
#include "kvq_torch_codec.h"

namespace kvq_cpu {

namespace {

enum Path { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };

// Chunks of at most this many query tokens run as one decode task per token (speculative
// verification steps: 1 + num_speculative_tokens rows per sequence); longer ones in tiles.
constexpr int kDecodeRowsMax = 8;

Path best_path() {
  static const Path best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
      return PATH_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
      return PATH_AVX2;
    return PATH_SCALAR;
  }();
  return best;
}

// The path used now: the best the CPU has, lowered by KVQ_SIMD=scalar|avx2|avx512 (read
// on every call, so tests can switch paths in one process).
Path current_path() {
  Path p = best_path();
  if (const char* e = std::getenv("KVQ_SIMD")) {
    const std::string s(e);
    Path want = p;
    if (s == "scalar") want = PATH_SCALAR;
    else if (s == "avx2") want = PATH_AVX2;
    else if (s == "avx512") want = PATH_AVX512;
    else if (!s.empty() && s != "auto")
      TORCH_CHECK(false, "KVQ_SIMD=", s, " is not allowed; allowed: scalar, avx2, avx512, auto");
    p = std::min(p, want);
  }
  return p;
}

const char* path_name(Path p) {
  return p == PATH_AVX512 ? "avx512" : (p == PATH_AVX2 ? "avx2" : "scalar");
}

TaskFn task_fn(Path p) {
  switch (p) {
    case PATH_AVX512: return kvq_avx512::run_task;
    case PATH_AVX2: return kvq_avx2::run_task;
    default: return kvq_scalar::run_task;
  }
}

}  // namespace

// One thread's scratch, kept across calls and grown when a call needs more: a vector per
// call cost an allocation and a zero fill of ~160 KB per thread (memset was ~3% of a
// 512-token decode's samples in perf). Callers never read scratch they did not write (a
// thread's second task of a call already finds the first one's data there). It starts on
// a cache line: the kernel's buffers in it are whole vectors apart, and malloc aligns to
// 16 bytes only, so in some processes every vector access of the scratch split two lines
// (a 512-token nuq decode ran ~10% slower in those: 1 process in 3 here, Zen 4).
float* thread_scratch(size_t n) {
  constexpr uintptr_t kLine = 64;
  thread_local std::vector<float> buf;
  if (buf.size() < n + kLine / sizeof(float)) buf.resize(n + kLine / sizeof(float));
  return (float*)(((uintptr_t)buf.data() + kLine - 1) & ~(kLine - 1));
}

DecodeRowsFn current_decode_rows() {
  switch (current_path()) {
    case PATH_AVX512: return kvq_avx512::decode_rows;
    case PATH_AVX2: return kvq_avx2::decode_rows;
    default: return kvq_scalar::decode_rows;
  }
}

HadamardFn current_hadamard_rows() {
  switch (current_path()) {
    case PATH_AVX512: return kvq_avx512::hadamard_rows;
    case PATH_AVX2: return kvq_avx2::hadamard_rows;
    default: return kvq_scalar::hadamard_rows;
  }
}

namespace {

using kvq::to_codec;

using kvq::static_scales;

std::vector<int32_t> to_i32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, what,
              " must be int32 or int64");
  // The usual int32 contiguous tensor is read in place: at::Tensor::to() is a dispatcher
  // call even when it returns its input (two to four per call, in the serial part before
  // the threads start).
  if (t.scalar_type() == at::kInt && t.is_contiguous() && t.device().is_cpu()) {
    const int32_t* p = t.data_ptr<int32_t>();
    return std::vector<int32_t>(p, p + t.numel());
  }
  at::Tensor c = t.to(at::kInt).contiguous();
  return std::vector<int32_t>(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
}

}  // namespace

std::string simd_path() { return path_name(current_path()); }
int simd_level() { return (int)current_path(); }

// An environment switch: set, non-empty and not "0".
static bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e && *e && std::string(e) != "0";
}
// The CPU features the AVX-512 body's optional paths need, read once.
struct CpuFeatures {
  bool vnni, vbmi, vbmi2, bf16, fast_pdep;
};
static const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    __builtin_cpu_init();
    return CpuFeatures{(bool)__builtin_cpu_supports("avx512vnni"),
                       (bool)__builtin_cpu_supports("avx512vbmi"),
                       (bool)__builtin_cpu_supports("avx512vbmi2"),
                       (bool)__builtin_cpu_supports("avx512bf16"),
                       // AMD family 17h (Zen 1/2) runs pdep in microcode (~20-250 cycles)
                       __builtin_cpu_supports("bmi2") && !__builtin_cpu_is("amdfam17h")};
  }();
  return f;
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& staging_k,
                     const at::Tensor& staging_v, const at::Tensor& staging_start_loc,
                     const at::Tensor& staging_pos0, int64_t residual_chunk,
                     int64_t sliding_window, double softmax_scale, double logits_soft_cap,
                     const std::vector<int64_t>& k_codec, const std::vector<int64_t>& v_codec,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& k_levels, const at::Tensor& v_levels,
                     int64_t rotation, const std::optional<at::Tensor>& rotation_sc) {
  const kvq::Codec kc = to_codec(k_codec, "k_codec"), vc = to_codec(v_codec, "v_codec");
  TORCH_CHECK(query.dim() == 3, "query must be [T, Hq, D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must have query's shape and dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out last dim must be contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4,
              "cache must be uint8 [num_blocks, H, block_size, C]");
  const int Hq = (int)query.size(1), D = (int)query.size(2);
  const int H = (int)cache.size(1), B = (int)cache.size(2);
  const int64_t nb = cache.size(0), C = cache.size(3);
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads ", Hq, " must be a multiple of kv heads ", H);
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 512, "head_dim ", D,
              " must be a multiple of 16 in [16, 512]");
  TORCH_CHECK(B % 16 == 0 && B > 0, "block_size ", B, " must be a multiple of 16");
  check_codecs(kc, vc, D, B);
  const std::vector<float> klev = codebook(kc, k_levels, "k_levels");
  const std::vector<float> vlev = codebook(vc, v_levels, "v_levels");
  const kvq::Layout lay = kvq::make_layout(kc, vc, D, B);
  TORCH_CHECK(C == lay.token_bytes, "cache last dim is ", C, " bytes but this format needs ",
              lay.token_bytes, " (head_dim ", D, ", block_size ", B, ")");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == C && cache.stride(1) >= (int64_t)B * C,
              "each (block, kv_head) plane of the cache must be contiguous");
  const int R = (int)residual_chunk;
  TORCH_CHECK(R >= 1, "residual_chunk ", R, " must be >= 1");
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX, "sliding_window ",
              sliding_window, " must be >= 0 (0: none)");
  const int W = (int)sliding_window;
  // staging holds the last < R positions of a query, which must all be inside its window
  TORCH_CHECK(W == 0 || R <= W, "residual_chunk ", R, " must not exceed sliding_window ", W);
  TORCH_CHECK(logits_soft_cap >= 0 && std::isfinite(logits_soft_cap), "logits_soft_cap ",
              logits_soft_cap, " must be finite and >= 0 (0: none)");
  TORCH_CHECK(rotation >= 0 && rotation <= 2, "rotation ", rotation, " is not allowed; allowed: "
              "0 (none), 1 (values: the output rotated back), 2 (keys and values: the query "
              "rotated too)");
  TORCH_CHECK(rotation == 0 || ((D & (D - 1)) == 0 && D <= kMaxRotD), "rotation needs head_dim "
              "a power of two <= ", kMaxRotD, ", got ", D);
  TORCH_CHECK(rotation == 0 || (rotation_sc.has_value() && rotation_sc->device().is_cpu() &&
                                rotation_sc->scalar_type() == at::kFloat &&
                                rotation_sc->dim() == 1 && rotation_sc->size(0) == D &&
                                rotation_sc->stride(0) == 1),
              "rotation ", rotation, " needs rotation_sc: a contiguous float32 CPU [", D,
              "] tensor (vllm_kvq.rotation.signed_scale)");
  const int32_t qdt = dtype_of(query, "query");

  const std::vector<int32_t> sl = to_i32(seq_lens, "seq_lens");
  const std::vector<int32_t> qsl = to_i32(query_start_loc, "query_start_loc");
  const int S = (int)sl.size();
  TORCH_CHECK((int)qsl.size() >= S + 1, "query_start_loc must have S+1=", S + 1, " entries");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= S,
              "block_table must be [S, max_blocks]");
  at::Tensor bt = block_table.scalar_type() == at::kInt ? block_table
                                                         : block_table.to(at::kInt);
  if (bt.stride(1) != 1) bt = bt.contiguous();
  const int64_t maxb = bt.size(1);
  const int32_t* btp = bt.data_ptr<int32_t>();

  const bool any_staging_possible = R > 1 && staging_k.numel() > 0;
  std::vector<int32_t> ssl, sp0;
  int64_t Ns = 0;
  int32_t sdt = qdt;
  if (any_staging_possible) {
    ssl = to_i32(staging_start_loc, "staging_start_loc");
    sp0 = to_i32(staging_pos0, "staging_pos0");
    TORCH_CHECK((int)ssl.size() >= S && (int)sp0.size() >= S,
                "staging_start_loc / staging_pos0 need an entry per sequence");
    TORCH_CHECK(staging_k.dim() == 3 && staging_v.sizes() == staging_k.sizes() &&
                    staging_k.size(1) == H && staging_k.size(2) == D,
                "staging_k/v must be [Ns, H=", H, ", D=", D, "]");
    TORCH_CHECK(staging_k.stride(2) == 1 && staging_v.stride(2) == 1,
                "staging last dim must be contiguous");
    TORCH_CHECK(staging_k.scalar_type() == staging_v.scalar_type(),
                "staging_k and staging_v must have one dtype");
    sdt = dtype_of(staging_k, "staging_k");
    Ns = staging_k.size(0);
  }
  const std::vector<float> ks = static_scales(kc, k_scale, H, "k_scale");
  const std::vector<float> vs = static_scales(vc, v_scale, H, "v_scale");

  // ---- tasks ---------------------------------------------------------------------------
  const int gq = Hq / H;
  const int qt = std::max(1, 64 / gq);  // query tokens per prefill tile
  const int nthreads = omp_get_max_threads();
  TORCH_CHECK(qsl[0] >= 0 && qsl[S] <= query.size(0), "query_start_loc[-1]=", qsl[S],
              " exceeds the ", query.size(0), " query rows");
  std::vector<AttnTask> tasks;
  for (int s = 0; s < S; ++s) {
    const int q0 = qsl[s], q1 = qsl[s + 1], L = sl[s];
    TORCH_CHECK(q1 >= q0, "query_start_loc must be non-decreasing (sequence ", s, ")");
    const int nq = q1 - q0;
    if (nq == 0) continue;
    TORCH_CHECK(nq <= L, "sequence ", s, " has ", nq, " queries but seq_len ", L);
    const int first = L - nq;
    const int maxF = L / R * R;  // F of the last query (position L-1)
    const int nblk = (maxF + B - 1) / B;
    TORCH_CHECK(nblk <= maxb, "sequence ", s, " needs ", nblk, " blocks, block_table has ",
                maxb);
    for (int j = 0; j < nblk; ++j) {
      const int32_t b = btp[(int64_t)s * bt.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < nb, "block_table[", s, ", ", j, "] = ", b,
                  " is not a block of the cache (", nb, " blocks)");
    }
    // Staging positions read by queries at positions [pb, pe): the union of [F(p), p].
    auto stg_range = [&](int pb, int pe, int& lo, int& hi) {
      lo = INT32_MAX; hi = 0;
      if (R == 1) return;
      for (int p = pb; p < pe; ++p) {
        const int F = (p + 1) / R * R;
        if (F <= p) { lo = std::min(lo, F); hi = std::max(hi, p + 1); }
      }
    };
    int slo, shi;
    stg_range(first, L, slo, shi);
    int64_t stg_base = 0;
    if (slo < shi) {
      TORCH_CHECK(any_staging_possible, "sequence ", s, " reads positions ", slo, "..",
                  shi - 1, " from staging (residual_chunk ", R, ") but staging_k is empty");
      stg_base = (int64_t)ssl[s] - sp0[s];
      TORCH_CHECK(slo >= sp0[s] && stg_base + slo >= 0 && stg_base + shi <= Ns,
                  "sequence ", s, " reads staging positions ", slo, "..", shi - 1,
                  " = rows ", stg_base + slo, "..", stg_base + shi - 1,
                  " but staging holds positions from staging_pos0=", sp0[s], " and has ", Ns,
                  " rows");
    }
    // A short chunk (a speculative verification step: 1 + k drafts) runs as one decode
    // task per query token, each computing what a plain decode step at its position does
    // (the fused body, the int8 query where a decode takes it): greedy tokens with and
    // without speculation then differ by the model's own float noise only. Longer chunks:
    // tiles of equal size (at most qt rows), no 1-row remainder tile, which would run the
    // decode body for a prefill row.
    const bool decodes = nq <= kDecodeRowsMax;
    const int ntiles = decodes ? nq : (nq + qt - 1) / qt, per_tile = (nq + ntiles - 1) / ntiles;
    for (int i0 = 0; i0 < nq; i0 += per_tile) {
      const int n = std::min(per_tile, nq - i0);
      const int plast = first + i0 + n - 1;
      const int Fl = (plast + 1) / R * R;
      int tlo, thi;
      stg_range(first + i0, first + i0 + n, tlo, thi);
      for (int h = 0; h < H; ++h) {
        AttnTask t{};
        t.s = s; t.h = h; t.tok0 = q0 + i0; t.nq = n; t.pos0 = first + i0;
        // a window's first key for the tile's first query (the others start later: masked)
        t.kbeg = W ? std::min(Fl, std::max(0, first + i0 - W + 1)) : 0;
        t.kend = Fl;
        t.staging = tlo < thi ? 1 : 0;
        t.stg_base = stg_base;
        t.part = -1;
        t.decode = decodes ? 1 : 0;
        tasks.push_back(t);
      }
    }
  }
  if (tasks.empty()) return;

  // Flash-decoding split when there are too few tasks for the threads, in parts of at least
  // kMinPart keys. 256, not 512: one sequence of Gemma 3 (one kv head, 2 threads) then splits
  // from 512 tokens on: 4/1/256 batch 1, bf16 query, Zen 4: 512 tokens 22 -> 16-20 us, 1000
  // tokens 39 -> 27 us (bf16; int4_group32 and nuq3_sink alike); more tasks than 2 per
  // thread never split, so batches of SmolLM2 (3 kv heads) time the same.
  constexpr int kMinPart = 256;
  std::vector<AttnTask> work;
  struct Group { int64_t first, count; };
  std::vector<Group> groups;
  int64_t part_floats = 0;
  const int ntasks = (int)tasks.size();
  const int want = ntasks < 2 * nthreads ? (4 * nthreads + ntasks - 1) / ntasks : 1;
  for (const AttnTask& t : tasks) {
    const int keys = t.kend - t.kbeg;
    int np = std::min(want, std::max(1, keys / kMinPart));
    if (np <= 1) { work.push_back(t); continue; }
    const int per = ((keys + np - 1) / np + B - 1) / B * B;
    np = (keys + per - 1) / per;
    const int M = t.nq * gq;
    groups.push_back(Group{(int64_t)work.size(), np});
    for (int p = 0; p < np; ++p) {
      AttnTask u = t;
      u.kbeg = t.kbeg + p * per;
      u.kend = std::min(t.kend, u.kbeg + per);
      u.staging = p == np - 1 ? t.staging : 0;
      u.part = part_floats;
      part_floats += (int64_t)partial_floats(M, D);
      work.push_back(u);
    }
  }
  // Longest first for the dynamic schedule.
  std::vector<int> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const int64_t wa = (int64_t)(work[a].kend - work[a].kbeg + 64) * work[a].nq;
    const int64_t wb = (int64_t)(work[b].kend - work[b].kbeg + 64) * work[b].nq;
    return wa > wb;
  });

  int max_rows = 0;
  for (const AttnTask& t : work) max_rows = std::max(max_rows, t.nq * gq);
  const size_t per_thread = (scratch_floats(max_rows, D) + 15) / 16 * 16;
  std::vector<float> partials((size_t)part_floats);

  AttnParams P{};
  P.q = query.data_ptr(); P.q_st = query.stride(0); P.q_sh = query.stride(1);
  P.out = out.data_ptr(); P.o_st = out.stride(0); P.o_sh = out.stride(1);
  P.dtype = qdt;
  P.cache = cache.data_ptr<uint8_t>(); P.c_sb = cache.stride(0); P.c_sh = cache.stride(1);
  P.bt = btp; P.bt_stride = bt.stride(0);
  if (any_staging_possible && Ns > 0) {
    P.sk = staging_k.data_ptr(); P.sv = staging_v.data_ptr();
    P.sk_st = staging_k.stride(0); P.sk_sh = staging_k.stride(1);
    P.sv_st = staging_v.stride(0); P.sv_sh = staging_v.stride(1);
  }
  P.s_dtype = sdt;
  P.Hq = Hq; P.H = H; P.D = D; P.B = B; P.R = R; P.gq = gq; P.window = W;
  P.scale_log2 = (float)(softmax_scale * 1.4426950408889634);
  P.softcap_log2 = (float)(logits_soft_cap * 1.4426950408889634);
  P.kc = kc; P.vc = vc; P.lay = lay;
  P.k_scale = ks.data(); P.v_scale = vs.data();
  P.k_levels = klev.empty() ? nullptr : klev.data();
  P.v_levels = vlev.empty() ? nullptr : vlev.data();
  P.partials = partials.data();
  P.rot_q = rotation == 2 ? 1 : 0;
  P.rot_out = rotation != 0 ? 1 : 0;
  P.rot_sc = rotation != 0 ? rotation_sc->data_ptr<float>() : nullptr;

  const Path path = current_path();
  const TaskFn fn = task_fn(path);
  // The kernel's CPU-dependent paths (attn_body.h), on by default; KVQ_EXACT_QK=1 /
  // KVQ_EXACT_PV=1 keep the exact fp32 Q.K / P.V weights (read on every call, like KVQ_SIMD).
  {
    const bool exact = env_flag("KVQ_EXACT_QK"), exact_pv = env_flag("KVQ_EXACT_PV");
    const CpuFeatures& cpu = cpu_features();
    const bool avx512 = path == PATH_AVX512;
    // integer Q.K of int keys: the AVX-512 body uses vpdpbusd
    P.int_qk = !exact && (!avx512 || cpu.vnni) ? 1 : 0;
    // 3-bit codes read as stored: the AVX-512 body's qk_int3 needs VBMI (vpmultishiftqb,
    // vpermb) and VBMI2 (vpshrdd); the scalar body states the same arithmetic in C; the
    // AVX2 body has no such path (it repacks int3 rows, nuq3 keys stay on the fp32 Q.K).
    P.qk3 = path == PATH_SCALAR || (avx512 && cpu.vbmi && cpu.vbmi2) ? 1 : 0;
    // bf16 keys x a bf16 query by vdpbf16ps (qk_bf16); KVQ_EXACT_QK=1 keeps the fp32 FMAs
    P.bf16dp = !exact && avx512 && cpu.bf16 ? 1 : 0;
    // bf16 weights in a bf16 query's decode P.V of 4/3/2-bit and bf16 values (pv_bf16):
    // vdpbf16ps and VBMI's vpermb / vpmultishiftqb
    P.pv_bf16 = !exact_pv && avx512 && cpu.bf16 && cpu.vbmi ? 1 : 0;
    // int16 weights in a bf16 query's decode P.V of 8-bit int values (pv_i16): vpdpwssd
    P.pv_i16 = P.pv_bf16 && cpu.vnni ? 1 : 0;
    // nuq 4-bit values' levels as bytes through vpshufb (AVX2 has no 16-float vpermps)
    P.pv_byte = !exact_pv && path == PATH_AVX2 ? 1 : 0;
    // KVQ_NO_PDEP=1: the vector repack of 3-bit keys (what Zen 1/2 run; tests/test_kernels.py)
    P.fast_pdep = cpu.fast_pdep && !env_flag("KVQ_NO_PDEP") ? 1 : 0;
  }
  const int64_t nwork = (int64_t)work.size();
  const int nthr = (int)std::min<int64_t>(nthreads, nwork);
#pragma omp parallel num_threads(nthr)
  {
    float* sp = thread_scratch(per_thread);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nwork; ++i) fn(P, work[order[i]], sp);
  }

  // Combine split tasks: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p.
  if (!groups.empty()) {
    const int64_t ng = (int64_t)groups.size();
    const HadamardFn unrotate = current_hadamard_rows();
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min<int64_t>(nthreads, ng))
    for (int64_t gi = 0; gi < ng; ++gi) {
      const Group& g = groups[gi];
      const AttnTask& t0 = work[g.first];
      const int M = t0.nq * gq;
      std::vector<float> accum((size_t)D);
      for (int m = 0; m < M; ++m) {
        float mx = -INFINITY;
        for (int64_t p = 0; p < g.count; ++p)
          mx = std::max(mx, partials[work[g.first + p].part + m]);
        float l = 0.0f;
        std::fill(accum.begin(), accum.end(), 0.0f);
        for (int64_t p = 0; p < g.count; ++p) {
          const float* src = partials.data() + work[g.first + p].part;
          const float pm = src[m];
          if (pm == -INFINITY && src[M + m] == 0.0f) continue;  // saw no key
          const float w = std::exp2(pm - mx);
          l += w * src[M + m];
          const float* a = src + 2 * M + (int64_t)m * D;
          for (int d = 0; d < D; ++d) accum[d] += w * a[d];
        }
        const float inv = l != 0.0f ? 1.0f / l : 0.0f;
        const int i = m / gq, hq = t0.h * gq + m % gq;
        const int64_t o = (int64_t)(t0.tok0 + i) * P.o_st + (int64_t)hq * P.o_sh;
        if (P.rot_out) {  // the row rotated back (the path's hadamard pass) and rounded once
          for (int d = 0; d < D; ++d) accum[d] *= inv;
          HadamardArgs a{};
          a.in = accum.data();
          a.in_dtype = DT_F32;
          a.out = (uint8_t*)P.out + o * (qdt == DT_F32 ? 4 : 2);  // this one row
          a.out_dtype = qdt;
          a.rows_inner = 1;
          a.D = D;
          a.inverse = 1;
          a.sc = P.rot_sc;
          unrotate(a, 0, 1);
        } else if (qdt == DT_F32) {
          float* dst = (float*)P.out + o;
          for (int d = 0; d < D; ++d) dst[d] = accum[d] * inv;
        } else if (qdt == DT_F16) {
          uint16_t* dst = (uint16_t*)P.out + o;
          for (int d = 0; d < D; ++d) dst[d] = out_fp16(accum[d] * inv);
        } else {
          uint16_t* dst = (uint16_t*)P.out + o;
          for (int d = 0; d < D; ++d) dst[d] = kvq::float_to_bf16(accum[d] * inv);
        }
      }
    }
  }
}

}  // namespace kvq_cpu
