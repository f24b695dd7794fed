// Reductions over token segments (ops_common.h, SegmentSumsParams; ops/time_split.py, segment_sums): the end state
// from zero of a segment of the scan (forward) or the adjoint its first step hands back (backward), for every channel
// and state, and each segment's sum of dt. A plain sum over time, no recurrence: the cut along time and the chains of
// carried pieces (ops/carry.py) use it to give a piece its true initial state (or its end its gradient) before one
// pass of the scan kernels.
//
// A block: 8 channels x 16 states of one part of one segment; it walks its part in tiles of 64 timesteps (forward
// from its end, backward from its start), each tile's inputs loaded while the tile before is summed (in vectors where
// the tile lies wholly inside the segment and the pointers allow). Long segments on small grids are cut into parts
// (grid z; segment_sums_parts, from the caller's bound on the longest segment) whose sums a second small kernel
// combines (segment_parts_kernel). Per tile the 128 threads stage, per channel and timestep, the sum of dt over the
// tile's timesteps after it (forward) or up to and including it (backward) and the term it multiplies (dt u, or the
// gated output gradient), and B or C per timestep and state; then each thread sums exp2(A2 w_t) term_t bc_t over a
// quarter of the tile's timesteps for 2 channels x 2 states (3 shared loads for 4 products), the 4 quarters are
// summed by shuffles, and each thread adds that, times exp2(A2 s) for the dt s beyond the tile, to its running sums.
// The kernel is bound by instruction issue (Nsight Compute, H200: about half the issue slots busy, the exponentials'
// pipe far from full), so the staging (softplus, loads) counts as much as the products. Every exponent is a sum of dt
// toward the segment's far end: the rounding stays relative to the exponent's own size, as in the scan.
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
  alignas(16) in_t delta[kSegPer];
  alignas(16) in_t x[kSegPer];
  alignas(16) in_t z[kSegPer];
  alignas(16) w_t bc[8];
};

// dst = src[0 .. N) in 16- or 8-byte vectors (src aligned to them)
template <typename T, int N>
__device__ __forceinline__ void load_vec(T (&dst)[N], const T *src) {
  constexpr int kBytes = sizeof(T) * N;
  static_assert(kBytes % 8 == 0, "whole 8-byte vectors");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int j = 0; j < kBytes / 16; ++j) reinterpret_cast<uint4 *>(dst)[j] = reinterpret_cast<const uint4 *>(src)[j];
  } else {
#pragma unroll
    for (int j = 0; j < kBytes / 8; ++j) reinterpret_cast<uint2 *>(dst)[j] = reinterpret_cast<const uint2 *>(src)[j];
  }
}

__device__ __forceinline__ bool aligned_to(const void *ptr, int bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (uintptr_t)(bytes - 1)) == 0;
}

