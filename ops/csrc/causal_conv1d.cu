// Packed causal depthwise conv1d, forward and backward. Lag-k tap (weight[:, W-1-k] times x[t-k]) is used at
// time t only where position_ids[t] >= k, so no tap reaches into the previous sequence of a packed row.
//
// Channel-first (x contiguous, (batch, dim, seqlen)): each thread owns runs of kRun = 8 consecutive timesteps
// (one 16-byte load for bf16/fp16) and 128 threads cover 1024 timesteps. Rows that are 16-byte aligned (the
// usual case) go to the vector kernels, which read boundaries as one mask word per run (see "channel-first,
// vector kernels"); the others to the register kernels, which turn position_ids into "reach" (how many earlier
// taps lie in the same sequence, min(pos, W-1)) in registers. There the forward block walks kChCF channels with
// one read of position_ids and the backward block owns one channel and walks the whole row. The W-1 inputs before
// a run (and, in the backward, the W-1 inputs and gradients after it) come from the neighbouring runs' vectors,
// loaded by the thread itself together with its own.
// Channel-last (x is (batch, seqlen, dim) memory): each thread owns consecutive channels (one vector load per
// timestep) and a run of timesteps, sliding a window of the last W inputs (forward) or the last W gradients
// (backward) through registers; position_ids[t] is one broadcast load per timestep. On aligned rows the loads of
// 8 timesteps are issued together (0.31 + 0.78 ms -> 0.23 + 0.45 ms on the H200 at B=8, D=4096, L=4096 bf16).
// dweight / dbias are reduced in the block (warp shuffles, then shared memory), one atomic per block.
// Every kernel skips a dropped tap's multiply-add instead of multiplying by zero, so an inf or NaN in one
// sequence cannot reach another as 0 * inf. position_ids must restart at 0 and count up by 1 (the Python layer
// validates them): the register and channel-last kernels read reach = min(pos, W-1), the vector kernels a start
// where pos == 0, which agree on valid ids only.

#include "ops_common.h"
#include "dtype_utils.cuh"
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace packloader_ops {

namespace {

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

// ------------------------------------------------------------------------------------------------------------
// channel-first

constexpr int kRun = 8;          // timesteps per thread
constexpr int kThreadsCF = 128;  // 1024 timesteps per block
constexpr int kSpanCF = kRun * kThreadsCF;
constexpr int kChCF = 4;         // channels walked by one block (position_ids read once for all)

__device__ __forceinline__ void load_reach(const int *pos, int t0, int L, int wm1, int (&reach)[kRun]) {
  if (t0 + kRun <= L && (reinterpret_cast<uintptr_t>(pos + t0) & 15) == 0) {
    const int4 a = *reinterpret_cast<const int4 *>(pos + t0);
    const int4 b = *reinterpret_cast<const int4 *>(pos + t0 + 4);
    reach[0] = a.x; reach[1] = a.y; reach[2] = a.z; reach[3] = a.w;
    reach[4] = b.x; reach[5] = b.y; reach[6] = b.z; reach[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < kRun; ++i) reach[i] = t0 + i < L ? pos[t0 + i] : 0;
  }
#pragma unroll
  for (int i = 0; i < kRun; ++i) reach[i] = min(reach[i], wm1);
}

// The W-1 inputs before a run and the W-1 after it are the tail / head of the neighbouring runs: each thread
// loads those runs' 16-byte vectors itself (L1 hits: the neighbours load the same lines), so every load of a
// thread is issued at once and nothing waits on another lane.
template <typename T>
__device__ __forceinline__ void load_prev_run(const T *row, int t0, int L, float (&v)[kRun]) {
  if (t0 >= kRun) load_n<T, kRun>(row + t0 - kRun, min(kRun, L - (t0 - kRun)), v);
  else {
#pragma unroll
    for (int i = 0; i < kRun; ++i) v[i] = 0.f;
  }
}

template <typename T, int kW>
__global__ void __launch_bounds__(kThreadsCF) conv_fwd_cf(const ConvParams p) {
  const int b = blockIdx.z;
  const int L = p.seqlen;
  const int t0 = blockIdx.y * kSpanCF + threadIdx.x * kRun;
  if (t0 >= L) return;
  const int valid = min(kRun, L - t0);
  int reach[kRun];
  load_reach(p.pos + (int64_t)b * L, t0, L, kW - 1, reach);
#pragma unroll 1
  for (int c = 0; c < kChCF; ++c) {
    const int d = blockIdx.x * kChCF + c;
    if (d >= p.dim) break;
    const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d * p.x_cs;
    T *out = reinterpret_cast<T *>(p.out) + b * p.x_bs + d * p.x_cs;
    float prev[kRun], main[kRun];
    load_prev_run<T>(x, t0, L, prev);
    load_n<T, kRun>(x + t0, valid, main);
    float w[kW];
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = p.weight[d * kW + k];
    const float bias = p.bias ? p.bias[d] : 0.f;
    float xs[kRun + kW - 1];   // x[t0 - (kW-1) + i]
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) xs[k] = prev[kRun - (kW - 1) + k];
#pragma unroll
    for (int i = 0; i < kRun; ++i) xs[kW - 1 + i] = main[i];
    float o[kRun];
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      float acc = bias;
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (k <= reach[i]) acc = fmaf(w[kW - 1 - k], xs[i + kW - 1 - k], acc);
      o[i] = p.silu ? acc * sigmoidf_(acc) : acc;
    }
    store_n<T, kRun>(out + t0, valid, o);
  }
}

