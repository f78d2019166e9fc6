// kvq_cpu::hadamard: the rotation of rotated formats (vllm_kvq/rotation.py) as one pass over
// the rows: read, fp32 transform, one rounding to the output dtype (hadamard_body.h, on the
// current SIMD path). Replaces three torch ops and a D x D matrix product per tensor (the
// transform is D log2 D adds, the product D^2 multiply-adds). Compiled for the baseline target.
#include <omp.h>

#include <algorithm>

#include "attn_common.h"
#include "cpu_ops.h"
#include "op_checks.h"

namespace kvq_cpu {

void hadamard(const at::Tensor& x, at::Tensor& out, const at::Tensor& sc, bool inverse) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && sc.device().is_cpu(),
              "hadamard: x, out and sc must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "hadamard: x must be [N, D] or [N, M, D], got ",
              x.sizes());
  TORCH_CHECK(out.sizes() == x.sizes(), "hadamard: out must have x's shape ", x.sizes(),
              ", got ", out.sizes());
  const int64_t D = x.size(-1);
  TORCH_CHECK(D >= 16 && D <= kMaxRotD && (D & (D - 1)) == 0, "hadamard: head_dim ", D,
              " is not allowed; allowed: a power of two in [16, ", kMaxRotD, "]");
  TORCH_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1, "hadamard: x and out need a contiguous "
              "last dim");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 1 && sc.size(0) == D &&
                  sc.stride(0) == 1,
              "hadamard: sc must be a contiguous float32 [", D, "] tensor");
  HadamardArgs a;
  a.in = x.data_ptr();
  a.out = out.data_ptr();
  const bool three = x.dim() == 3;
  a.rows_inner = three ? x.size(1) : 1;
  a.in_s0 = x.stride(0);
  a.in_s1 = three ? x.stride(1) : 0;
  a.out_s0 = out.stride(0);
  a.out_s1 = three ? out.stride(1) : 0;
  a.in_dtype = dtype_of(x, "hadamard: x");
  a.out_dtype = dtype_of(out, "hadamard: out");
  a.D = (int32_t)D;
  a.inverse = inverse ? 1 : 0;
  a.sc = sc.data_ptr<float>();
  const int64_t rows = x.size(0) * a.rows_inner;
  if (rows == 0) return;
  const HadamardFn fn = current_hadamard_rows();
  // A decode step's few rows stay on this thread (a parallel region costs more than them).
  if (rows * D < 32768) {
    fn(a, 0, rows);
    return;
  }
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (rows + nt - 1) / nt;
    const int64_t r0 = std::min(rows, t * per), r1 = std::min(rows, r0 + per);
    if (r0 < r1) fn(a, r0, r1);
  }
}

}  // namespace kvq_cpu
