// Portability layer of the vllm-kvq CUDA kernels.
//
// The kernels are written once, in plain CUDA C++, and compiled two ways:
//  * by nvcc (the real thing; this header then only pulls in the CUDA runtime), and
//  * by a host C++ compiler with KVQ_CUDA_EMULATE defined, for tests on machines without a
//    GPU: every CUDA thread becomes a fiber (kvq_cuda_emu.h), __syncthreads / warp shuffles
//    / mma.sync are emulated with warp- and block-wide rendezvous, and `__shared__`
//    variables become function statics (CTAs run one after another).
// Kernel code must therefore keep to a small dialect: the qualifiers below, threadIdx /
// blockIdx / blockDim / gridDim, __syncthreads, __syncwarp, the kvq_shfl_* helpers, and
// the PTX wrappers of kvq_ptx.cuh. Warp-collective calls must be made by all 32 lanes
// (full mask), which the real hardware wants anyway.
#pragma once
#include <stdint.h>

#if defined(KVQ_CUDA_EMULATE)
#include "kvq_cuda_emu.h"
#define KVQ_DEV inline
#define KVQ_HOSTDEV inline
#else
#include <cuda_runtime.h>
#define KVQ_DEV __device__ __forceinline__
#define KVQ_HOSTDEV __host__ __device__ __forceinline__
#endif

// Kernel launch: `KVQ_LAUNCH(fn, grid, block, stream)(args...)` where fn is a pointer to a
// __global__ function (so template arguments with commas need no extra parentheses).
#if defined(KVQ_CUDA_EMULATE)
#define KVQ_LAUNCH(fn, grid, block, stream) ::kvq_emu::Launcher<decltype(fn)>(fn, grid, block)
#else
#define KVQ_LAUNCH(fn, grid, block, stream) (fn)<<<grid, block, 0, stream>>>
#endif

namespace kvq_cuda {

#if defined(KVQ_CUDA_EMULATE)
KVQ_DEV float shfl_xor(float v, int m) { return ::kvq_emu::shfl_xor_f(v, m); }
KVQ_DEV uint32_t shfl_xor(uint32_t v, int m) { return ::kvq_emu::shfl_xor_u(v, m); }
KVQ_DEV int shfl_xor(int v, int m) { return (int)::kvq_emu::shfl_xor_u((uint32_t)v, m); }
KVQ_DEV float shfl(float v, int src) { return ::kvq_emu::shfl_f(v, src); }
KVQ_DEV uint32_t shfl(uint32_t v, int src) { return ::kvq_emu::shfl_u(v, src); }
KVQ_DEV int shfl(int v, int src) { return (int)::kvq_emu::shfl_u((uint32_t)v, src); }
#else
KVQ_DEV float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVQ_DEV uint32_t shfl_xor(uint32_t v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVQ_DEV int shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
KVQ_DEV float shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KVQ_DEV uint32_t shfl(uint32_t v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KVQ_DEV int shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
#endif

}  // namespace kvq_cuda