template <int kW>
__device__ __forceinline__ void block_reduce_dw(float (&dw)[kW + 1], float (*s_red)[kW + 1], float *dweight,
                                                float *dbias, int d) {
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
    if (threadIdx.x < kW) atomicAdd(dweight + d * kW + threadIdx.x, s);
    else if (dbias) atomicAdd(dbias + d, s);
  }
  __syncthreads();
}

// Backward: one block per (batch row, channel) walking the whole row in 1024-step chunks, dweight accumulated in
// registers and reduced once per block; halos are 4-element vectors of the neighbouring runs, loaded with the
// thread's own (no lane waits on another).  (Measured on the H200 against a kernel with kChCF channels per block,
// one chunk each, halos by lane shuffles: 0.65 vs 0.80 ms fwd+bwd at B=8, D=4096, L=4096 bf16.)
template <typename T, int kW>
__global__ void __launch_bounds__(kThreadsCF) conv_bwd_cf(const ConvParams p) {
  static_assert(kW - 1 <= 4, "halo vectors hold 4 elements");
  __shared__ float s_red[kThreadsCF / 32][kW + 1];
  const int b = blockIdx.z, d = blockIdx.x;
  const int L = p.seqlen;
  const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d * p.x_cs;
  const T *dout = reinterpret_cast<const T *>(p.dout) + b * p.g_bs + d * p.g_cs;
  T *dx = reinterpret_cast<T *>(p.dx) + b * p.x_bs + d * p.x_cs;
  const int *pos = p.pos + (int64_t)b * L;
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) w[k] = p.weight[d * kW + k];
  const float bias = p.bias ? p.bias[d] : 0.f;
  float dw[kW + 1];
#pragma unroll
  for (int k = 0; k <= kW; ++k) dw[k] = 0.f;
#pragma unroll 1
  for (int tb = 0; tb < L; tb += kSpanCF) {
    const int t0 = tb + threadIdx.x * kRun;
    if (t0 >= L) break;
    const int valid = min(kRun, L - t0);
    const int valid_nx = max(0, min(4, L - (t0 + kRun)));
    float main[kRun], gd[kRun], pv[4], nx[4], gn[4];
    load_n<T, kRun>(x + t0, valid, main);
    load_n<T, kRun>(dout + t0, valid, gd);
    if (t0 >= 4) load_n<T, 4>(x + t0 - 4, 4, pv);
    else {
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[i] = 0.f;
    }
    if (valid_nx > 0) {
      load_n<T, 4>(x + t0 + kRun, valid_nx, nx);
      load_n<T, 4>(dout + t0 + kRun, valid_nx, gn);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) nx[i] = gn[i] = 0.f;
    }
    int reach[kRun], reach_nx[kW - 1];
    load_reach(pos, t0, L, kW - 1, reach);
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) reach_nx[k] = k < valid_nx ? min(pos[t0 + kRun + k], kW - 1) : 0;
    constexpr int kNX = kRun + 2 * (kW - 1);   // x[t0 - (kW-1) + i]
    constexpr int kNG = kRun + kW - 1;         // g[t0 + i]
    float xs[kNX];
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) xs[k] = pv[4 - (kW - 1) + k];
#pragma unroll
    for (int i = 0; i < kRun; ++i) xs[kW - 1 + i] = main[i];
#pragma unroll
    for (int k = 0; k < kW - 1; ++k) xs[kW - 1 + kRun + k] = nx[k];
    float g[kNG];
#pragma unroll
    for (int i = 0; i < kNG; ++i) {
      const int r = i < kRun ? reach[i] : reach_nx[i - kRun];
      float gv = i < kRun ? gd[i] : gn[i - kRun];   // zero past the end
      if (p.silu) {
        float acc = bias;
#pragma unroll
        for (int k = 0; k < kW; ++k)
          if (k <= r) acc = fmaf(w[kW - 1 - k], xs[i + kW - 1 - k], acc);
        gv *= silu_grad_factor(acc);
      }
      g[i] = gv;
    }
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const int r = (i + k < kRun) ? reach[i + k] : reach_nx[i + k - kRun];
        if (k <= r) acc = fmaf(w[kW - 1 - k], g[i + k], acc);
      }
      main[i] = acc;   // dx
      const float gi = i < valid ? g[i] : 0.f;
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (k <= reach[i]) dw[kW - 1 - k] = fmaf(gi, xs[i + kW - 1 - k], dw[kW - 1 - k]);
      dw[kW] += gi;
    }
    store_n<T, kRun>(dx + t0, valid, main);
  }
  block_reduce_dw<kW>(dw, s_red, p.dweight, p.dbias, d);
}