template <typename in_t, typename w_t, bool kForward, bool kHasZ>
__global__ void __launch_bounds__(kSegThreads, 7) segment_sums_kernel(const SegmentSumsParams p) {
  __shared__ float2 wt[kSegCh][kSegTile + 1];   // {sum of dt toward the tile's far end, term}
  __shared__ __align__(8) float bcs[kSegTile][kScanLanes];   // B or C: [timestep][state]
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
  // the sums' role: channels c2 + {0, 1} (2 x 4 a block), states n2 + {0, 1}, timesteps q, q + 4, .. of each tile
  const int q = tid & 3, n2 = ((tid >> 2) & 7) * 2, c2 = (tid >> 5) * 2;
  static_assert(kSegThreads == 128 && kSegCh == 8, "the sums' role: 4 quarters x 8 state pairs x 4 channel pairs");
  float A2[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int di = blockIdx.x * kSegCh + c2 + i;
#pragma unroll
    for (int j = 0; j < 2; ++j)
      A2[i][j] = (di < p.dim && n2 + j < p.dstate) ? p.A[(int64_t)di * p.dstate + n2 + j] * kSegLog2e : 0.f;
  }
  const float bias = (d_ok && p.delta_bias) ? p.delta_bias[d] : 0.f;
  const int dd = d_ok ? d : 0;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + b * p.delta_bs + dd * p.delta_ds;
  const in_t *x = reinterpret_cast<const in_t *>(p.x) + b * p.x_bs + dd * p.x_ds;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + b * p.z_bs + dd * p.z_ds : nullptr;
  const int r = tid / 8, j0 = (tid % 8) * 8;   // the B / C this thread stages: state r, timesteps j0 .. j0 + 7
  const w_t *bc = reinterpret_cast<const w_t *>(p.bc) + b * p.bc_bs + (r < p.dstate ? r : 0) * p.bc_ns;
  auto first = [&](int i) { return kForward ? t_hi - (i + 1) * kSegTile : t_lo + i * kSegTile; };
  // a tile wholly inside the segment is loaded in vectors where this thread's pointers allow (the same for each of
  // its tiles: they are kSegTile timesteps apart), element by element with bounds otherwise
  constexpr int kInVec = (int)sizeof(in_t) * kSegPer, kBcVec = (int)sizeof(w_t) * 8 >= 16 ? 16 : 8;
  const int tv = first(i_lo) + n * kSegPer, tb = first(i_lo) + j0;
  const bool vec_ok = d_ok && aligned_to(delta + tv, kInVec) && aligned_to(x + tv, kInVec) &&
                      (!kHasZ || aligned_to(z + tv, kInVec)) && (r >= p.dstate || aligned_to(bc + tb, kBcVec));
  auto load = [&](SegRaw<in_t, w_t> &raw, int i) {
    const int t0 = first(i);
    if (vec_ok && t0 >= t_lo && t0 + kSegTile <= t_hi) {
      load_vec(raw.delta, delta + t0 + n * kSegPer);
      load_vec(raw.x, x + t0 + n * kSegPer);
      if constexpr (kHasZ) load_vec(raw.z, z + t0 + n * kSegPer);
      if (r < p.dstate) {
        load_vec(raw.bc, bc + t0 + j0);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) raw.bc[k] = from_f<w_t>(0.f);
      }
      return;
    }
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

  // the running sums and the dt between the current tile and the far end of the part, per (channel, state) of the
  // sums' role
  float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}}, beyond[2] = {0.f, 0.f};
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
    // the sums' role: a quarter of the tile's timesteps for 2 channels x 2 states; a warp's 4 quarters read 4
    // consecutive timesteps (no bank conflict)
    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll 4
    for (int u = 0; u < kSegTile / 4; ++u) {
      const int t = 4 * u + q;
      const float2 w0 = wt[c2][t], w1 = wt[c2 + 1][t];
      const float2 bv = *reinterpret_cast<const float2 *>(&bcs[t][n2]);
      sum[0][0] = fmaf(exp2f(A2[0][0] * w0.x), w0.y * bv.x, sum[0][0]);
      sum[0][1] = fmaf(exp2f(A2[0][1] * w0.x), w0.y * bv.y, sum[0][1]);
      sum[1][0] = fmaf(exp2f(A2[1][0] * w1.x), w1.y * bv.x, sum[1][0]);
      sum[1][1] = fmaf(exp2f(A2[1][1] * w1.x), w1.y * bv.y, sum[1][1]);
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float v = sum[a][j];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        acc[a][j] = fmaf(exp2f(A2[a][j] * beyond[a]), v, acc[a][j]);
      }
      beyond[a] += tile_dt[c2 + a];
    }
    __syncthreads();   // wt, bcs and tile_dt are restaged next tile
  }
  // one part: the sums; several: this part's (parts_sums, parts_dt), combined by segment_parts_kernel
  float *sums = parts > 1 ? p.part_sums + (int64_t)part * p.segments * p.dim * p.dstate : p.sums;
  float *dts = parts > 1 ? p.part_dt + (int64_t)part * p.segments * p.dim : p.dt_sums;
  if (q == 0) {
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const int da = blockIdx.x * kSegCh + c2 + a;
      if (da >= p.dim) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (n2 + j < p.dstate) sums[((int64_t)seg * p.dim + da) * p.dstate + n2 + j] = acc[a][j];
      if (n2 == 0) dts[(int64_t)seg * p.dim + da] = beyond[a];
    }
  }
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
