// Temporary: replaced by the real kernels (cache_write.cpp, attention.cpp).
#include "cpu_ops.h"
namespace kvq_cpu {
void write_cache(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                 const std::vector<int64_t>&, const std::vector<int64_t>&, const at::Tensor&,
                 const at::Tensor&) { TORCH_CHECK(false, "not built yet"); }
void paged_attention(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, int64_t, double,
                     const std::vector<int64_t>&, const std::vector<int64_t>&,
                     const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "not built yet"); }
std::string simd_path() { return "none"; }
}
