// Reductions over token segments (ops_common.h, SegmentSumsParams; ops/time_split.py, segment_sums): the end state
// from zero of a segment of the scan (forward) or the adjoint its first step hands back (backward), for every channel
// and state, and each segment's sum of dt. A plain sum over time, no recurrence: the cut along time and the chains of
// carried pieces (ops/carry.py) use it to give a piece its true initial state (or its end its gradient) before one
// pass of the scan kernels.
//
// A block: 8 channels x 16 states of one segment, thread (channel c, state n); it walks the segment in tiles of 64
// timesteps (forward from its end, backward from its start). Per tile the 128 threads stage, per channel and
// timestep, the sum of dt over the tile's timesteps after it (forward) or up to and including it (backward) and the
// term it multiplies (dt u, or the gated output gradient), and B or C per timestep and state; then each thread sums
// exp2(A2 w_t) term_t bc_t over the tile (one exp2 a product: 6 instructions) and adds that, times exp2(A2 s) for
// the dt s beyond the tile, to its running sum. Every exponent is a sum of dt toward the segment's far end:
// the rounding stays relative to the exponent's own size, as in the scan.
#include "dispatch.cuh"

#include "ops_common.h"
#include "dtype_utils.cuh"

namespace packloader_ops {

namespace {

constexpr int kSegCh = 8;                          // channels a block
constexpr int kSegThreads = kSegCh * kScanLanes;   // 128: a thread a (channel, state)
constexpr int kSegTile = 64;                       // timesteps a tile
constexpr int kSegPer = kSegTile / kScanLanes;     // 4: timesteps a thread stages per tile and channel
constexpr float kSegLog2e = 1.4426950408889634f;
static_assert(kScanLanes == 16, "a channel's 16 threads stage its tile, 4 timesteps each");

template <typename in_t, typename w_t, bool kForward, bool kHasZ>
__global__ void __launch_bounds__(kSegThreads) segment_sums_kernel(const SegmentSumsParams p) {
  __shared__ float2 wt[kSegCh][kSegTile + 1];   // {sum of dt toward the tile's far end, term}
  __shared__ float bcs[kSegTile][kScanLanes];   // B or C: [timestep][state]
  __shared__ float tile_dt[kSegCh];             // the tile's sum of dt, per channel
  const int tid = threadIdx.x;
  const int c = tid / kScanLanes, n = tid % kScanLanes;
  const int seg = blockIdx.y;
  const int d = blockIdx.x * kSegCh + c;
  const bool d_ok = d < p.dim;
  const int64_t start = p.start[seg], len = p.length[seg];
  const int64_t b = start / p.seqlen;
  const int64_t t_lo = start % p.seqlen, t_hi = t_lo + len;
  const float A2 = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] * kSegLog2e : 0.f;
  const float bias = (d_ok && p.delta_bias) ? p.delta_bias[d] : 0.f;
  const int dd = d_ok ? d : 0;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + b * p.delta_bs + dd * p.delta_ds;
  const in_t *x = reinterpret_cast<const in_t *>(p.x) + b * p.x_bs + dd * p.x_ds;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + b * p.z_bs + dd * p.z_ds : nullptr;
  const w_t *bc = reinterpret_cast<const w_t *>(p.bc) + b * p.bc_bs;

