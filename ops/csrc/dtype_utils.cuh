#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace packloader_ops {

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
// log(1 + e^x) = max(x, 0) + log1p(v), v = e^-|x| in (0, 1]: one exponential and log1p(v) = v p(v), p a degree-9
// polynomial (Chebyshev fit on [0, 1]; within 1.5e-7 of log1p relatively, float32's log1pf within 2e-7), no branch:
// 14 instructions where log1pf(__expf(x)) took about 35 and two branches, once per (channel, timestep) in the scans
// and the segment sums
__device__ __forceinline__ float softplus_(float x) {
  const float v = __expf(-fabsf(x));
  float q = -0.0032140363473445177f;
  q = fmaf(q, v, 0.019649166613817215f);
  q = fmaf(q, v, -0.056435029953718185f);
  q = fmaf(q, v, 0.10533228516578674f);
  q = fmaf(q, v, -0.1525145173072815f);
  q = fmaf(q, v, 0.19651491940021515f);
  q = fmaf(q, v, -0.24947808682918549f);
  q = fmaf(q, v, 0.3332909941673279f);
  q = fmaf(q, v, -0.4999985098838806f);
  q = fmaf(q, v, 1.f);
  return fmaxf(x, 0.f) + v * q;
}

}  // namespace packloader_ops