// ------------------------------------------------------------------------------------------------------------
// channel-first, vector kernels (rows 16-byte aligned, seqlen a multiple of 16 / sizeof(T))
//
// A block owns one (batch row, channel) and a tile of kRpt * 1024 timesteps; each thread owns kRpt runs of
// kRun = 8 timesteps (runs j * 128 + thread, so a warp's runs are 256 consecutive timesteps) and loads every
// vector it needs (its runs' x, the 4 steps before each run, dout in the backward) straight into registers before
// using any, so a thread keeps kRpt 16-byte loads in flight; the 4-step halo is the previous run's tail, an L1 hit.
// Boundaries come from one 16-bit mask per run (conv_runmask_kernel, once per call) instead of 8 position ids
// per run and channel.
//
//   runmask bit i of run r  <=>  token 8r - 4 + i starts a sequence (position_ids == 0, or t == 0) or lies
//                                 outside the row
//   tap k of token t (lag k, weight[:, W-1-k]) is used iff none of tokens t-k+1 .. t starts a sequence
//
//   row:      | a0 a1 a2 | b0 b1 b2 b3 b4 | c0 ...        position_ids 0 1 2 0 1 2 3 4 0 ...
//   b1 sees b0 (lag 1) but not a2 (lag 2: token b0 in between starts a sequence)
//
// A warp whose 32 runs hold no start takes code without any mask (the boundary test is warp-uniform); the others
// skip a dropped tap's multiply-add under a predicate.
//
// Measured on the H200 (B=8, D=4096, L=4096, bf16, 12-18 sequences a row; benchmarks/gpu/conv_variants.py): the
// register kernels above 0.152 + 0.442 ms (fwd + bwd); kernels that staged each tile in shared memory (cp.async,
// then bulk copies: 0.166 + 0.300 ms; a persistent, double-buffered form was slower still) lost to these,
// 0.138 + 0.271 ms, against causal-conv1d's 0.140 + 0.257 ms without boundaries.

__global__ void conv_runmask_kernel(const int *pos, uint16_t *mask, int L, int nruns, int stride, int total) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int b = idx / nruns, r = idx - b * nruns;
  const int *row = pos + (int64_t)b * L;
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int t = r * kRun - 4 + i;
    const bool start = t <= 0 || t >= L || row[t] == 0;
    m |= static_cast<unsigned>(start) << i;
  }
  mask[(int64_t)b * stride + r] = static_cast<uint16_t>(m);
}

// relevant bits of a run's mask: tokens t0 - 2 .. t0 + 7 (taps of its own tokens reach back 3 steps)
constexpr unsigned kRunBits = 0x0ffcu;

// Dropped taps of one run: bit j of blk_k is set when tap k of the token at mask bit j (token t0 - 4 + j) is dropped,
// i.e. a sequence starts within tokens j-k+1 .. j. Without kMasked every tap is kept (compile-time).
template <bool kMasked>
struct RunTaps {
  unsigned blk1 = 0u, blk2 = 0u, blk3 = 0u;
  __device__ __forceinline__ explicit RunTaps(unsigned m) {
    if constexpr (kMasked) {
      blk1 = m;
      blk2 = m | (m << 1);
      blk3 = blk2 | (m << 2);
    }
  }
  template <int k>
  __device__ __forceinline__ bool ok(int i) const {   // tap k of token t0 + i
    if constexpr (!kMasked || k == 0) return true;
    else return (((k == 1 ? blk1 : k == 2 ? blk2 : blk3) >> (i + 4)) & 1u) == 0u;
  }
};

// a run's kRun outputs to global memory (16-byte aligned there): vector stores when the run is whole
template <typename T>
__device__ __forceinline__ void stg_run(T *ptr, int valid, const float (&v)[kRun]) {
  if (valid >= kRun) {
    constexpr int kE = 16 / sizeof(T);
#pragma unroll
    for (int q = 0; q < kRun / kE; ++q) {
      uint4 raw;
      T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
      for (int k = 0; k < kE; ++k) e[k] = from_f<T>(v[q * kE + k]);
      reinterpret_cast<uint4 *>(ptr)[q] = raw;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kRun; ++k)
      if (k < valid) ptr[k] = from_f<T>(v[k]);
  }
}

template <int kW, bool kMasked>
__device__ __forceinline__ float conv_pre(const float (&w)[kW], float bias, const float (&xs)[4 + kRun], int i,
                                          const RunTaps<kMasked> &taps) {
  // a dropped tap is skipped, not multiplied by zero (an inf or NaN in the sequence before must not leak)
  float acc = fmaf(w[kW - 1], xs[4 + i], bias);
  if constexpr (kW > 1) if (taps.template ok<1>(i)) acc = fmaf(w[kW - 2], xs[3 + i], acc);
  if constexpr (kW > 2) if (taps.template ok<2>(i)) acc = fmaf(w[kW - 3], xs[2 + i], acc);
  if constexpr (kW > 3) if (taps.template ok<3>(i)) acc = fmaf(w[kW - 4], xs[1 + i], acc);
  return acc;
}

