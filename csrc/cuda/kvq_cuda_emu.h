// A tiny CUDA emulator, for running the vllm-kvq kernels on a machine without a GPU.
//
// Only included when KVQ_CUDA_EMULATE is defined (see kvq_cuda_compat.cuh). CTAs of a
// launch run one after another; inside a CTA every CUDA thread is a fiber (ucontext) of
// one OS thread, switched at the synchronising points only: __syncthreads, __syncwarp,
// shuffles and the warp-wide matrix instructions emulated by kvq_ptx.cuh. A point where no
// fiber can go on (a barrier some thread never reaches) is reported as a deadlock, which
// on a GPU would be a hang or undefined behaviour. Single-threaded and deterministic: it
// checks the kernels' index arithmetic and warp-level data flow, not their speed.
#pragma once
#include <ucontext.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
typedef void* cudaStream_t;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__ __restrict

namespace kvq_emu {

enum FiberState { kReady, kWaitWarp, kWaitBlock, kDone };

struct Fiber {
  ucontext_t ctx;
  int state = kReady;
  int linear = 0;  // threadIdx linearised (x fastest)
  dim3 tid;
  std::vector<char> stack;
};

struct Warp {
  int live = 0, arrived = 0;
  uint32_t word[32][8];
};

struct Cta {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, arrived = 0;
  ucontext_t sched;
  Fiber* cur = nullptr;
  dim3 block_idx, block_dim, grid_dim;
  std::function<void()> body;
};

inline Cta*& current() {
  static Cta* c = nullptr;
  return c;
}

inline dim3 thread_idx() { return current()->cur->tid; }
inline dim3 block_idx() { return current()->block_idx; }
inline dim3 block_dim() { return current()->block_dim; }
inline dim3 grid_dim() { return current()->grid_dim; }

inline void yield() {
  Cta* c = current();
  swapcontext(&c->cur->ctx, &c->sched);
}

inline void release_warp(Cta* c, int w) {
  c->warps[w].arrived = 0;
  const int n = (int)c->fibers.size();
  for (int i = w * 32; i < (w + 1) * 32 && i < n; ++i)
    if (c->fibers[i].state == kWaitWarp) c->fibers[i].state = kReady;
}
inline void release_block(Cta* c) {
  c->arrived = 0;
  for (auto& f : c->fibers)
    if (f.state == kWaitBlock) f.state = kReady;
}

inline void warp_barrier() {
  Cta* c = current();
  Fiber* f = c->cur;
  Warp& w = c->warps[f->linear / 32];
  if (++w.arrived == w.live) {
    release_warp(c, f->linear / 32);
    return;
  }
  f->state = kWaitWarp;
  yield();
}

inline void block_barrier() {
  Cta* c = current();
  if (++c->arrived == c->live) {
    release_block(c);
    return;
  }
  c->cur->state = kWaitBlock;
  yield();
}

inline int lane() { return current()->cur->linear & 31; }
inline Warp& my_warp() { return current()->warps[current()->cur->linear / 32]; }

// Warp-wide exchange: every lane publishes n words, then reads any lane's.
inline void exchange_publish(const uint32_t* v, int n) {
  Warp& w = my_warp();
  std::memcpy(w.word[lane()], v, sizeof(uint32_t) * n);
  warp_barrier();
}
inline uint32_t exchange_read(int src_lane, int i) { return my_warp().word[src_lane & 31][i]; }
inline void exchange_done() { warp_barrier(); }

inline uint32_t shfl_u(uint32_t v, int src) {
  exchange_publish(&v, 1);
  const uint32_t r = exchange_read(src, 0);
  exchange_done();
  return r;
}
inline uint32_t shfl_xor_u(uint32_t v, int m) { return shfl_u(v, lane() ^ m); }
inline float shfl_f(float v, int src) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = shfl_u(u, src);
  std::memcpy(&v, &u, 4);
  return v;
}
inline float shfl_xor_f(float v, int m) { return shfl_f(v, lane() ^ m); }

inline void fiber_entry() {
  Cta* c = current();
  c->body();
  Fiber* f = c->cur;
  f->state = kDone;
  Warp& w = c->warps[f->linear / 32];
  --w.live;
  if (w.arrived > 0 && w.arrived == w.live) release_warp(c, f->linear / 32);
  --c->live;
  if (c->arrived > 0 && c->arrived == c->live) release_block(c);
  swapcontext(&f->ctx, &c->sched);  // never resumed
}

inline size_t stack_bytes() {
  const char* s = std::getenv("KVQ_EMU_STACK_KB");
  return (size_t)(s ? std::atoi(s) : 256) * 1024;
}

inline void run(dim3 grid, dim3 block, const std::function<void()>& body) {
  const int nthreads = (int)(block.x * block.y * block.z);
  if (nthreads <= 0 || nthreads % 32) throw std::runtime_error("kvq_emu: block size must be a multiple of 32");
  Cta cta;
  cta.body = body;
  cta.block_dim = block;
  cta.grid_dim = grid;
  cta.fibers.resize(nthreads);
  cta.warps.resize(nthreads / 32);
  const size_t sb = stack_bytes();
  for (auto& f : cta.fibers) f.stack.resize(sb);
  Cta* saved = current();
  current() = &cta;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        cta.block_idx = dim3(bx, by, bz);
        cta.live = nthreads;
        cta.arrived = 0;
        for (int w = 0; w < nthreads / 32; ++w) { cta.warps[w].live = 32; cta.warps[w].arrived = 0; }
        for (int i = 0; i < nthreads; ++i) {
          Fiber& f = cta.fibers[i];
          f.state = kReady;
          f.linear = i;
          f.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, (void (*)())fiber_entry, 0);
        }
        int done = 0;
        while (done < nthreads) {
          bool progress = false;
          done = 0;
          for (auto& f : cta.fibers) {
            if (f.state == kReady) {
              cta.cur = &f;
              swapcontext(&cta.sched, &f.ctx);
              progress = true;
            }
            done += f.state == kDone;
          }
          if (!progress && done < nthreads) {
            current() = saved;
            throw std::runtime_error("kvq_emu: deadlock in CTA (" + std::to_string(bx) + "," +
                                     std::to_string(by) + "," + std::to_string(bz) +
                                     "): a barrier or warp collective not reached by all threads");
          }
        }
      }
  current() = saved;
}

template <class F>
struct Launcher;
template <class... P>
struct Launcher<void (*)(P...)> {
  void (*fn)(P...);
  dim3 grid, block;
  Launcher(void (*f)(P...), dim3 g, dim3 b) : fn(f), grid(g), block(b) {}
  template <class... A>
  void operator()(A&&... a) const {
    std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
    auto f = fn;
    run(grid, block, [&]() { std::apply(f, args); });
  }
};

}  // namespace kvq_emu

#define threadIdx (::kvq_emu::thread_idx())
#define blockIdx (::kvq_emu::block_idx())
#define blockDim (::kvq_emu::block_dim())
#define gridDim (::kvq_emu::grid_dim())
#define __syncthreads() ::kvq_emu::block_barrier()
#define __syncwarp() ::kvq_emu::warp_barrier()
