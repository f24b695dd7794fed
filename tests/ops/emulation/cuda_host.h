// CUDA on the host, for running ops/csrc's kernels and launchers on a CPU (tests/ops/test_kernel_emulation.py).
// Each .cu is compiled by the host C++ compiler after this header, with its launches `k<<<grid, block, ...>>>(args)`
// rewritten to emu_launch(grid, block, [&] { k(args); }): the blocks run one at a time (so a static local is the
// block's shared memory), each block's threads as host
// threads that meet at __syncwarp / warp votes / __shfl_xor_sync / __shfl_sync (per warp of 32) and __syncthreads (per block)
// through barriers. Accesses the GPU would fault on are counted: a cp.async whose address is not 4-byte aligned
// here, a vector load or store at an address its type's alignment forbids by the alignment sanitizer the library is
// built with. A cp.async lands only at the thread's wait (garbage before). Not seen: races the barriers do not order
// (host threads run freely), reads past an allocation that land in other memory, shared memory never written in a
// block (it keeps the last block's values). The GPU's own arithmetic (MUFU exp2, flush to zero), its memory model beyond barriers, and timing are
// not emulated.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static   // one block runs at a time: a static local is the block's shared memory
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

// ---- the grid and its barriers (one instance across the library's translation units: inline variables)
inline thread_local uint3 emu_threadIdx, emu_blockIdx;
inline thread_local int emu_tid;   // linear thread index in the block
inline dim3 emu_blockDim, emu_gridDim;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

struct EmuWarp {
  std::unique_ptr<std::barrier<>> bar;
  unsigned votes[32];
  float xchg[32];
};
inline std::unique_ptr<std::barrier<>> emu_block_bar;
inline std::vector<EmuWarp> emu_warps;

inline void emu_launch(dim3 grid, dim3 block, const std::function<void()> &kernel) {
  const int threads = block.x * block.y * block.z;
  emu_blockDim = block;
  emu_gridDim = grid;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        emu_block_bar = std::make_unique<std::barrier<>>(threads);
        emu_warps = std::vector<EmuWarp>((threads + 31) / 32);
        for (int w = 0; w * 32 < threads; ++w) emu_warps[w].bar = std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w));
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            emu_tid = t;
            emu_threadIdx = make_uint3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
            emu_blockIdx = make_uint3(bx, by, bz);
            kernel();
          });
        for (auto &th : pool) th.join();
      }
}

inline EmuWarp &emu_warp() { return emu_warps[emu_tid / 32]; }
inline void emu_syncwarp() { emu_warp().bar->arrive_and_wait(); }
inline unsigned emu_ballot(bool pred) {
  EmuWarp &w = emu_warp();
  w.votes[emu_tid % 32] = pred;
  w.bar->arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= (w.votes[i] ? 1u : 0u) << i;
  w.bar->arrive_and_wait();
  return m;
}
template <typename T>
inline T emu_shfl_xor(T v, int o) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  EmuWarp &w = emu_warp();
  std::memcpy(&w.xchg[emu_tid % 32], &v, 4);
  w.bar->arrive_and_wait();
  T r;
  std::memcpy(&r, &w.xchg[(emu_tid % 32) ^ o], 4);
  w.bar->arrive_and_wait();
  return r;
}
template <typename T>
inline T emu_shfl(T v, int src) {   // __shfl_sync: every lane reads lane src's value
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  EmuWarp &w = emu_warp();
  std::memcpy(&w.xchg[emu_tid % 32], &v, 4);
  w.bar->arrive_and_wait();
  T r;
  std::memcpy(&r, &w.xchg[src & 31], 4);
  w.bar->arrive_and_wait();
  return r;
}
#define __syncwarp(...) emu_syncwarp()
#define __syncthreads() emu_block_bar->arrive_and_wait()
#define __ballot_sync(mask, pred) emu_ballot(pred)
#define __all_sync(mask, pred) (emu_ballot(pred) == 0xffffffffu)
#define __shfl_xor_sync(mask, v, o) emu_shfl_xor(v, o)
#define __shfl_sync(mask, v, src) emu_shfl(v, src)
#define __cvta_generic_to_shared(p) ((size_t)(p))
#define cudaFuncSetAttribute(...) cudaSuccess

template <typename T>
inline T atomicAdd(T *addr, T v) { return std::atomic_ref<T>(*addr).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T>
inline T __ldg(const T *p) { return *p; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __expf(float x) { return std::exp(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
using std::max;
using std::min;

// ---- accesses the GPU would fault on (misaligned address), counted; the first one described
inline std::atomic<int> emu_faults{0};
inline char emu_fault_text[256];
inline void emu_fault(const char *what, const void *addr, int align) {
  if (emu_faults.fetch_add(1) == 0)
    std::snprintf(emu_fault_text, sizeof(emu_fault_text), "%s at %p: not %d-byte aligned (block %u,%u,%u thread %d)",
                  what, addr, align, blockIdx.x, blockIdx.y, blockIdx.z, emu_tid);
}

// cp_async.cuh's copies: the destination holds garbage (0xff bytes: NaN for float) until the thread waits for its
// copies, as on the GPU, where they land at some time before the wait; so a read before the wait shows
struct EmuCopy {
  void *dst;
  const void *src;
  int size, bytes;   // the copy's size (4 or 16) and the bytes read from src (the rest zero-filled)
};
inline thread_local std::vector<EmuCopy> emu_pending;
namespace packloader_ops {
inline void emu_cp_async(void *dst, const void *src, int size, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(src) % size) emu_fault("cp.async source", src, size);
  if (reinterpret_cast<uintptr_t>(dst) % size) emu_fault("cp.async destination", dst, size);
  std::memset(dst, 0xff, size);
  emu_pending.push_back({dst, src, size, src_bytes});
}
inline void cp_async4(void *dst, const void *src, int src_bytes) { emu_cp_async(dst, src, 4, src_bytes); }
inline void cp_async16(void *dst, const void *src, int src_bytes) { emu_cp_async(dst, src, 16, src_bytes); }
inline void cp_async_commit() {}
inline void cp_async_wait_all() {
  for (const EmuCopy &c : emu_pending) {
    std::memset(c.dst, 0, c.size);   // zero-filled past src_bytes
    if (c.bytes > 0 && reinterpret_cast<uintptr_t>(c.src) % c.size == 0) std::memcpy(c.dst, c.src, c.bytes);
  }
  emu_pending.clear();
}
}  // namespace packloader_ops
