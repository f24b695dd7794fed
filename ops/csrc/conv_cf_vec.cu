// Packed causal conv1d, channel-first vector kernels (rows 16-byte aligned, seqlen a multiple of 16 / sizeof(T))
//
// A block owns one (batch row, channel) and a tile of kRpt * 1024 timesteps; each thread owns kRpt runs of
// kRun = 8 timesteps (runs j * 128 + thread, so a warp's runs are 256 consecutive timesteps) and loads every
// vector it needs (its runs' x, the 4 steps before each run, dout in the backward) straight into registers before
// using any, so a thread keeps kRpt 16-byte loads in flight; the 4-step halo is the previous run's tail, an L1 hit.
// Boundaries come from one 16-bit mask per run (conv_runmask_kernel: once per call, or once for a forward and its
// backward when the caller hands both the packloader::conv_runmask op's words) instead of 8 position ids per run and
// channel.
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
// Measured on the H200 (B=8, D=4096, L=4096, bf16, 12-18 sequences a row; benchmarks/results/RESULTS.md): the
// register kernels (conv_cf_regs.cu) 0.152 + 0.442 ms (fwd + bwd); kernels that staged each tile in shared memory (cp.async,
// then bulk copies: 0.166 + 0.300 ms; a persistent, double-buffered form was slower still) lost to these,
// 0.138 + 0.271 ms, against causal-conv1d's 0.140 + 0.257 ms without boundaries. Since the eleventh session (silu a
// compile-time switch, 4096-step backward tiles): 0.134 + 0.235 ms against 0.132 + 0.212 ms (GPU time, profiler).
#include "conv_common.cuh"
#include "dispatch.cuh"

