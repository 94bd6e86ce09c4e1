// Host emulation of the CUDA subset kernelize's generated kernels use, so the same .cu source compiles
// with g++ and runs on the CPU (semantic tests without a GPU).
//
// Each block's threads are fibers (ucontext). __syncthreads() switches back to the scheduler, which runs
// every other live thread of the block up to the same barrier before any thread passes it: the barrier
// semantics are real, not assumed. A barrier reached by only part of a block is reported and aborts.
// __shared__ variables become function statics, shared by the block's fibers (blocks run one at a time).
// f16/bf16 are bit-exact storage types with round-to-nearest-even conversions.
#pragma once
#define KZ_HOST_EMU 1
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

// -- 16-bit storage types -----------------------------------------------------------------------------------
struct __half {
  uint16_t x;
};
struct __nv_bfloat16 {
  uint16_t x;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return (float)f;
}
inline __half __float2half_rn(float v) {
  _Float16 f = (_Float16)v;  // IEEE round to nearest even
  __half h;
  std::memcpy(&h.x, &f, 2);
  return h;
}
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.x = u;
  return h;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  __nv_bfloat16 b;
  if (std::isnan(v)) {
    b.x = (uint16_t)((u >> 16) | 0x40);  // keep it a quiet NaN
  } else {
    b.x = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}

// -- the block scheduler ----------------------------------------------------------------------------------
namespace kz_emu {
constexpr size_t kStack = 256 * 1024;
inline ucontext_t sched;
inline std::vector<ucontext_t> fibers;
inline std::vector<char> done;
inline unsigned current = 0;
inline std::function<void()> body;
inline char error[256] = "";

inline void set_thread(unsigned t) {
  threadIdx.x = t % blockDim.x;
  threadIdx.y = (t / blockDim.x) % blockDim.y;
  threadIdx.z = t / (blockDim.x * blockDim.y);
}

inline void entry() {
  body();
  done[current] = 1;  // returning resumes `sched` through uc_link
}

inline void syncthreads() { swapcontext(&fibers[current], &sched); }
inline std::vector<uint64_t> lanes;  // one exchange slot per thread of the block, for shuffles

// Run `fn` as a kernel over grid x block; returns 0, or 1 with `error` set on a divergent barrier.
inline int launch(dim3 grid, dim3 block, std::function<void()> fn) {
  gridDim = grid;
  blockDim = block;
  body = std::move(fn);
  const unsigned nt = block.x * block.y * block.z;
  std::vector<std::vector<char>> stacks(nt, std::vector<char>(kStack));
  fibers.assign(nt, ucontext_t{});
  lanes.assign(nt, 0);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx.x = bx, blockIdx.y = by, blockIdx.z = bz;
        done.assign(nt, 0);
        for (unsigned t = 0; t < nt; ++t) {
          getcontext(&fibers[t]);
          fibers[t].uc_stack.ss_sp = stacks[t].data();
          fibers[t].uc_stack.ss_size = kStack;
          fibers[t].uc_link = &sched;
          makecontext(&fibers[t], entry, 0);
        }
        for (;;) {  // one phase: every live thread runs to its next barrier or to its end
          unsigned live = 0, finished = 0;
          for (unsigned t = 0; t < nt; ++t) {
            if (done[t]) continue;
            current = t;
            set_thread(t);
            swapcontext(&sched, &fibers[t]);
            ++live;
            finished += done[t];
          }
          if (live == 0) break;
          if (finished != 0 && finished != live) {
            std::snprintf(error, sizeof error, "divergent __syncthreads in block (%u,%u,%u): %u of %u threads ended",
                          bx, by, bz, finished, live);
            return 1;
          }
        }
      }
  return 0;
}
}  // namespace kz_emu

inline void __syncthreads() { kz_emu::syncthreads(); }

// Fibers switch only at barriers and blocks run one at a time, so a plain read-modify-write is atomic here.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

// __shfl_xor_sync as an exchange between two barriers: publish, wait for the whole block, read the
// partner lane's slot, wait again before the slots are reused. Stricter than a warp-level sync (every
// thread of the block must take part, else the divergence check fires), never laxer.
template <class T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a value wider than 64 bits");
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  std::memcpy(&kz_emu::lanes[t], &v, sizeof(T));
  __syncthreads();
  T out;
  std::memcpy(&out, &kz_emu::lanes[t ^ (unsigned)lane_mask], sizeof(T));
  __syncthreads();
  return out;
}