// Backward of one run (or of the first kTok tokens of a run): g = dout * silu'(pre), then (kept taps only)
//   dweight[W-1-k] += g[i] x[i-k]
//   dx[i] = sum_k w[W-1-k] g[i+k]                  (the part with i + k inside this run)
//   c[e-1] = sum_{k>=e} w[W-1-k] g[k-e]            (what this run adds to dx[kRun - e] of the run before it)
template <int kW, bool kMasked, int kTok>
__device__ __forceinline__ void conv_bwd_run(const float (&w)[kW], float bias, bool silu, unsigned m,
                                             const float (&xs)[4 + kRun], const float (&gd)[kRun],
                                             float (&dw)[kW + 1], float (&dx)[kRun], float (&c)[3]) {
  const RunTaps<kMasked> taps(m);
  float g[kTok];
#pragma unroll
  for (int i = 0; i < kTok; ++i) {
    float gv = gd[i];
    if (silu) gv *= silu_grad_factor(conv_pre<kW>(w, bias, xs, i, taps));
    g[i] = gv;
    dw[kW - 1] = fmaf(gv, xs[4 + i], dw[kW - 1]);
    if constexpr (kW > 1) if (taps.template ok<1>(i)) dw[kW - 2] = fmaf(gv, xs[3 + i], dw[kW - 2]);
    if constexpr (kW > 2) if (taps.template ok<2>(i)) dw[kW - 3] = fmaf(gv, xs[2 + i], dw[kW - 3]);
    if constexpr (kW > 3) if (taps.template ok<3>(i)) dw[kW - 4] = fmaf(gv, xs[1 + i], dw[kW - 4]);
    dw[kW] += gv;
  }
  if constexpr (kTok == kRun) {
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      float acc = w[kW - 1] * g[i];
      if constexpr (kW > 1) if (i + 1 < kRun && taps.template ok<1>(i + 1)) acc = fmaf(w[kW - 2], g[i + 1], acc);
      if constexpr (kW > 2) if (i + 2 < kRun && taps.template ok<2>(i + 2)) acc = fmaf(w[kW - 3], g[i + 2], acc);
      if constexpr (kW > 3) if (i + 3 < kRun && taps.template ok<3>(i + 3)) acc = fmaf(w[kW - 4], g[i + 3], acc);
      dx[i] = acc;
    }
  }
  // c[0] -> dx[kRun-1]: taps 1, 2, 3 of tokens 0, 1, 2; c[1] -> dx[kRun-2]: taps 2, 3 of tokens 0, 1; c[2]: tap 3 of 0
  c[0] = c[1] = c[2] = 0.f;
  if constexpr (kW > 1) if (taps.template ok<1>(0)) c[0] = w[kW - 2] * g[0];
  if constexpr (kW > 2) {
    if (taps.template ok<2>(1)) c[0] = fmaf(w[kW - 3], g[1], c[0]);
    if (taps.template ok<2>(0)) c[1] = w[kW - 3] * g[0];
  }
  if constexpr (kW > 3) {
    if (taps.template ok<3>(2)) c[0] = fmaf(w[kW - 4], g[2], c[0]);
    if (taps.template ok<3>(1)) c[1] = fmaf(w[kW - 4], g[1], c[1]);
    if (taps.template ok<3>(0)) c[2] = w[kW - 4] * g[0];
  }
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

template <typename T>
struct RunLoad {   // x[t0 - 4, t0 + kRun) of one run, and its mask word
  GVec<T, 4> prev;
  GVec<T, kRun> main;
  unsigned m;
  __device__ __forceinline__ void load(const T *xrow, const uint16_t *mrow, int t0, int L) {
    const bool in = t0 < L;
    main.load(xrow + t0, in ? L - t0 : 0);
    prev.load(xrow + t0 - 4, in && t0 > 0 ? 4 : 0);
    m = in ? mrow[t0 / kRun] : 0u;
  }
  __device__ __forceinline__ void window(float (&xs)[4 + kRun]) const {
    float pv[4], mn[kRun];
    prev.to_float(pv);
    main.to_float(mn);
#pragma unroll
    for (int i = 0; i < 4; ++i) xs[i] = pv[i];
#pragma unroll
    for (int i = 0; i < kRun; ++i) xs[4 + i] = mn[i];
  }
};

template <typename T, int kW, bool kMasked>
__device__ __forceinline__ void conv_fwd_run(const float (&w)[kW], float bias, bool silu, unsigned m,
                                                const float (&xs)[4 + kRun], float (&o)[kRun]) {
  const RunTaps<kMasked> taps(m);
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const float acc = conv_pre<kW>(w, bias, xs, i, taps);
    o[i] = silu ? acc * sigmoidf_(acc) : acc;
  }
}

template <typename T, int kW, int kRpt>
__global__ void __launch_bounds__(kThreadsCF) conv_fwd_cf_vec(const ConvParams p) {
  constexpr int kTile = kThreadsCF * kRun * kRpt;
  const int b = blockIdx.z, d = blockIdx.x, L = p.seqlen;
  const int tile0 = blockIdx.y * kTile;
  const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d * p.x_cs;
  T *out = reinterpret_cast<T *>(p.out) + b * p.x_bs + d * p.x_cs;
  const uint16_t *mrow = p.runmask + (int64_t)b * conv_mask_stride(L);
  RunLoad<T> ld[kRpt];
#pragma unroll
  for (int j = 0; j < kRpt; ++j) ld[j].load(x, mrow, tile0 + (j * kThreadsCF + threadIdx.x) * kRun, L);
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) w[k] = __ldg(p.weight + d * kW + k);
  const float bias = p.bias ? __ldg(p.bias + d) : 0.f;
#pragma unroll
  for (int j = 0; j < kRpt; ++j) {
    const int t0 = tile0 + (j * kThreadsCF + threadIdx.x) * kRun;
    const bool plain = !p.cf_always_masked && __all_sync(kFull, (ld[j].m & kRunBits) == 0u);
    if (t0 >= L) continue;
    float xs[4 + kRun], o[kRun];
    ld[j].window(xs);
    if (plain) conv_fwd_run<T, kW, false>(w, bias, p.silu, ld[j].m, xs, o);
    else conv_fwd_run<T, kW, true>(w, bias, p.silu, ld[j].m, xs, o);
    stg_run<T>(out + t0, L - t0, o);
  }
}

