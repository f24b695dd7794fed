// Packed causal depthwise conv1d, forward and backward. Lag-k tap (weight[:, W-1-k] times x[t-k]) is used at
// time t only where position_ids[t] >= k, so no tap reaches into the previous sequence of a packed row.
//
// Each thread owns one (batch, channel) and a run of kRun consecutive timesteps: it loads the run plus the
// W-1 halo once into registers and reads position_ids once per timestep.  Channel-first: the 128 threads of a
// block walk consecutive runs of one channel (16-byte vector loads where aligned).  Channel-last: a block is
// 32 channels x 4 runs, consecutive threads on consecutive channels, so every load is coalesced over d.
// Backward: g = dout * act'(pre) is recomputed on the run plus W-1 ahead, then
// dx[t] = sum_k w[W-1-k] g[t+k] [pos[t+k] >= k]; dweight/dbias are reduced in the block, one atomic per block.
#include "ops_common.h"
#include "dtype_utils.cuh"

namespace packloader_ops {

namespace {

constexpr int kRun = 8;
constexpr int kBX = 32, kBY = 4;   // block shape

template <typename T>
__device__ __forceinline__ void load_run_vec(const T *ptr, float (&v)[kRun]) {
  // kRun elements, 16-byte aligned
  constexpr int kPerVec = 16 / sizeof(T);
  constexpr int kNV = kRun / kPerVec;
#pragma unroll
  for (int i = 0; i < kNV; ++i) {
    uint4 raw = reinterpret_cast<const uint4 *>(ptr)[i];
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) v[i * kPerVec + k] = to_f(e[k]);
  }
}

template <typename T>
__device__ __forceinline__ void store_run_vec(T *ptr, const float (&v)[kRun]) {
  constexpr int kPerVec = 16 / sizeof(T);
  constexpr int kNV = kRun / kPerVec;
#pragma unroll
  for (int i = 0; i < kNV; ++i) {
    uint4 raw;
    T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) e[k] = from_f<T>(v[i * kPerVec + k]);
    reinterpret_cast<uint4 *>(ptr)[i] = raw;
  }
}

struct Coords { int b, d, t0; };

template <bool kCL>
__device__ __forceinline__ Coords coords() {
  Coords c;
  c.b = blockIdx.z;
  if (kCL) {
    c.d = blockIdx.x * kBX + threadIdx.x;
    c.t0 = (blockIdx.y * kBY + threadIdx.y) * kRun;
  } else {
    c.d = blockIdx.x;
    c.t0 = (blockIdx.y * (kBX * kBY) + threadIdx.y * kBX + threadIdx.x) * kRun;
  }
  return c;
}

template <typename T, int kW, bool kCL>
__global__ void __launch_bounds__(kBX * kBY) conv_fwd_kernel(const ConvParams p) {
  const Coords c = coords<kCL>();
  if (c.d >= p.dim || c.t0 >= p.seqlen) return;
  const int L = p.seqlen;
  const T *x = reinterpret_cast<const T *>(p.x) + c.b * p.x_bs + c.d * p.x_cs;
  T *out = reinterpret_cast<T *>(p.out) + c.b * p.x_bs + c.d * p.x_cs;
  const int *pos = p.pos + (int64_t)c.b * L;
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) w[k] = p.weight[c.d * kW + k];
  const float bias = p.bias ? p.bias[c.d] : 0.f;
  // xs[i] = x[t0 - (kW-1) + i]
  float xs[kRun + kW - 1];
#pragma unroll
  for (int i = 0; i < kW - 1; ++i) {
    const int t = c.t0 - (kW - 1) + i;
    xs[i] = t >= 0 ? to_f(x[t * p.x_ls]) : 0.f;
  }
  const bool full = c.t0 + kRun <= L;
  float main[kRun];
  if (!kCL && full && p.x_ls == 1 && ((reinterpret_cast<uintptr_t>(x + c.t0) & 15) == 0)) {
    load_run_vec<T>(x + c.t0, main);
  } else {
#pragma unroll
    for (int i = 0; i < kRun; ++i) main[i] = (c.t0 + i < L) ? to_f(x[(c.t0 + i) * p.x_ls]) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < kRun; ++i) xs[kW - 1 + i] = main[i];
  float o[kRun];
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const int t = c.t0 + i;
    const int ps = t < L ? pos[t] : 0;
    float acc = bias;
#pragma unroll
    for (int k = 0; k < kW; ++k) acc += (k <= ps ? w[kW - 1 - k] : 0.f) * xs[i + kW - 1 - k];
    if (p.silu) acc = acc * sigmoidf_(acc);
    o[i] = acc;
  }
  if (!kCL && full && p.x_ls == 1 && ((reinterpret_cast<uintptr_t>(out + c.t0) & 15) == 0)) {
    store_run_vec<T>(out + c.t0, o);
  } else {
#pragma unroll
    for (int i = 0; i < kRun; ++i)
      if (c.t0 + i < L) out[(c.t0 + i) * p.x_ls] = from_f<T>(o[i]);
  }
}

