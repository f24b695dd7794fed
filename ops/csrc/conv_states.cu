// The conv's carried states (ops/contract.py, packloader::conv_states_fwd / conv_states_bwd): the packed conv kernels
// run as if every sequence started from zero; these two small kernels then fix the first W - 1 outputs of each
// sequence that continues a state, and give each sequence's last W - 1 inputs (its final state), forward; and the
// backward of that fix-up. One thread a (sequence, channel): a few tokens each, so a launch replaces the dozen small
// torch ops (gathers, an unfold, silu, a scatter) the fix-up took per layer.
//
// For sequence s with initial state h (W - 1 inputs, oldest first) and inputs x_0 .. x_{len-1}:
//   ext = [h_0 .. h_{W-2}, x_0 .. x_{W-2}]            (x_j past the sequence's end reads 0: never used)
//   out_j = act(bias + sum_i weight_i ext_{j+i})     for j < min(W - 1, len), where the sequence has a state
//   final = the last W - 1 of [h, x_0 .. x_{len-1}]  (h counts as zeros where the sequence has none)
// The backward reads dout at those outputs (then zeroes them there: their gradient goes through this recomputation,
// not the conv kernel's), and writes d x_j for j < W - 1 (zeros past the end), d h, and per-sequence partials of
// [dweight | dbias] that the caller sums over sequences in order (no atomics: the same bits every run).
#include "dispatch.cuh"
#include "dtype_utils.cuh"

namespace packloader_ops {

namespace {

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ int64_t at(const ConvStateParams &p, int64_t tok, int d, bool of_x) {
  const int64_t row = tok / p.seqlen, col = tok - row * p.seqlen;
  return of_x ? row * p.x_bs + d * p.x_cs + col * p.x_ls : row * p.o_bs + d * p.o_cs + col * p.o_ls;
}

// ext (2K) of sequence s, channel d, in float
template <typename T, int K>
__device__ __forceinline__ void load_ext(const ConvStateParams &p, int s, int d, int64_t start, int64_t len, bool has,
                                         float (&ext)[2 * K]) {
  const T *h = reinterpret_cast<const T *>(p.initial_state) + ((int64_t)s * p.dim + d) * K;
  const T *x = reinterpret_cast<const T *>(p.x);
#pragma unroll
  for (int m = 0; m < K; ++m) ext[m] = has ? to_f(h[m]) : 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) ext[K + j] = j < len ? to_f(x[at<T>(p, start + j, d, true)]) : 0.f;
}

template <typename T, int W>
__global__ void conv_states_fwd_kernel(ConvStateParams p) {
  constexpr int K = W - 1;
  const int d = blockIdx.x * kThreads + threadIdx.x;
  const int s = blockIdx.y;
  if (d >= p.dim) return;
  const int64_t start = p.start[s], len = p.length[s];
  const bool has = p.has[s];
  float ext[2 * K];
  load_ext<T, K>(p, s, d, start, len, has, ext);
  if (has) {
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = p.weight[d * W + i];
    const float b = p.bias ? p.bias[d] : 0.f;
    T *out = reinterpret_cast<T *>(p.out);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j >= len) break;
      float pre = b;
#pragma unroll
      for (int i = 0; i < W; ++i) pre += w[i] * ext[j + i];
      out[at<T>(p, start + j, d, false)] = from_f<T>(p.silu ? pre * sigmoidf_(pre) : pre);
    }
  }
  // the final state: the last K of [h, x_0 .. x_{len-1}], copied bit for bit
  const T *h = reinterpret_cast<const T *>(p.initial_state) + ((int64_t)s * p.dim + d) * K;
  const T *x = reinterpret_cast<const T *>(p.x);
  T *fin = reinterpret_cast<T *>(p.final_state) + ((int64_t)s * p.dim + d) * K;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const int64_t m = len + i;   // index in [h, x]
    fin[i] = m >= K ? x[at<T>(p, start + m - K, d, true)] : (has ? h[m] : from_f<T>(0.f));
  }
}

template <typename T, int W>
__global__ void conv_states_bwd_kernel(ConvStateParams p) {
  constexpr int K = W - 1;
  const int d = blockIdx.x * kThreads + threadIdx.x;
  const int s = blockIdx.y;
  if (d >= p.dim) return;
  const int64_t start = p.start[s], len = p.length[s];
  const bool has = p.has[s];
  float dw[W + 1] = {};   // [dweight | dbias]
  float dext[2 * K] = {};
  if (has) {
    float ext[2 * K];
    load_ext<T, K>(p, s, d, start, len, has, ext);
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = p.weight[d * W + i];
    const float b = p.bias ? p.bias[d] : 0.f;
    T *dout = reinterpret_cast<T *>(p.out);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j >= len) break;
      const int64_t o = at<T>(p, start + j, d, false);
      float g = to_f(dout[o]);
      dout[o] = from_f<T>(0.f);
      float pre = b;
#pragma unroll
      for (int i = 0; i < W; ++i) pre += w[i] * ext[j + i];
      if (p.silu) {
        const float sg = sigmoidf_(pre);
        g = g * sg * (1.f + pre * (1.f - sg));
      }
#pragma unroll
      for (int i = 0; i < W; ++i) {
        dw[i] += g * ext[j + i];
        dext[j + i] += g * w[i];
      }
      dw[W] += g;
    }
  }
  float *part = p.dw_part + ((int64_t)s * p.dim + d) * (W + 1);
#pragma unroll
  for (int i = 0; i <= W; ++i) part[i] = dw[i];
  // d x_j (j < K) as (slots, K, dim): contiguous over channels
#pragma unroll
  for (int j = 0; j < K; ++j) p.dx_head[((int64_t)s * K + j) * p.dim + d] = dext[K + j];
  if (p.dinitial_state) {
#pragma unroll
    for (int m = 0; m < K; ++m) p.dinitial_state[((int64_t)s * p.dim + d) * K + m] = dext[m];
  }
}

template <bool kBwd>
void launch(const ConvStateParams &p, cudaStream_t st) {
  if (p.slots == 0 || p.dim == 0) return;
  const dim3 grid((p.dim + kThreads - 1) / kThreads, p.slots);
  dtype_switch(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    width_switch(p.width, [&](auto w) {
      constexpr int kW = decltype(w)::value;
      if constexpr (kBwd) conv_states_bwd_kernel<T, kW><<<grid, kThreads, 0, st>>>(p);
      else conv_states_fwd_kernel<T, kW><<<grid, kThreads, 0, st>>>(p);
    });
  });
}

}  // namespace

void conv_states_fwd_launch(const ConvStateParams &p, cudaStream_t st) { launch<false>(p, st); }
void conv_states_bwd_launch(const ConvStateParams &p, cudaStream_t st) { launch<true>(p, st); }

}  // namespace packloader_ops