template <typename T, int kW, int kRpt>
__global__ void __launch_bounds__(kThreadsCF) conv_bwd_cf_vec(const ConvParams p) {
  static_assert(kW <= 4, "taps reach at most 3 timesteps back");
  constexpr int kTile = kThreadsCF * kRun * kRpt;
  __shared__ float s_c[kRpt * kThreadsCF + 1][3];   // what run r adds to the dx of run r - 1
  __shared__ float s_red[kThreadsCF / 32][kW + 1];
  const int b = blockIdx.z, d = blockIdx.x, L = p.seqlen;
  const int tile0 = blockIdx.y * kTile;
  const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d * p.x_cs;
  const T *dout = reinterpret_cast<const T *>(p.dout) + b * p.g_bs + d * p.g_cs;
  T *dx = reinterpret_cast<T *>(p.dx) + b * p.x_bs + d * p.x_cs;
  const uint16_t *mrow = p.runmask + (int64_t)b * conv_mask_stride(L);
  RunLoad<T> ld[kRpt];
  GVec<T, kRun> gl[kRpt];
#pragma unroll
  for (int j = 0; j < kRpt; ++j) {
    const int t0 = tile0 + (j * kThreadsCF + threadIdx.x) * kRun;
    ld[j].load(x, mrow, t0, L);
    gl[j].load(dout + t0, t0 < L ? L - t0 : 0);
  }
  float w[kW];
#pragma unroll
  for (int k = 0; k < kW; ++k) w[k] = __ldg(p.weight + d * kW + k);
  const float bias = p.bias ? __ldg(p.bias + d) : 0.f;
  float dw[kW + 1];
#pragma unroll
  for (int k = 0; k <= kW; ++k) dw[k] = 0.f;
  float dxr[kRpt][kRun];
#pragma unroll
  for (int j = 0; j < kRpt; ++j) {
    const int r = j * kThreadsCF + threadIdx.x;
    const int t0 = tile0 + r * kRun;
    const bool plain = !p.cf_always_masked && __all_sync(kFull, (ld[j].m & kRunBits) == 0u);
    float c[3] = {0.f, 0.f, 0.f};
    if (t0 < L) {
      float xs[4 + kRun], gd[kRun];
      ld[j].window(xs);
      gl[j].to_float(gd);
      if (plain) conv_bwd_run<kW, false, kRun>(w, bias, p.silu, ld[j].m, xs, gd, dw, dxr[j], c);
      else conv_bwd_run<kW, true, kRun>(w, bias, p.silu, ld[j].m, xs, gd, dw, dxr[j], c);
    }
    s_c[r][0] = c[0]; s_c[r][1] = c[1]; s_c[r][2] = c[2];
  }
  if (threadIdx.x == 0) {   // the first W-1 tokens of the next tile's first run, for the tile's last run
    float c[3] = {0.f, 0.f, 0.f};
    const int tn = tile0 + kTile;
    if (tn < L) {
      RunLoad<T> nl;
      GVec<T, kRun> ng;
      nl.load(x, mrow, tn, L);
      ng.load(dout + tn, L - tn);
      float xs[4 + kRun], gd[kRun], dw_unused[kW + 1] = {}, dx_unused[kRun];
      nl.window(xs);
      ng.to_float(gd);
      conv_bwd_run<kW, true, 3>(w, bias, p.silu, nl.m, xs, gd, dw_unused, dx_unused, c);
    }
    s_c[kRpt * kThreadsCF][0] = c[0]; s_c[kRpt * kThreadsCF][1] = c[1]; s_c[kRpt * kThreadsCF][2] = c[2];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRpt; ++j) {
    const int r = j * kThreadsCF + threadIdx.x;
    const int t0 = tile0 + r * kRun;
    if (t0 >= L) break;
#pragma unroll
    for (int e = 1; e < kW; ++e) dxr[j][kRun - e] += s_c[r + 1][e - 1];
    stg_run<T>(dx + t0, L - t0, dxr[j]);
  }
  block_reduce_dw<kW>(dw, s_red, p.dweight, p.dbias, d);
}

// ------------------------------------------------------------------------------------------------------------
// channel-last

constexpr int kBXCL = 32, kBYCL = 4;   // 32 threads over channels x 4 over time
constexpr int kRunCL = 32;             // timesteps per thread
constexpr int kGroupCL = 8;            // timesteps whose loads are issued together (cl_vec rows)

template <typename T>
struct ClVec { static constexpr int kFwd = 16 / sizeof(T) > 8 ? 8 : 16 / sizeof(T); static constexpr int kBwd = 4; };