  float acc = 0.f, beyond = 0.f;   // the running sum; the dt beyond the current tile (after it / before it)
  const int64_t ntiles = (len + kSegTile - 1) / kSegTile;
  for (int64_t i = 0; i < ntiles; ++i) {
    const int64_t t0 = kForward ? t_hi - (i + 1) * kSegTile : t_lo + i * kSegTile;   // the tile's first timestep
    // this thread's 4 timesteps of its channel: dt, term
    float dt[kSegPer], term[kSegPer];
#pragma unroll
    for (int k = 0; k < kSegPer; ++k) {
      const int64_t t = t0 + n * kSegPer + k;
      const bool ok = d_ok && t >= t_lo && t < t_hi;
      float v = 0.f, g = 0.f;
      if (ok) {
        v = to_f(delta[t]) + bias;
        v = p.softplus ? softplus_(v) : v;
        g = to_f(x[t]);
        if constexpr (kHasZ) {
          const float zv = to_f(z[t]);
          g *= zv * sigmoidf_(zv);
        }
        if constexpr (kForward) g *= v;
      }
      dt[k] = v;
      term[k] = g;
    }
    // within the tile, per channel: forward the dt after each timestep, backward the dt up to and including it
    const float own = (dt[0] + dt[1]) + (dt[2] + dt[3]);
    float scan = own;   // inclusive over the channel's threads: forward from its last, backward from its first
    const int lane = tid & 31, base = lane & ~(kScanLanes - 1);
#pragma unroll
    for (int o = 1; o < kScanLanes; o *= 2) {
      const int src = kForward ? n + o : n - o;
      const float v = __shfl_sync(0xffffffffu, scan, base + (src & (kScanLanes - 1)));
      if (kForward ? src < kScanLanes : src >= 0) scan += v;
    }
    float w = scan - own;   // the dt of the channel's threads after (forward) / before (backward) this one
    if constexpr (kForward) {
#pragma unroll
      for (int k = kSegPer - 1; k >= 0; --k) {
        wt[c][n * kSegPer + k] = make_float2(w, term[k]);
        w += dt[k];
      }
      if (n == 0) tile_dt[c] = scan;
    } else {
#pragma unroll
      for (int k = 0; k < kSegPer; ++k) {
        w += dt[k];
        wt[c][n * kSegPer + k] = make_float2(w, term[k]);
      }
      if (n == kScanLanes - 1) tile_dt[c] = scan;
    }
    // B or C of the tile: state r = tid / 8, timesteps 8 (tid % 8) .. + 7
    {
      const int r = tid / 8, j0 = (tid % 8) * 8;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t t = t0 + j0 + k;
        bcs[j0 + k][r] = (r < p.dstate && t >= t_lo && t < t_hi) ? to_f(bc[r * p.bc_ns + t]) : 0.f;
      }
    }
    __syncthreads();
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int t = 0; t < kSegTile; ++t) {
      const float2 v = wt[c][t];
      part[t & 3] = fmaf(exp2f(A2 * v.x), v.y * bcs[t][n], part[t & 3]);
    }
    const float tile = (part[0] + part[1]) + (part[2] + part[3]);
    acc = fmaf(exp2f(A2 * beyond), tile, acc);
    beyond += tile_dt[c];
    __syncthreads();   // wt, bcs and tile_dt are restaged next tile
  }
  if (d_ok && n < p.dstate) p.sums[((int64_t)seg * p.dim + d) * p.dstate + n] = acc;
  if (d_ok && n == 0) p.dt_sums[(int64_t)seg * p.dim + d] = beyond;
}

template <typename in_t, typename w_t>
void launch_typed(const SegmentSumsParams &p, cudaStream_t stream) {
  const dim3 grid((p.dim + kSegCh - 1) / kSegCh, p.segments);
  if (p.forward) {
    segment_sums_kernel<in_t, w_t, true, false><<<grid, kSegThreads, 0, stream>>>(p);
  } else {
    bool_switch(p.z != nullptr, [&](auto has_z) {
      constexpr bool kHasZ = decltype(has_z)::value;
      segment_sums_kernel<in_t, w_t, false, kHasZ><<<grid, kSegThreads, 0, stream>>>(p);
    });
  }
}

}  // namespace

void segment_sums_launch(const SegmentSumsParams &p, cudaStream_t stream) {
  if (p.segments == 0 || p.dim == 0) return;
  dtype_switch(p.in_dtype, [&](auto tag) {
    using in_t = decltype(tag);
    if (p.w_f32) launch_typed<in_t, float>(p, stream);
    else launch_typed<in_t, in_t>(p, stream);
  });
}

}  // namespace packloader_ops
