// Instantiates every CUDA kernel of vllm-kvq without torch, for CI on machines with nvcc
// but no CUDA build of torch: scripts/check_cuda_compile.sh compiles this file for sm_80
// and sm_90 with `-Xptxas -v` and checks registers and spills (tests/test_cuda_compile.py).
// Not part of the extension: setup.py leaves this file out.
#include "kvq_dispatch.cuh"

// Every kernel the dispatcher can launch: decode (11 kinds x head sizes 64/128/256),
// generic attention (all head sizes), reduction, planner and the two write kernels.
int kvq_compile_check_kernels() {
  int n = 0;
  const int heads[] = {64, 80, 96, 112, 128, 192, 256};
  for (int D : heads) {
    for (int k = 0; k < kvq_cuda::KIND_COUNT; ++k) n += kvq_cuda::decode_fn(D, k, k) != nullptr;
    n += kvq_cuda::generic_fn(D) != nullptr;
  }
  static void (*const launchers[])() = {
      reinterpret_cast<void (*)()>(&kvq_cuda::launch_write_cache),
      reinterpret_cast<void (*)()>(&kvq_cuda::launch_attention),
  };
  return n + (launchers[0] != nullptr) + (launchers[1] != nullptr);
}