// (At most 128 registers, 4 blocks an SM: the grouped loads need ~170 otherwise, 2 blocks an SM. Measured on the
// H200 at B=8, D=4096, L=4096 bf16: 0.231 against 0.288 ms, despite ~90 bytes of spills for 16-bit types.)
template <typename T, int kW>
__global__ void __launch_bounds__(kBXCL * kBYCL, 4) conv_fwd_cl(const ConvParams p) {
  constexpr int kV = ClVec<T>::kFwd;
  const int b = blockIdx.z;
  const int L = p.seqlen;
  const int d0 = (blockIdx.x * kBXCL + threadIdx.x) * kV;
  const int t0 = (blockIdx.y * kBYCL + threadIdx.y) * kRunCL;
  if (d0 >= p.dim || t0 >= L) return;
  const int nv = min(kV, p.dim - d0);
  const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d0;
  T *out = reinterpret_cast<T *>(p.out) + b * p.x_bs + d0;
  const int *pos = p.pos + (int64_t)b * L;
  float w[kW][kV], bias[kV];
#pragma unroll
  for (int c = 0; c < kV; ++c) {
    const int d = min(d0 + c, p.dim - 1);
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k][c] = p.weight[d * kW + k];
    bias[c] = p.bias ? p.bias[d] : 0.f;
  }
  float win[kW][kV];   // win[kW-1] = x[t], win[kW-1-j] = x[t-j]
#pragma unroll
  for (int j = 0; j < kW - 1; ++j) {
    const int t = t0 - (kW - 1) + j;
    if (t >= 0) load_n<T, kV>(x + t * p.x_ls, nv, win[j + 1]);
    else {
#pragma unroll
      for (int c = 0; c < kV; ++c) win[j + 1][c] = 0.f;
    }
  }
  const int tend = min(t0 + kRunCL, L);
  auto step = [&](int t, int r) {   // window already holds x[t]; out[t]
    float o[kV];
#pragma unroll
    for (int c = 0; c < kV; ++c) {
      float acc = bias[c];
#pragma unroll
      for (int k = 0; k < kW; ++k)
        if (k <= r) acc = fmaf(w[kW - 1 - k][c], win[kW - 1 - k][c], acc);
      o[c] = p.silu ? acc * sigmoidf_(acc) : acc;
    }
    store_n<T, kV>(out + t * p.x_ls, nv, o);
  };
  auto shift = [&]() {
#pragma unroll
    for (int j = 0; j < kW - 1; ++j)
#pragma unroll
      for (int c = 0; c < kV; ++c) win[j][c] = win[j + 1][c];
  };
  if (p.cl_vec) {
    // groups of kGroupCL timesteps, every load of a group issued before the first is used
#pragma unroll 1
    for (int tg = t0; tg < tend; tg += kGroupCL) {
      GVec<T, kV> raw[kGroupCL];
      int rr[kGroupCL];
#pragma unroll
      for (int i = 0; i < kGroupCL; ++i) {
        const int t = tg + i;
        raw[i].load(x + (int64_t)t * p.x_ls, t < tend ? kV : 0);
        rr[i] = t < tend ? pos[t] : 0;
      }
#pragma unroll
      for (int i = 0; i < kGroupCL; ++i) {
        if (tg + i >= tend) break;
        shift();
        raw[i].to_float(win[kW - 1]);
        step(tg + i, rr[i]);
      }
    }
  } else {
#pragma unroll 2
    for (int t = t0; t < tend; ++t) {
      shift();
      load_n<T, kV>(x + t * p.x_ls, nv, win[kW - 1]);
      step(t, pos[t]);
    }
  }
}

