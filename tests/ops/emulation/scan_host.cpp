// Host emulation of the CUDA selective scan (ops/csrc/selective_scan.cu): the kernels' own source, compiled by the
// host C++ compiler; each block's threads run as threads that meet at __syncwarp / __ballot_sync / __shfl_xor_sync
// (per warp) and __syncthreads (per block) through barriers, one block at a time (so a static local is the block's
// shared memory and the deterministic mode's tickets come in order). tests/ops/test_scan_emulation.py splices the
// .cu (without its CUDA launchers, whose <<<>>> the host compiler cannot read) in where KERNEL_SOURCE is included.
// What it checks on a CPU is the kernels' indexing, chunk and run bookkeeping, group split, tails, reset mask and the
// reductions' order (the backward's recomputed output must be the forward's, bit for bit); the GPU's own arithmetic
// (MUFU exp2, flush to zero), its memory model beyond barriers, and timing are not emulated.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstring>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

thread_local uint3 emu_threadIdx, emu_blockIdx;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
constexpr int kEmuMaxWarps = 4;
static std::barrier<> *emu_block_bar = nullptr;
static std::unique_ptr<std::barrier<>> emu_warp_bar[kEmuMaxWarps];
static unsigned emu_votes[kEmuMaxWarps][32];
static float emu_xchg[kEmuMaxWarps][32];
inline void emu_syncwarp() { emu_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline void emu_syncthreads() { emu_block_bar->arrive_and_wait(); }
inline unsigned emu_ballot(bool pred) {
  const int w = threadIdx.x / 32;
  emu_votes[w][threadIdx.x % 32] = pred;
  emu_syncwarp();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= emu_votes[w][i] << i;
  emu_syncwarp();
  return m;
}
inline float emu_shfl_xor(float v, int o) {
  const int w = threadIdx.x / 32;
  emu_xchg[w][threadIdx.x % 32] = v;
  emu_syncwarp();
  const float r = emu_xchg[w][(threadIdx.x % 32) ^ o];
  emu_syncwarp();
  return r;
}
template <typename T>
inline T atomicAdd(T *addr, T v) { return std::atomic_ref<T>(*addr).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#define __syncwarp(...) emu_syncwarp()
#define __syncthreads() emu_syncthreads()
#define __ballot_sync(mask, pred) emu_ballot(pred)
#define __shfl_xor_sync(mask, v, o) emu_shfl_xor(v, o)
#define __cvta_generic_to_shared(p) ((size_t)(p))
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __expf(float x) { return std::exp(x); }
using std::min;

// accesses the GPU would fault on (misaligned address), counted instead; the first one described
static std::atomic<int> emu_faults{0};
static char emu_fault_text[256];
inline void emu_fault(const char *what, const void *addr, int align) {
  if (emu_faults.fetch_add(1) == 0)
    std::snprintf(emu_fault_text, sizeof(emu_fault_text), "%s at %p: not %d-byte aligned (block %u,%u thread %u)",
                  what, addr, align, blockIdx.x, blockIdx.y, threadIdx.x);
}
extern "C" int emu_fault_count() { return emu_faults.exchange(0); }
extern "C" const char *emu_first_fault() { return emu_fault_text; }

namespace packloader_ops {   // cp_async.cuh's copies, done at once (the kernels wait for them before reading anyway)
inline void cp_async4(void *dst, const void *src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(src) % 4) emu_fault("cp.async source", src, 4);
  if (reinterpret_cast<uintptr_t>(dst) % 4) emu_fault("cp.async destination", dst, 4);
  std::memset(dst, 0, 4);
  if (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0) std::memcpy(dst, src, src_bytes);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}
}  // namespace packloader_ops

#include KERNEL_SOURCE

using namespace packloader_ops;

// grid (gx, gy) of blocks of `threads`, one block at a time, blockIdx.x ascending within blockIdx.y
template <typename F>
static void run_grid(int gx, int gy, int threads, F &&kernel) {
  for (int by = 0; by < gy; ++by)
    for (int bx = 0; bx < gx; ++bx) {
      std::barrier<> block_bar(threads);
      emu_block_bar = &block_bar;
      for (int w = 0; w < threads / 32; ++w) emu_warp_bar[w] = std::make_unique<std::barrier<>>(32);
      std::vector<std::thread> lanes;
      for (int t = 0; t < threads; ++t)
        lanes.emplace_back([&, t] {
          emu_threadIdx = make_uint3(t, 0, 0);
          emu_blockIdx = make_uint3(bx, by, 0);
          kernel();
        });
      for (auto &t : lanes) t.join();
    }
}

static ScanParams params(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                         int softplus, const void *u, const void *delta, const float *A, const void *B, const void *C,
                         const float *D, const void *z, const float *delta_bias, const int *pos, float *saved) {
  ScanParams p{};
  p.batch = batch; p.dim = dim; p.seqlen = seqlen; p.dstate = dstate; p.n_groups = n_groups;
  p.dim_per_group = dim / n_groups; p.nchunks = (seqlen + kScanChunk - 1) / kScanChunk; p.softplus = softplus;
  p.in_dtype = in_dtype; p.w_f32 = w_f32;
  p.u = u; p.delta = delta; p.B = B; p.C = C; p.z = z; p.A = A; p.D = D; p.delta_bias = delta_bias; p.pos = pos;
  p.saved = saved;
  return p;
}

template <typename F>
static void for_types(const ScanParams &p, F &&f) {
  dtype_switch(p.in_dtype, [&](auto tag) {
    using in_t = decltype(tag);
    if (p.w_f32) f(in_t{}, float{});
    else f(in_t{}, in_t{});
  });
}

// the forward (fwd_launch's choices); returns 1 when its cp.async staging ran, 0 for plain loads
extern "C" int emu_scan_fwd(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                            int softplus, const void *u, const void *delta, const float *A, const void *B,
                            const void *C, const float *D, const void *z, const float *delta_bias, const int *pos,
                            void *out, float *saved) {
  ScanParams p = params(in_dtype, w_f32, batch, dim, seqlen, dstate, n_groups, softplus, u, delta, A, B, C, D, z,
                        delta_bias, pos, saved);
  p.out = out;
  int async_ = 0;
  for_types(p, [&](auto in_tag, auto w_tag) {
    using in_t = decltype(in_tag);
    using w_t = decltype(w_tag);
    async_ = use_async<in_t, w_t>(p);
    bool_switch(p.z != nullptr, [&](auto has_z) {
      bool_switch(async_, [&](auto async) {
        run_grid((p.dim + kDB - 1) / kDB, p.batch, kThreads, [&] {
          scan_fwd_kernel<in_t, w_t, decltype(has_z)::value, decltype(async)::value>(p);
        });
      });
    });
  });
  return async_;
}

// the backward (bwd_launch's choices): dB / dC fp32 zeros, dA / dD / ddelta_bias per batch row; deterministic mode
// when det_sem / det_part (zeros, scan_bwd's shapes) are given
extern "C" void emu_scan_bwd(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                             int softplus, const void *u, const void *delta, const float *A, const void *B,
                             const void *C, const float *D, const void *z, const float *delta_bias, const int *pos,
                             float *saved, const void *dout, void *out_rec, void *du, void *ddelta, void *dz,
                             float *dA, float *dB, float *dC, float *dD, float *ddelta_bias, int *det_sem,
                             float *det_part, int det_groups) {
  ScanParams p = params(in_dtype, w_f32, batch, dim, seqlen, dstate, n_groups, softplus, u, delta, A, B, C, D, z,
                        delta_bias, pos, saved);
  p.dout = dout; p.out_rec = out_rec; p.du = du; p.ddelta = ddelta; p.dz = dz;
  p.dA = dA; p.dB = dB; p.dC = dC; p.dD = dD; p.ddelta_bias = ddelta_bias;
  p.det_sem = det_sem; p.det_part = det_part; p.det_groups = det_groups;
  for_types(p, [&](auto in_tag, auto w_tag) {
    using in_t = decltype(in_tag);
    using w_t = decltype(w_tag);
    bool_switch(p.z != nullptr, [&](auto has_z) {
      bool_switch(use_async<in_t, w_t>(p), [&](auto async) {
        run_grid((p.dim + kDB - 1) / kDB, p.batch, kThreads, [&] {
          scan_bwd_kernel<in_t, w_t, decltype(has_z)::value, decltype(async)::value>(p);
        });
      });
    });
  });
}
