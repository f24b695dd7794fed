// Reductions over token segments (ops_common.h, SegmentSumsParams; ops/time_split.py, segment_sums): the end state
// from zero of a segment of the scan (forward) or the adjoint its first step hands back (backward), for every channel
// and state, and each segment's sum of dt. A plain sum over time, no recurrence: the cut along time and the chains of
// carried pieces (ops/carry.py) use it to give a piece its true initial state (or its end its gradient) before one
// pass of the scan kernels.
//
// A block: 8 channels x 16 states of one part of one segment, thread (channel c, state n); it walks its part in
// tiles of 64 timesteps (forward from its end, backward from its start), each tile's inputs loaded while the tile
// before is summed. Long segments on small grids are cut into parts (grid z; segment_sums_parts, from the caller's
// bound on the longest segment) whose sums a second small kernel combines (segment_parts_kernel). Per tile the 128
// threads stage, per channel and timestep, the sum of dt over the tile's timesteps after it (forward) or up to and
// including it (backward) and the term it multiplies (dt u, or the gated output gradient), and B or C per timestep
// and state; then each thread sums exp2(A2 w_t) term_t bc_t over the tile (one exp2 a product: 6 instructions) and
// adds that, times exp2(A2 s) for the dt s beyond the tile, to its running sum. Every exponent is a sum of dt toward
// the segment's far end: the rounding stays relative to the exponent's own size, as in the scan.
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
// parts (segment_sums_parts): the fewest (a power of two) that make this many blocks a multiprocessor, none shorter
// than kSegMinPartTiles tiles
constexpr int kSegBlocksPerSM = 16;
constexpr int kSegMinPartTiles = 4;
static_assert(kScanLanes == 16, "a channel's 16 threads stage its tile, 4 timesteps each");

// A tile's raw inputs, loaded one tile ahead: this thread's 4 timesteps of its channel's delta, x (and z), and 8
// timesteps of one state of B or C
template <typename in_t, typename w_t>
struct SegRaw {
  in_t delta[kSegPer], x[kSegPer], z[kSegPer];
  w_t bc[8];
};

template <typename in_t, typename w_t, bool kForward, bool kHasZ>
__global__ void __launch_bounds__(kSegThreads, 7) segment_sums_kernel(const SegmentSumsParams p) {
  __shared__ float2 wt[kSegCh][kSegTile + 1];   // {sum of dt toward the tile's far end, term}
  __shared__ float bcs[kSegTile][kScanLanes];   // B or C: [timestep][state]
  __shared__ float tile_dt[kSegCh];             // the tile's sum of dt, per channel
  const int tid = threadIdx.x;
  const int c = tid / kScanLanes, n = tid % kScanLanes;
  const int seg = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
  const int d = blockIdx.x * kSegCh + c;
  const bool d_ok = d < p.dim;
  const int64_t start = p.start[seg];
  const int len = (int)p.length[seg];
  const int64_t b = start / p.seqlen;
  const int t_lo = (int)(start % p.seqlen), t_hi = t_lo + len;
  // this block's tiles of the segment, counted from its far end (forward: the end; backward: the start)
  const int ntiles = (len + kSegTile - 1) / kSegTile, per = (ntiles + parts - 1) / parts;
  const int i_lo = part * per, i_hi = min(ntiles, i_lo + per);
  const float A2 = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] * kSegLog2e : 0.f;
  const float bias = (d_ok && p.delta_bias) ? p.delta_bias[d] : 0.f;
  const int dd = d_ok ? d : 0;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + b * p.delta_bs + dd * p.delta_ds;
  const in_t *x = reinterpret_cast<const in_t *>(p.x) + b * p.x_bs + dd * p.x_ds;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + b * p.z_bs + dd * p.z_ds : nullptr;
  const int r = tid / 8, j0 = (tid % 8) * 8;   // the B / C this thread stages: state r, timesteps j0 .. j0 + 7
  const w_t *bc = reinterpret_cast<const w_t *>(p.bc) + b * p.bc_bs + (r < p.dstate ? r : 0) * p.bc_ns;
  auto first = [&](int i) { return kForward ? t_hi - (i + 1) * kSegTile : t_lo + i * kSegTile; };
  auto load = [&](SegRaw<in_t, w_t> &raw, int i) {
    const int t0 = first(i);
#pragma unroll
    for (int k = 0; k < kSegPer; ++k) {
      const int t = t0 + n * kSegPer + k;
      const bool ok = d_ok && t >= t_lo && t < t_hi;
      raw.delta[k] = ok ? delta[t] : from_f<in_t>(0.f);
      raw.x[k] = ok ? x[t] : from_f<in_t>(0.f);
      if constexpr (kHasZ) raw.z[k] = ok ? z[t] : from_f<in_t>(0.f);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int t = t0 + j0 + k;
      raw.bc[k] = (r < p.dstate && t >= t_lo && t < t_hi) ? bc[t] : from_f<w_t>(0.f);
    }
  };

  float acc = 0.f, beyond = 0.f;   // the running sum; the dt between the current tile and the far end of the part
  SegRaw<in_t, w_t> raw;
  if (i_lo < i_hi) load(raw, i_lo);
  for (int i = i_lo; i < i_hi; ++i) {
    const int t0 = first(i);
    // this thread's 4 timesteps of its channel: dt, term (zero outside the segment: dt 0 adds nothing)
    float dt[kSegPer], term[kSegPer];
#pragma unroll
    for (int k = 0; k < kSegPer; ++k) {
      const int t = t0 + n * kSegPer + k;
      const bool ok = d_ok && t >= t_lo && t < t_hi;   // computed either way, then selected: no branch
      float v = to_f(raw.delta[k]) + bias;
      v = p.softplus ? softplus_(v) : v;
      float g = to_f(raw.x[k]);
      if constexpr (kHasZ) {
        const float zv = to_f(raw.z[k]);
        g *= zv * sigmoidf_(zv);
      }
      if constexpr (kForward) g *= v;
      dt[k] = ok ? v : 0.f;
      term[k] = ok ? g : 0.f;
    }
    float bcv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) bcv[k] = to_f(raw.bc[k]);
    if (i + 1 < i_hi) load(raw, i + 1);   // in flight while this tile is summed
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
#pragma unroll
    for (int k = 0; k < 8; ++k) bcs[j0 + k][r] = bcv[k];
    __syncthreads();
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int t = 0; t < kSegTile; ++t) {
      const float2 v = wt[c][t];
      sum[t & 3] = fmaf(exp2f(A2 * v.x), v.y * bcs[t][n], sum[t & 3]);
    }
    const float tile = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    acc = fmaf(exp2f(A2 * beyond), tile, acc);
    beyond += tile_dt[c];
    __syncthreads();   // wt, bcs and tile_dt are restaged next tile
  }
  // one part: the sums; several: this part's (parts_sums, parts_dt), combined by segment_parts_kernel
  float *sums = parts > 1 ? p.part_sums + (int64_t)part * p.segments * p.dim * p.dstate : p.sums;
  float *dts = parts > 1 ? p.part_dt + (int64_t)part * p.segments * p.dim : p.dt_sums;
  if (d_ok && n < p.dstate) sums[((int64_t)seg * p.dim + d) * p.dstate + n] = acc;
  if (d_ok && n == 0) dts[(int64_t)seg * p.dim + d] = beyond;
}