template <typename T, int kW>
__global__ void __launch_bounds__(kBXCL * kBYCL) conv_bwd_cl(const ConvParams p) {
  constexpr int kV = ClVec<T>::kBwd;
  __shared__ float s_red[kBYCL][kBXCL * kV][kW + 1];
  const int b = blockIdx.z;
  const int L = p.seqlen;
  const int d0 = (blockIdx.x * kBXCL + threadIdx.x) * kV;
  const int t0 = (blockIdx.y * kBYCL + threadIdx.y) * kRunCL;
  const bool active = d0 < p.dim && t0 < L;
  float dw[kW + 1][kV];
#pragma unroll
  for (int k = 0; k <= kW; ++k)
#pragma unroll
    for (int c = 0; c < kV; ++c) dw[k][c] = 0.f;
  if (active) {
    const int nv = min(kV, p.dim - d0);
    const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d0;
    const T *dout = reinterpret_cast<const T *>(p.dout) + b * p.g_bs + d0;
    T *dx = reinterpret_cast<T *>(p.dx) + b * p.x_bs + d0;
    const int *pos = p.pos + (int64_t)b * L;
    float w[kW][kV], bias[kV];
#pragma unroll
    for (int c = 0; c < kV; ++c) {
      const int d = min(d0 + c, p.dim - 1);
#pragma unroll
      for (int k = 0; k < kW; ++k) w[k][c] = p.weight[d * kW + k];
      bias[c] = p.bias ? p.bias[d] : 0.f;
    }
    float xw[kW][kV];    // xw[kW-1] = x[t], xw[kW-1-j] = x[t-j]
    float gw[kW][kV];    // gw[kW-1] = g[t], gw[kW-1-j] = g[t-j]
    int rw[kW];          // reach of the same timesteps as gw
#pragma unroll
    for (int j = 0; j < kW - 1; ++j) {
      const int t = t0 - (kW - 1) + j;
      if (t >= 0) load_n<T, kV>(x + t * p.x_ls, nv, xw[j + 1]);
      else {
#pragma unroll
        for (int c = 0; c < kV; ++c) xw[j + 1][c] = 0.f;
      }
#pragma unroll
      for (int c = 0; c < kV; ++c) gw[j + 1][c] = 0.f;
      rw[j + 1] = 0;
    }
    const int tend = min(t0 + kRunCL, L);
    const int tlast = min(t0 + kRunCL + kW - 1, L + kW - 1);
    // One timestep: x[t] / dout[t] / position id come in xt / gt / pt (t < L); dw, then dx[t - (W-1)].
    auto step = [&](int t, float (&xt)[kV], float (&gt)[kV], int pt) {
#pragma unroll
      for (int j = 0; j < kW - 1; ++j) {
        rw[j] = rw[j + 1];
#pragma unroll
        for (int c = 0; c < kV; ++c) { xw[j][c] = xw[j + 1][c]; gw[j][c] = gw[j + 1][c]; }
      }
      int r = 0;
      if (t < L) {
#pragma unroll
        for (int c = 0; c < kV; ++c) xw[kW - 1][c] = xt[c];
        r = min(pt, kW - 1);
        if (p.silu) {
#pragma unroll
          for (int c = 0; c < kV; ++c) {
            float acc = bias[c];
#pragma unroll
            for (int k = 0; k < kW; ++k)
              if (k <= r) acc = fmaf(w[kW - 1 - k][c], xw[kW - 1 - k][c], acc);
            gt[c] *= silu_grad_factor(acc);
          }
        }
        if (t < tend) {
#pragma unroll
          for (int c = 0; c < kV; ++c) {
#pragma unroll
            for (int k = 0; k < kW; ++k)
              if (k <= r) dw[kW - 1 - k][c] = fmaf(gt[c], xw[kW - 1 - k][c], dw[kW - 1 - k][c]);
            dw[kW][c] += gt[c];
          }
        }
      } else {
#pragma unroll
        for (int c = 0; c < kV; ++c) { xw[kW - 1][c] = 0.f; gt[c] = 0.f; }
      }
#pragma unroll
      for (int c = 0; c < kV; ++c) gw[kW - 1][c] = gt[c];
      rw[kW - 1] = r;
      // dx at s = t - (W-1): sum_k w[W-1-k] g[s+k] [reach(s+k) >= k]; g[s+k] = gw[k]
      const int s = t - (kW - 1);
      if (s >= t0 && s < tend) {
        float o[kV];
#pragma unroll
        for (int c = 0; c < kV; ++c) {
          float acc = 0.f;
#pragma unroll
          for (int k = 0; k < kW; ++k)
            if (k <= rw[k]) acc = fmaf(w[kW - 1 - k][c], gw[k][c], acc);
          o[c] = acc;
        }
        store_n<T, kV>(dx + s * p.x_ls, nv, o);
      }
    };
    if (p.cl_vec) {
      // groups of kGroupCL timesteps, every load of a group issued before the first is used
#pragma unroll 1
      for (int tg = t0; tg < tlast; tg += kGroupCL) {
        GVec<T, kV> rx[kGroupCL], rg[kGroupCL];
        int rp[kGroupCL];
#pragma unroll
        for (int i = 0; i < kGroupCL; ++i) {
          const int t = tg + i;
          const int in = t < L && t < tlast ? kV : 0;
          rx[i].load(x + (int64_t)t * p.x_ls, in);
          rg[i].load(dout + (int64_t)t * p.g_ls, in);
          rp[i] = in ? pos[t] : 0;
        }
#pragma unroll
        for (int i = 0; i < kGroupCL; ++i) {
          if (tg + i >= tlast) break;
          float xt[kV], gt[kV];
          rx[i].to_float(xt);
          rg[i].to_float(gt);
          step(tg + i, xt, gt, rp[i]);
        }
      }
    } else {
#pragma unroll 1
      for (int t = t0; t < tlast; ++t) {
        float xt[kV], gt[kV];
        int pt = 0;
        if (t < L) {
          load_n<T, kV>(x + t * p.x_ls, nv, xt);
          load_n<T, kV>(dout + t * p.g_ls, nv, gt);
          pt = pos[t];
        }
        step(t, xt, gt, pt);
      }
    }
  }
#pragma unroll
  for (int k = 0; k <= kW; ++k)
#pragma unroll
    for (int c = 0; c < kV; ++c) s_red[threadIdx.y][threadIdx.x * kV + c][k] = dw[k][c];
  __syncthreads();
  for (int i = threadIdx.y * kBXCL + threadIdx.x; i < kBXCL * kV * (kW + 1); i += kBXCL * kBYCL) {
    const int cl = i / (kW + 1), k = i % (kW + 1);
    const int d = blockIdx.x * kBXCL * kV + cl;
    if (d >= p.dim) continue;
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < kBYCL; ++y) s += s_red[y][cl][k];
    if (k < kW) atomicAdd(p.dweight + d * kW + k, s);
    else if (p.dbias) atomicAdd(p.dbias + d, s);
  }
}

// ------------------------------------------------------------------------------------------------------------
// launch