namespace packloader_ops {
namespace conv {
namespace {

__global__ void conv_runmask_kernel(const int *pos, uint16_t *mask, int L, int nruns, int stride, int total) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int b = idx / stride, r = idx - b * stride;
  const int *row = pos + (int64_t)b * L;
  unsigned m = 0;
  if (r < nruns) {   // the words past the last run are 0
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int t = r * kRun - 4 + i;
      const bool start = t <= 0 || t >= L || row[t] == 0;
      m |= static_cast<unsigned>(start) << i;
    }
  }
  mask[idx] = static_cast<uint16_t>(m);
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

// Backward of one run (or of the first kTok tokens of a run), token by token: g = dout * silu'(pre), then for each
// kept tap k of the token (lag k, weight w[W-1-k])
//   dweight[W-1-k] += g x[i-k]
//   dx[i-k]        += w[W-1-k] g                   (i - k >= 0: inside this run)
//   c[k-i-1]       += w[W-1-k] g                   (i - k < 0: what this run adds to dx[kRun - (k - i)] of the run
//                                                   before it)
// Each token's three tap predicates are used at once by its pre-activation, its dweight and its dx / c scatter, so
// they never outlive the token (the predicate registers are few; a form that gathered dx[i] from g[i + k] later
// kept them alive across the run: a masked run took 57 instructions more than a plain one in the SASS (bf16, width 4,
// silu), against 46 here, and the kernel 1-2 % longer). The adds into each dx[i] and c[e] come in the same order as
// that gather form's (lag 0 first), so the bits are the same. The pre-activation is conv_pre's, inlined to share the
// token's predicates. silu is a compile-time switch: as a run-time flag it put a branch around every token's
// pre-activation, the compiler then computed the token's tap predicates on both sides of it, and the kernel took
// 6-9 % longer on packed rows (benchmarks/results/RESULTS.md, eleventh session).
template <int kW, bool kMasked, int kTok, bool kSilu>
__device__ __forceinline__ void conv_bwd_run(const float (&w)[kW], float bias, unsigned m,
                                             const float (&xs)[4 + kRun], const float (&gd)[kRun],
                                             float (&dw)[kW + 1], float (&dx)[kRun], float (&c)[3]) {
  const RunTaps<kMasked> taps(m);
  c[0] = c[1] = c[2] = 0.f;
#pragma unroll
  for (int i = 0; i < kTok; ++i) {
    const bool kept[4] = {true, taps.template ok<1>(i), taps.template ok<2>(i), taps.template ok<3>(i)};
    float gv = gd[i];
    if constexpr (kSilu) {
      // a dropped tap is skipped, not multiplied by zero (an inf or NaN in the sequence before must not leak)
      float acc = fmaf(w[kW - 1], xs[4 + i], bias);
#pragma unroll
      for (int k = 1; k < kW; ++k)
        if (kept[k]) acc = fmaf(w[kW - 1 - k], xs[4 + i - k], acc);
      gv *= silu_grad_factor(acc);
    }
    dx[i] = w[kW - 1] * gv;
    dw[kW - 1] = fmaf(gv, xs[4 + i], dw[kW - 1]);
#pragma unroll
    for (int k = 1; k < kW; ++k) {
      if (kept[k]) {
        dw[kW - 1 - k] = fmaf(gv, xs[4 + i - k], dw[kW - 1 - k]);
        if (i - k >= 0) dx[i - k] = fmaf(w[kW - 1 - k], gv, dx[i - k]);
        else c[k - i - 1] = fmaf(w[kW - 1 - k], gv, c[k - i - 1]);
      }
    }
    dw[kW] += gv;
  }
}

template <typename T>
struct RunLoad {   // x[t0 - 4, t0 + kRun) of one run, and its mask word
  GVec<T, 4> prev;
  GVec<T, kRun> main;
  unsigned m;
  __device__ __forceinline__ void load(const T *xrow, const uint16_t *mrow, int t0, int L) {
    const bool in = t0 < L;
    main.load(xrow + t0, in ? L - t0 : 0);
    prev.load(xrow + t0 - 4, in && t0 > 0 ? 4 : 0);
    m = in ? mrow[static_cast<unsigned>(t0) / kRun] : 0u;   // t0 >= 0: a shift, not a signed division
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
    const bool plain = __all_sync(kFull, (ld[j].m & kRunBits) == 0u);
    if (t0 >= L) continue;
    float xs[4 + kRun], o[kRun];
    ld[j].window(xs);
    if (plain) conv_fwd_run<T, kW, false>(w, bias, p.silu, ld[j].m, xs, o);
    else conv_fwd_run<T, kW, true>(w, bias, p.silu, ld[j].m, xs, o);
    stg_run<T>(out + t0, L - t0, o);
  }
}

template <typename T, int kW, int kRpt, bool kSilu>
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
    const bool plain = __all_sync(kFull, (ld[j].m & kRunBits) == 0u);
    float c[3] = {0.f, 0.f, 0.f};
    if (t0 < L) {
      float xs[4 + kRun], gd[kRun];
      ld[j].window(xs);
      gl[j].to_float(gd);
      if (plain) conv_bwd_run<kW, false, kRun, kSilu>(w, bias, ld[j].m, xs, gd, dw, dxr[j], c);
      else conv_bwd_run<kW, true, kRun, kSilu>(w, bias, ld[j].m, xs, gd, dw, dxr[j], c);
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
      conv_bwd_run<kW, true, 3, kSilu>(w, bias, nl.m, xs, gd, dw_unused, dx_unused, c);
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
  block_reduce_dw<kW>(dw, s_red, p.dw_part, d, p.dim);
}


}  // namespace

// Runs per thread of the vector kernels, 0 where they cannot take the row (not 16-byte aligned, or a seqlen that
// is not a multiple of 16 / sizeof(T): the register kernels take it). Forward: tiles of 1024 / 2048 steps for rows
// they cover, else 4096. Backward: 1024-step tiles up to 1024 steps; beyond, 4096-step tiles where they leave no more
// threads idle than 2048-step tiles (ceil(L / 2048) even: the last 4096-step tile more than half full), else 2048.
// H200, bf16, 8 x 4096 rows, 4 against 2 runs a thread: 0.229 against 0.238 ms at L = 4096 (float32 0.395 against
// 0.399), faster at 7168 / 8192 / 12288, slower at 4104 / 5120 / 6144 (+7-9 %), and at 8 x 5120 x 2048 0.185 against
// 0.143 ms (RESULTS.md, eleventh session).
int cf_vec_runs(const ConvParams &p, int elt, bool bwd) {
  auto al = [](const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  bool ok = p.runmask != nullptr && p.x_ls == 1 && (p.seqlen * elt) % 16 == 0 && (p.x_bs * elt) % 16 == 0 &&
            (p.x_cs * elt) % 16 == 0 && al(p.x);
  if (bwd) ok = ok && p.g_ls == 1 && (p.g_bs * elt) % 16 == 0 && (p.g_cs * elt) % 16 == 0 && al(p.dout) && al(p.dx);
  else ok = ok && al(p.out);
  if (!ok) return 0;
  if (p.seqlen <= kSpanCF) return 1;
  if (bwd) return (p.seqlen + 2 * kSpanCF - 1) / (2 * kSpanCF) % 2 == 0 ? 4 : 2;
  return p.seqlen <= 2 * kSpanCF ? 2 : 4;
}

template <typename T, int kW>
int launch_cf_vec(const ConvParams &p, cudaStream_t st, bool bwd, int rpt) {
  if (!p.runmask_given) conv_runmask_launch(p.pos, p.runmask, p.batch, p.seqlen, st);
  const int tile = kSpanCF * rpt;
  const dim3 grid(p.dim, (p.seqlen + tile - 1) / tile, p.batch);
  if (bwd) {
    if (rpt == 1) {
      if (p.silu) conv_bwd_cf_vec<T, kW, 1, true><<<grid, kThreadsCF, 0, st>>>(p);
      else conv_bwd_cf_vec<T, kW, 1, false><<<grid, kThreadsCF, 0, st>>>(p);
    } else if (rpt == 2) {
      if (p.silu) conv_bwd_cf_vec<T, kW, 2, true><<<grid, kThreadsCF, 0, st>>>(p);
      else conv_bwd_cf_vec<T, kW, 2, false><<<grid, kThreadsCF, 0, st>>>(p);
    } else {
      if (p.silu) conv_bwd_cf_vec<T, kW, 4, true><<<grid, kThreadsCF, 0, st>>>(p);
      else conv_bwd_cf_vec<T, kW, 4, false><<<grid, kThreadsCF, 0, st>>>(p);
    }
  } else {
    if (rpt == 1) conv_fwd_cf_vec<T, kW, 1><<<grid, kThreadsCF, 0, st>>>(p);
    else if (rpt == 2) conv_fwd_cf_vec<T, kW, 2><<<grid, kThreadsCF, 0, st>>>(p);
    else conv_fwd_cf_vec<T, kW, 4><<<grid, kThreadsCF, 0, st>>>(p);
  }
  return bwd ? (int)(grid.y * grid.z) : 0;
}

}  // namespace conv

void conv_runmask_launch(const int *pos, uint16_t *mask, int batch, int seqlen, cudaStream_t st) {
  const int nruns = (seqlen + conv::kRun - 1) / conv::kRun, stride = conv_mask_stride(seqlen), total = batch * stride;
  if (total > 0) conv::conv_runmask_kernel<<<(total + 255) / 256, 256, 0, st>>>(pos, mask, seqlen, nruns, stride, total);
}

namespace conv {

#define INSTANTIATE(T, W) template int launch_cf_vec<T, W>(const ConvParams &, cudaStream_t, bool, int);
PACKLOADER_CONV_FOR_EACH_TYPE_WIDTH(INSTANTIATE)
#undef INSTANTIATE

}  // namespace conv
}  // namespace packloader_ops
