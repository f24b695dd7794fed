// Pieces shared by the packed causal conv1d kernel families (conv_cf_regs.cu, conv_cf_vec.cu, conv_cl.cu):
// short loads/stores, the silu gradient, the channel-first run geometry, the block reduction of dweight / dbias
// and whole-vector global loads.
#pragma once
#include <cstdint>
#include <type_traits>

#include "dtype_utils.cuh"
#include "ops_common.h"

namespace packloader_ops {
namespace conv {

constexpr unsigned kFull = 0xffffffffu;

// ------------------------------------------------------------------------------------------------------------
// loads / stores of a few consecutive elements (vector when aligned and in range, else element by element)

template <typename T, int N>
__device__ __forceinline__ void load_n(const T *ptr, int valid, float (&v)[N]) {
  constexpr int kBytes = N * sizeof(T);
  if (valid >= N && (kBytes == 16 || kBytes == 8) && (reinterpret_cast<uintptr_t>(ptr) % kBytes) == 0) {
    if constexpr (kBytes == 16) {
      uint4 raw = *reinterpret_cast<const uint4 *>(ptr);
      const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = to_f(e[k]);
    } else {
      uint2 raw = *reinterpret_cast<const uint2 *>(ptr);
      const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = to_f(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = k < valid ? to_f(ptr[k]) : 0.f;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_n(T *ptr, int valid, const float (&v)[N]) {
  constexpr int kBytes = N * sizeof(T);
  if (valid >= N && (kBytes == 16 || kBytes == 8) && (reinterpret_cast<uintptr_t>(ptr) % kBytes) == 0) {
    if constexpr (kBytes == 16) {
      uint4 raw;
      T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
      for (int k = 0; k < N; ++k) e[k] = from_f<T>(v[k]);
      *reinterpret_cast<uint4 *>(ptr) = raw;
    } else {
      uint2 raw;
      T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
      for (int k = 0; k < N; ++k) e[k] = from_f<T>(v[k]);
      *reinterpret_cast<uint2 *>(ptr) = raw;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < valid) ptr[k] = from_f<T>(v[k]);
  }
}

__device__ __forceinline__ float silu_grad_factor(float pre) {
  const float sg = sigmoidf_(pre);
  return sg * (1.f + pre * (1.f - sg));
}

// channel-first run geometry
constexpr int kRun = 8;          // timesteps per thread
static_assert(kRun == kConvMaskRun, "a boundary-mask word covers one channel-first run (ops/contract.py)");
constexpr int kThreadsCF = 128;  // 1024 timesteps per block
constexpr int kSpanCF = kRun * kThreadsCF;

// dweight / dbias of one block go to its own slot of the partials (slots, dim, W + 1), which the caller sums in a
// fixed order: no atomics, the same bits every run. A block's slot is its (batch row, time tile); no family has more
// than one slot per PACKLOADER_CONV_SLOT_STEPS timesteps of a row (ops/contract.py sizes the buffer from that).
__device__ __forceinline__ int dw_slot() { return blockIdx.z * gridDim.y + blockIdx.y; }

template <int kW>
__device__ __forceinline__ void block_reduce_dw(float (&dw)[kW + 1], float (*s_red)[kW + 1], float *dw_part,
                                                int d, int dim) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k <= kW; ++k) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) dw[k] += __shfl_xor_sync(kFull, dw[k], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k <= kW; ++k) s_red[warp][k] = dw[k];
  }
  __syncthreads();
  if (threadIdx.x <= kW) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < kThreadsCF / 32; ++wi) s += s_red[wi][threadIdx.x];
    dw_part[(dw_slot() * dim + d) * (kW + 1) + threadIdx.x] = s;
  }
  __syncthreads();
}

// N consecutive elements of global memory at a 16-byte aligned (N * sizeof(T) >= 16) or 8-byte aligned (== 8)
// address, `valid` of them in the row; pieces past it read as zeros. A piece is loaded whole when it starts inside
// the row, so rows must end on a piece boundary (cf_vec_runs: seqlen * sizeof(T) % 16 == 0; channel-last: whole
// vectors of channels).
template <typename T, int N>
struct GVec {
  static constexpr int kBytes = N * sizeof(T);
  static constexpr int kQ = kBytes >= 16 ? kBytes / 16 : 1;
  static constexpr int kE = kBytes >= 16 ? 16 / sizeof(T) : N;
  typename std::conditional<(kBytes >= 16), uint4, uint2>::type raw[kQ];
  __device__ __forceinline__ void load(const T *ptr, int valid) {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (q * kE < valid) {
        if constexpr (kBytes >= 16) raw[q] = __ldg(reinterpret_cast<const uint4 *>(ptr) + q);
        else raw[q] = __ldg(reinterpret_cast<const uint2 *>(ptr));
      } else {
        if constexpr (kBytes >= 16) raw[q] = make_uint4(0u, 0u, 0u, 0u);
        else raw[q] = make_uint2(0u, 0u);
      }
    }
  }
  __device__ __forceinline__ void to_float(float (&v)[N]) const {
    const T *e = reinterpret_cast<const T *>(raw);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = to_f(e[k]);
  }
};

// Each family launches its own kernels for one dtype T and width kW (x / out / dx in the layout the family takes).
// Each returns the dweight slots its backward writes (batch * grid.y): the first slots of ConvParams::dw_part.
template <typename T, int kW> int launch_cf_regs(const ConvParams &p, cudaStream_t st, bool bwd);
template <typename T, int kW> int launch_cf_vec(const ConvParams &p, cudaStream_t st, bool bwd, int runs_per_thread);
template <typename T, int kW> int launch_cl(const ConvParams &p, cudaStream_t st, bool bwd);
int cf_vec_runs(const ConvParams &p, int elt_bytes, bool bwd);

}  // namespace conv
}  // namespace packloader_ops