template <typename T, int kW, bool kCL>
__global__ void __launch_bounds__(kBX * kBY) conv_bwd_kernel(const ConvParams p) {
  __shared__ float s_acc[kBX][kW + 1];
  const int tid = threadIdx.y * kBX + threadIdx.x;
  for (int i = tid; i < kBX * (kW + 1); i += kBX * kBY) s_acc[i / (kW + 1)][i % (kW + 1)] = 0.f;
  __syncthreads();
  const Coords c = coords<kCL>();
  const int L = p.seqlen;
  float dw[kW + 1];   // dw[k] for weight index k, dw[kW] = dbias
#pragma unroll
  for (int k = 0; k <= kW; ++k) dw[k] = 0.f;
  if (c.d < p.dim && c.t0 < L) {
    const T *x = reinterpret_cast<const T *>(p.x) + c.b * p.x_bs + c.d * p.x_cs;
    const T *dout = reinterpret_cast<const T *>(p.dout) + c.b * p.g_bs + c.d * p.g_cs;
    T *dx = reinterpret_cast<T *>(p.dx) + c.b * p.x_bs + c.d * p.x_cs;
    const int *pos = p.pos + (int64_t)c.b * L;
    float w[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = p.weight[c.d * kW + k];
    const float bias = p.bias ? p.bias[c.d] : 0.f;
    constexpr int kNX = kRun + 2 * (kW - 1);   // x[t0-(W-1) .. t0+kRun-1+(W-1)]
    constexpr int kNG = kRun + kW - 1;         // g[t0 .. t0+kRun-1+(W-1)]
    float xs[kNX];
#pragma unroll
    for (int i = 0; i < kNX; ++i) {
      const int t = c.t0 - (kW - 1) + i;
      xs[i] = (t >= 0 && t < L) ? to_f(x[t * p.x_ls]) : 0.f;
    }
    float g[kNG];
    int ps[kNG];
#pragma unroll
    for (int i = 0; i < kNG; ++i) {
      const int t = c.t0 + i;
      ps[i] = t < L ? pos[t] : 0;
      float gv = t < L ? to_f(dout[t * p.g_ls]) : 0.f;
      if (p.silu) {
        float acc = bias;
#pragma unroll
        for (int k = 0; k < kW; ++k) acc += (k <= ps[i] ? w[kW - 1 - k] : 0.f) * xs[i + kW - 1 - k];
        const float sg = sigmoidf_(acc);
        gv *= sg * (1.f + acc * (1.f - sg));
      }
      g[i] = gv;
    }
    float dxv[kRun];
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k) acc += (k <= ps[i + k] ? w[kW - 1 - k] : 0.f) * g[i + k];
      dxv[i] = acc;
      if (c.t0 + i < L) {
#pragma unroll
        for (int k = 0; k < kW; ++k) dw[kW - 1 - k] += (k <= ps[i] ? g[i] : 0.f) * xs[i + kW - 1 - k];
        dw[kW] += g[i];
      }
    }
    const bool full = c.t0 + kRun <= L;
    if (!kCL && full && p.x_ls == 1 && ((reinterpret_cast<uintptr_t>(dx + c.t0) & 15) == 0)) {
      store_run_vec<T>(dx + c.t0, dxv);
    } else {
#pragma unroll
      for (int i = 0; i < kRun; ++i)
        if (c.t0 + i < L) dx[(c.t0 + i) * p.x_ls] = from_f<T>(dxv[i]);
    }
  }
  if (!kCL) {
    // whole block is one channel: warp reduce, then shared
#pragma unroll
    for (int k = 0; k <= kW; ++k) {
      float v = dw[k];
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (threadIdx.x == 0) atomicAdd(&s_acc[0][k], v);
    }
  } else {
#pragma unroll
    for (int k = 0; k <= kW; ++k) atomicAdd(&s_acc[threadIdx.x][k], dw[k]);
  }
  __syncthreads();
  if (threadIdx.y == 0) {
    const int d = kCL ? c.d : (int)blockIdx.x;
    if ((kCL || threadIdx.x == 0) && d < p.dim) {
      const int slot = kCL ? threadIdx.x : 0;
#pragma unroll
      for (int k = 0; k < kW; ++k) atomicAdd(p.dweight + d * kW + k, s_acc[slot][k]);
      if (p.dbias) atomicAdd(p.dbias + d, s_acc[slot][kW]);
    }
  }
}

template <bool kCL>
dim3 conv_grid(const ConvParams &p) {
  const int runs = (p.seqlen + kRun - 1) / kRun;
  if (kCL) return dim3((p.dim + kBX - 1) / kBX, (runs + kBY - 1) / kBY, p.batch);
  return dim3(p.dim, (runs + kBX * kBY - 1) / (kBX * kBY), p.batch);
}

template <typename T, int kW, bool kCL>
void launch_w(const ConvParams &p, cudaStream_t st, bool bwd) {
  dim3 grid = conv_grid<kCL>(p), block(kBX, kBY);
  if (bwd) conv_bwd_kernel<T, kW, kCL><<<grid, block, 0, st>>>(p);
  else conv_fwd_kernel<T, kW, kCL><<<grid, block, 0, st>>>(p);
}

template <typename T, bool kCL>
void launch_cl(const ConvParams &p, cudaStream_t st, bool bwd) {
  switch (p.width) {
    case 2: launch_w<T, 2, kCL>(p, st, bwd); break;
    case 3: launch_w<T, 3, kCL>(p, st, bwd); break;
    default: launch_w<T, 4, kCL>(p, st, bwd); break;
  }
}

template <typename T>
void launch_t(const ConvParams &p, cudaStream_t st, bool bwd) {
  if (p.channel_last) launch_cl<T, true>(p, st, bwd);
  else launch_cl<T, false>(p, st, bwd);
}

void launch(const ConvParams &p, cudaStream_t st, bool bwd) {
  switch (p.dtype) {
    case kF32: launch_t<float>(p, st, bwd); break;
    case kF16: launch_t<__half>(p, st, bwd); break;
    default: launch_t<__nv_bfloat16>(p, st, bwd); break;
  }
}

}  // namespace

void conv_fwd_launch(const ConvParams &p, cudaStream_t st) { launch(p, st, false); }
void conv_bwd_launch(const ConvParams &p, cudaStream_t st) { launch(p, st, true); }

}  // namespace packloader_ops