// Runs per thread of the channel-first vector kernels (0: the register kernels, for rows that are not 16-byte
// aligned or a seqlen that is not a multiple of 16 / sizeof(T)). Forward: the smallest tile of 1024 / 2048 / 4096
// steps that covers the row; backward: at most 2048 (its 4096-step kernel holds twice the registers and ran
// slower, 0.284 against 0.273 ms at L=4096). PACKLOADER_CONV_CF picks a variant for benchmarks and tests: "regs",
// "vec1" / "vec2" / "vec4", or "vecm" (the default tiles, every warp through the masked code).
int cf_vec_runs(const ConvParams &p, int elt, bool bwd, bool *always_masked) {
  auto al = [](const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  bool ok = p.runmask != nullptr && p.x_ls == 1 && (p.seqlen * elt) % 16 == 0 && (p.x_bs * elt) % 16 == 0 &&
            (p.x_cs * elt) % 16 == 0 && al(p.x);
  if (bwd) ok = ok && p.g_ls == 1 && (p.g_bs * elt) % 16 == 0 && (p.g_cs * elt) % 16 == 0 && al(p.dout) && al(p.dx);
  else ok = ok && al(p.out);
  *always_masked = false;
  if (!ok) return 0;
  int rpt = p.seqlen <= kSpanCF ? 1 : (p.seqlen <= 2 * kSpanCF || bwd) ? 2 : 4;
  if (const char *env = std::getenv("PACKLOADER_CONV_CF")) {
    if (!std::strcmp(env, "regs")) rpt = 0;
    else if (!std::strcmp(env, "vec1")) rpt = 1;
    else if (!std::strcmp(env, "vec2")) rpt = 2;
    else if (!std::strcmp(env, "vec4")) rpt = 4;
    else if (!std::strcmp(env, "vecm")) *always_masked = true;
  }
  return rpt;
}

template <typename T, int kW>
void launch_w(const ConvParams &p, cudaStream_t st, bool bwd) {
  if (p.channel_last) {
    const int kV = bwd ? ClVec<T>::kBwd : ClVec<T>::kFwd;
    dim3 grid((p.dim + kBXCL * kV - 1) / (kBXCL * kV), (p.seqlen + kBYCL * kRunCL - 1) / (kBYCL * kRunCL), p.batch);
    dim3 block(kBXCL, kBYCL);
    // whole vectors of kV channels at aligned addresses: the grouped loads (PACKLOADER_CONV_CL=plain: never)
    const int vb = kV * (int)sizeof(T);
    auto al = [vb](const void *ptr) { return reinterpret_cast<uintptr_t>(ptr) % vb == 0; };
    ConvParams q = p;
    q.cl_vec = p.dim % kV == 0 && al(p.x) && (p.x_ls * sizeof(T)) % vb == 0 && (p.x_bs * sizeof(T)) % vb == 0 &&
               (bwd ? al(p.dout) && al(p.dx) && (p.g_ls * sizeof(T)) % vb == 0 && (p.g_bs * sizeof(T)) % vb == 0
                    : al(p.out));
    if (const char *env = std::getenv("PACKLOADER_CONV_CL")) q.cl_vec = q.cl_vec && std::strcmp(env, "plain") != 0;
    if (bwd) conv_bwd_cl<T, kW><<<grid, block, 0, st>>>(q);
    else conv_fwd_cl<T, kW><<<grid, block, 0, st>>>(q);
  } else if (bool masked; const int rpt = cf_vec_runs(p, sizeof(T), bwd, &masked)) {
    ConvParams q = p;
    q.cf_always_masked = masked;
    const int nruns = (q.seqlen + kRun - 1) / kRun, total = q.batch * nruns;
    conv_runmask_kernel<<<(total + 255) / 256, 256, 0, st>>>(q.pos, q.runmask, q.seqlen, nruns,
                                                             conv_mask_stride(q.seqlen), total);
    const int tile = kSpanCF * rpt;
    const dim3 grid(q.dim, (q.seqlen + tile - 1) / tile, q.batch);
    if (bwd) {
      if (rpt == 1) conv_bwd_cf_vec<T, kW, 1><<<grid, kThreadsCF, 0, st>>>(q);
      else if (rpt == 2) conv_bwd_cf_vec<T, kW, 2><<<grid, kThreadsCF, 0, st>>>(q);
      else conv_bwd_cf_vec<T, kW, 4><<<grid, kThreadsCF, 0, st>>>(q);
    } else {
      if (rpt == 1) conv_fwd_cf_vec<T, kW, 1><<<grid, kThreadsCF, 0, st>>>(q);
      else if (rpt == 2) conv_fwd_cf_vec<T, kW, 2><<<grid, kThreadsCF, 0, st>>>(q);
      else conv_fwd_cf_vec<T, kW, 4><<<grid, kThreadsCF, 0, st>>>(q);
    }
  } else {
    if (bwd) {
      conv_bwd_cf<T, kW><<<dim3(p.dim, 1, p.batch), kThreadsCF, 0, st>>>(p);
    } else {
      dim3 grid((p.dim + kChCF - 1) / kChCF, (p.seqlen + kSpanCF - 1) / kSpanCF, p.batch);
      conv_fwd_cf<T, kW><<<grid, kThreadsCF, 0, st>>>(p);
    }
  }
}

template <typename T>
void launch_t(const ConvParams &p, cudaStream_t st, bool bwd) {
  switch (p.width) {
    case 2: launch_w<T, 2>(p, st, bwd); break;
    case 3: launch_w<T, 3>(p, st, bwd); break;
    default: launch_w<T, 4>(p, st, bwd); break;
  }
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
