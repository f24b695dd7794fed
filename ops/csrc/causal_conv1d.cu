// Packed causal depthwise conv1d, forward and backward. Lag-k tap (weight[:, W-1-k] times x[t-k]) is used at
// time t only where position_ids[t] >= k, so no tap reaches into the previous sequence of a packed row.
//
// The kernels live in one file per family, chosen here per call:
//   conv_cf_vec.cu   channel-first rows aligned to 16-byte vectors (the usual case)
//   conv_cf_regs.cu  other channel-first rows
//   conv_cl.cu       channel-last x
// conv_common.cuh holds what they share; dispatch.cuh the dtype / width switches.
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
// dweight / dbias are reduced in the block (warp shuffles, then shared memory) into the block's own slot of the
// partials; one more small kernel (conv_dw_sum_kernel) adds the slots in slot order into dweight / dbias (no
// atomics: the same bits every run). It replaced two torch sums over the slots (H200, B=8, D=4096, L=4096: 3.7 us
// each; see benchmarks/results/RESULTS.md).
// Every kernel skips a dropped tap's multiply-add instead of multiplying by zero, so an inf or NaN in one
// sequence cannot reach another as 0 * inf. position_ids must restart at 0 and count up by 1 (the Python layer
// validates them): the register and channel-last kernels read reach = min(pos, W-1), the vector kernels a start
// where pos == 0, which agree on valid ids only.

#include "conv_common.cuh"
#include "dispatch.cuh"

namespace packloader_ops {

namespace {

// one family per layout: channel-last; channel-first rows the vector kernels take; the rest. Returns the dweight
// slots the backward wrote.
int launch(const ConvParams &p, cudaStream_t st, bool bwd) {
  int slots = 0;
  dtype_switch(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    width_switch(p.width, [&](auto w) {
      constexpr int kW = decltype(w)::value;
      if (p.channel_last) {
        slots = conv::launch_cl<T, kW>(p, st, bwd);
      } else if (const int rpt = conv::cf_vec_runs(p, sizeof(T), bwd)) {
        slots = conv::launch_cf_vec<T, kW>(p, st, bwd, rpt);
      } else {
        slots = conv::launch_cf_regs<T, kW>(p, st, bwd);
      }
    });
  });
  return slots;
}

// dweight (dim, W) and dbias (dim) from the first `slots` partials (slots, dim, W + 1): one thread an output, adding
// slot 0, 1, 2, ... in that order. Loads go out kBatch at a time so that their latencies overlap.
__global__ void conv_dw_sum_kernel(const float *dw_part, int slots, int dim, int W, float *dweight, float *dbias) {
  constexpr int kBatch = 8;
  const int n = dim * (W + 1);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = 0.f;
  for (int k0 = 0; k0 < slots; k0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = k0 + k < slots ? dw_part[(int64_t)(k0 + k) * n + i] : 0.f;
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (k0 + k < slots) s += v[k];
  }
  const int d = i / (W + 1), j = i - d * (W + 1);
  if (j < W) dweight[d * W + j] = s;
  else if (dbias) dbias[d] = s;
}

}  // namespace

void conv_fwd_launch(const ConvParams &p, cudaStream_t st) { launch(p, st, false); }

int conv_bwd_launch(const ConvParams &p, cudaStream_t st) {
  const int slots = launch(p, st, true);
  const int n = p.dim * (p.width + 1);
  if (slots > 0 && n > 0) conv_dw_sum_kernel<<<(n + 255) / 256, 256, 0, st>>>(p.dw_part, slots, p.dim, p.width,
                                                                             p.dweight, p.dbias);
  return slots;
}

}  // namespace packloader_ops