// the parts of each segment, from its far end: sum = sum_k exp2(A2 * dt of parts 0 .. k - 1) sum_k; a thread a
// (segment, channel, state)
__global__ void __launch_bounds__(256) segment_parts_kernel(const SegmentSumsParams p, int parts) {
  const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
  const int64_t per_part = (int64_t)p.segments * p.dim * p.dstate;
  if (i >= per_part) return;
  const int64_t sd = i / p.dstate;   // segment * dim + channel
  const int d = (int)(sd % p.dim), n = (int)(i % p.dstate);
  const float A2 = p.A[(int64_t)d * p.dstate + n] * kSegLog2e;
  float acc = 0.f, beyond = 0.f;
  for (int k = 0; k < parts; ++k) {
    acc = fmaf(exp2f(A2 * beyond), p.part_sums[k * per_part + i], acc);
    beyond += p.part_dt[k * (int64_t)p.segments * p.dim + sd];
  }
  p.sums[i] = acc;
  if (n == 0) p.dt_sums[sd] = beyond;
}

template <typename in_t, typename w_t>
void launch_typed(const SegmentSumsParams &p, cudaStream_t stream) {
  const dim3 grid((p.dim + kSegCh - 1) / kSegCh, p.segments, p.parts);
  if (p.forward) {
    segment_sums_kernel<in_t, w_t, true, false><<<grid, kSegThreads, 0, stream>>>(p);
  } else {
    bool_switch(p.z != nullptr, [&](auto has_z) {
      constexpr bool kHasZ = decltype(has_z)::value;
      segment_sums_kernel<in_t, w_t, false, kHasZ><<<grid, kSegThreads, 0, stream>>>(p);
    });
  }
  if (p.parts > 1) {
    const int64_t threads = (int64_t)p.segments * p.dim * p.dstate;
    segment_parts_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, stream>>>(p, p.parts);
  }
}

}  // namespace

int segment_sums_parts(int segments, int dim, int max_length, int sm_count) {
  const int blocks = (dim + kSegCh - 1) / kSegCh * segments;
  const int tiles = (max_length + kSegTile - 1) / kSegTile;
  int parts = 1;
  while (blocks * parts < kSegBlocksPerSM * sm_count && tiles >= 2 * parts * kSegMinPartTiles) parts *= 2;
  return parts;
}

void segment_sums_launch(const SegmentSumsParams &p, cudaStream_t stream) {
  if (p.segments == 0 || p.dim == 0) return;
  dtype_switch(p.in_dtype, [&](auto tag) {
    using in_t = decltype(tag);
    if (p.w_f32) launch_typed<in_t, float>(p, stream);
    else launch_typed<in_t, in_t>(p, stream);
  });
}

}  // namespace packloader_ops
