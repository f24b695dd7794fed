// Packed selective scan (Mamba-1), forward and backward, with a state reset where position_ids == 0.
//
// Forward: a thread carries all 16 states h[b, d, 0..15] of one channel (dstate padded to 16) sequentially through
// time, a warp the 32 channels of one block; per timestep and state one exp2 and a few FMAs, and the sum over states
// y = sum_n C h in the thread's registers (scan_fwd_kernel).
// Backward: a thread block owns 16 channels of one batch row, 128 threads: each thread carries TWO scalar states
// h[b, d, n] and h[b, d, n + 8] of one channel, 8 threads a channel. Timesteps are staged in shared memory 64 at a
// time (u, delta after softplus, dt*u, masks, B and C shared by the block's 16 channels); a sum over the 16 states
// (y, and the two sums du and ddelta are made of) is the thread's two states added, then every 16 timesteps a
// butterfly reduce-scatter across the channel's 8 threads, so thread n ends up owning timesteps 16*s + 2n and
// 16*s + 2n + 1. Both sum over states in the same tree (sum_states_thread / _lanes), so the backward's recomputed output is the
// forward's, bit for bit.
// Reset: where pos_t == 0 the update is h_t = delta_t B_t u_t, a select that drops the carried state instead of
// multiplying it by zero, and in backward the adjoint handed from t to t-1 and the terms through h_{t-1} are
// dropped the same way: not even an inf or NaN (0 * inf is NaN) crosses a boundary, forward or backward, nor the
// chunk carry (the saved chunk-end states feed the same select).
// Backward recomputes states per 64-step chunk from the forward's saved chunk-end states, keeping the states at
// each 16-step sub-chunk start in registers, then re-running each sub-chunk (2 x 16 states + 2 x 16 decays in
// registers) and walking it in reverse. dB/dC are summed over the warp's channels with shuffles, over the block's
// warps in shared memory and added to fp32 buffers with one atomic per (block, n, t) (deterministic mode: stored to
// the block's own slot of det_part, which the caller sums in a fixed order); dA, dD, ddelta_bias are reduced per
// thread / channel and stored per batch row (the caller sums the rows: no atomics, the same bits every run).
// Segments (grid z, both kernels): on grids too small to fill the GPU the caller cuts each row at sequence starts into
// segments that run side by side, the bits of one pass (segment_bound; the plan: ops/contract.py, scan_segments).
#include "dispatch.cuh"

#include "ops_common.h"
#include "dtype_utils.cuh"
#include "cp_async.cuh"

namespace packloader_ops {

namespace {

constexpr int kLanes = kScanLanes;      // 16
constexpr int kDB = PACKLOADER_SCAN_BLOCK_CHANNELS;   // channels per block (16)
constexpr int kThreads = kLanes / 2 * kDB;   // 128: 8 threads a channel, two states each
constexpr int kSub = 16;                // timesteps per reduce-scatter group
constexpr int kChunk = kScanChunk;      // 64
constexpr int kNSub = kChunk / kSub;    // 4
static_assert(kNSub == 4, "sub-chunk start selection below assumes 4 sub-chunks");
constexpr int kPad = kDB + 1;           // padded row length (bank conflicts)
constexpr float kLog2e = 1.4426950408889634f;


// One step of the recurrence, h <- exp2(dA2) h + bx, or h <- bx at a sequence start (keep == 0): a select that drops
// the carried state (not a multiply by zero: an inf or NaN state stays in its sequence). The decay is computed either
// way, so the select needs no branch. The forward and both backward recomputations call this: the same bits.
__device__ __forceinline__ float scan_step(float dA2, float bx, float h, bool keep) {
  const float carried = fmaf(exp2f(dA2), h, bx);
  return keep ? carried : bx;
}

// ---- raw staging: the next chunk's inputs are copied into shared memory with cp.async (cp_async.cuh; 4-byte units,
// zero-filled past the end) while the current chunk computes; a conversion pass then turns them into the fp32 arrays.
template <typename in_t, typename w_t, int kNIn>
struct RawChunk {
  in_t in[kNIn][kDB][kChunk];   // forward: u, delta, z; backward: u, delta, z, dout
  w_t bc[2][kLanes][kChunk];    // B, C
  int pos[kChunk];
};

// rows r < 16 of a (rows, L) matrix with row stride `stride`, timesteps t0..t0+63 (t0 a multiple of 64), into
// dst[r][0..63], zeros past L and past `rows`. kAsync: cp.async, in 16-byte units where vec16 (every row 16-byte
// aligned: the matrix and L * sizeof(T) a multiple of 16, so a unit lies wholly before or past L), else in 4-byte
// units (needs 4-byte aligned rows: L even for 16-bit types); else plain loads. A thread's units are fixed by its
// index (tid < kNThreads), so the loops have fixed trip counts and no division (ncu: the earlier strided loops cost
// 10 % of the backward's instructions).
template <bool kAsync, int kNThreads = kThreads, typename T>
__device__ __forceinline__ void stage_rows(T (*dst)[kChunk], const T *src, int64_t stride, int rows, int t0, int L,
                                           int tid, bool vec16) {
  if constexpr (kAsync) {
    if (vec16) {
      constexpr int kEpu = 16 / sizeof(T), kUpr = kChunk / kEpu, kUnits = 16 * kUpr;
      static_assert(kUnits % kNThreads == 0, "whole 16-byte units a thread");
#pragma unroll
      for (int k = 0; k < kUnits / kNThreads; ++k) {
        const int i = tid + k * kNThreads, r = i / kUpr, tu = (i % kUpr) * kEpu, t = t0 + tu;
        const bool ok = r < rows && t < L;
        cp_async16(&dst[r][tu], ok ? (const void *)(src + r * stride + t) : (const void *)src, ok ? 16 : 0);
      }
    } else {
      constexpr int kEpu = 4 / sizeof(T), kUpr = kChunk / kEpu, kUnits = 16 * kUpr;
      static_assert(kUnits % kNThreads == 0, "whole 4-byte units a thread");
#pragma unroll 4
      for (int k = 0; k < kUnits / kNThreads; ++k) {
        const int i = tid + k * kNThreads, r = i / kUpr, tu = (i % kUpr) * kEpu, t = t0 + tu;
        const bool ok = r < rows && t < L;
        cp_async4(&dst[r][tu], ok ? (const void *)(src + r * stride + t) : (const void *)src,
                  ok ? (int)(min(kEpu, L - t) * sizeof(T)) : 0);
      }
    }
  } else {
#pragma unroll 4
    for (int k = 0; k < 16 * kChunk / kNThreads; ++k) {
      const int i = tid + k * kNThreads, r = i / kChunk, tt = i % kChunk, t = t0 + tt;
      dst[r][tt] = (r < rows && t < L) ? src[r * stride + t] : from_f<T>(0.f);
    }
  }
}

template <bool kAsync>
__device__ __forceinline__ void stage_pos(int *dst, const int *pos, int t0, int L, int tid) {
  if (tid < kChunk) {
    const int t = t0 + tid;
    if constexpr (kAsync) cp_async4(dst + tid, t < L ? pos + t : pos, t < L ? 4 : 0);
    else dst[tid] = t < L ? pos[t] : 0;
  }
}

// v[j] (j = 0..15) in each of 8 lanes -> v[0], v[1] of lane l hold the sums over the 8 lanes of v[2l], v[2l+1].
// With the sum of a thread's two states (n, n + 8) before it, this is the tree of every sum over the 16 states, in the
// forward and in the backward's recomputation: the same bits.
// one level of it: lanes kDist apart swap halves of their first 2 * kDist values and add what they receive
template <int kDist>
__device__ __forceinline__ void reduce_scatter_level(float (&v)[16], int lane8) {
  constexpr int kHalf = 2 * kDist;
  const bool hi = lane8 & kDist;
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    const float send = hi ? v[j] : v[j + kHalf];
    const float keep = hi ? v[j + kHalf] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, kDist);
  }
}
__device__ __forceinline__ void reduce_scatter8(float (&v)[16], int lane8) {
  reduce_scatter_level<4>(v, lane8);
  reduce_scatter_level<2>(v, lane8);
  reduce_scatter_level<1>(v, lane8);
}

// ---- segments: a packed row's sequences are independent, so a row can be cut at sequence starts into segments that
// run side by side (grid z), each from a zero state, with the same bits as one pass over the row (the state at a
// start is dropped by scan_step's select either way). Segment k of K is [bound(k), bound(k + 1)): bound(0) = 0,
// bound(K) = L, else the first sequence start (position id 0) at or after k L / K; a stretch with no start in it
// stays in one segment (its later segments are empty). Used where a grid has too few warps to fill the GPU.
constexpr int kSearchLoads = 8;   // position ids a lane reads per round trip of the search (8 x 32 timesteps)
__device__ __forceinline__ int segment_bound(const int *pos, int k, int K, int L, int lane) {
  if (k <= 0) return 0;
  if (k >= K) return L;
  for (int t = (int)((int64_t)k * L / K); t < L; t += 32 * kSearchLoads) {
    int v[kSearchLoads];
#pragma unroll
    for (int i = 0; i < kSearchLoads; ++i) {
      const int ti = t + 32 * i + lane;
      v[i] = ti < L ? pos[ti] : 1;
    }
#pragma unroll
    for (int i = 0; i < kSearchLoads; ++i) {
      const unsigned m = __ballot_sync(0xffffffffu, v[i] == 0);
      if (m) return t + 32 * i + __ffs(m) - 1;
    }
  }
  return L;
}

// The forward: kP threads a channel (kP = 1, 2, 4 or 8, chosen per launch: fwd_lanes), each carrying kS = 16 / kP
// of its states (lane sub of the channel: states sub, sub + kP, sub + 2 kP, ...), a warp the 32 / kP channels of one
// block. With kP = 1 what belongs to a (channel, timestep) (the softplus, dt * u, the D skip, silu(z), the output)
// is done once, not once per state lane, and the sum y = sum_n C h needs no shuffles; but a warp then needs about
// 150 cycles a timestep (16 exp2 on its scheduler's MUFU), so with few channels (fewer warps than the SMs'
// schedulers) the time stops falling with size. More lanes a channel split that per-timestep chain kP ways (kP times
// the warps, kS exp2 each) at the price of log2(kP) shuffles a timestep and the per-(channel, timestep) work shared
// out over the channel's lanes. Each lane reads its share (kR = kFwdRun / kP timesteps) of its channel's rows of u /
// delta / z one run of kFwdRun timesteps ahead of the run it computes (2 or 3 runs ahead measured no faster:
// RESULTS.md); the warp stages B and C (shared by its channels) of the run through shared memory as fp32 pairs and
// its reset mask as one ballot (bit j: timestep j starts a sequence). Warps are independent (one warp a block).
constexpr int kFwdRun = 8;    // timesteps a warp loads and computes at a time
static_assert(kChunk % kFwdRun == 0, "saved states fall on run ends");

template <int kP>
struct FwdLayout {
  static_assert(kP == 1 || kP == 2 || kP == 4 || kP == 8, "lanes a channel");
  static constexpr int kS = kLanes / kP;    // states a thread
  static constexpr int kQ = kS / 2;         // its pairs (n, n + 8): local j and j + kQ
  static constexpr int kCh = 32 / kP;       // channels a warp
  static constexpr int kR = kFwdRun / kP;   // timesteps of a run a lane loads, prepares and stores
  static constexpr int kHalves = kCh > 16 ? 2 : 1;   // B/C groups a warp can span (groups: multiples of 16 channels)
  static constexpr int kMinBlocks = kP == 8 ? 16 : 12;   // register caps that do not spill
};

// The forward's and backward's tree over the 16 states: q_l = C_l h_l + C_{l+8} h_{l+8}, summed
// ((q0 + q4) + (q2 + q6)) + ((q1 + q5) + (q3 + q7)), as reduce_scatter8 sums the 8 lanes of the backward (float
// addition commutes, so the order within each pair does not matter): the backward recomputes these bits. A thread
// holds q_l for l = sub + kP j; the levels of the tree whose pairs lie in one thread are summed there, the rest
// (distance < kP) across the channel's lanes; every lane ends with the whole sum.
template <int kP>
__device__ __forceinline__ float sum_states_thread(const float (&h)[kLanes / kP], const float (&c)[kLanes / kP]) {
  constexpr int kQ = FwdLayout<kP>::kQ;
  float q[kQ];
#pragma unroll
  for (int l = 0; l < kQ; ++l) q[l] = __fadd_rn(__fmul_rn(h[l], c[l]), __fmul_rn(h[l + kQ], c[l + kQ]));
#pragma unroll
  for (int gd = 4; gd >= kP; gd /= 2) {   // pairs at distance gd in state index: gd / kP apart in the thread
#pragma unroll
    for (int l = 0; l < gd / kP; ++l) q[l] = __fadd_rn(q[l], q[l + gd / kP]);
  }
  return q[0];
}
template <int kP>
__device__ __forceinline__ float sum_states_lanes(float y) {
#pragma unroll
  for (int gd = kP / 2; gd >= 1; gd /= 2) y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, gd));
  return y;
}

// kBytes from src to dst (both aligned to kBytes), in the widest moves
template <int kBytes>
__device__ __forceinline__ void copy_vec(void *dst, const void *src) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) static_cast<uint4 *>(dst)[k] = static_cast<const uint4 *>(src)[k];
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 8; ++k) static_cast<uint2 *>(dst)[k] = static_cast<const uint2 *>(src)[k];
  } else if constexpr (kBytes % 4 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 4; ++k) static_cast<unsigned *>(dst)[k] = static_cast<const unsigned *>(src)[k];
  } else {
    static_assert(kBytes == 2, "whole 16-bit elements");
    *static_cast<unsigned short *>(dst) = *static_cast<const unsigned short *>(src);
  }
}

// kN raw values of one row (timesteps t0 .. t0 + kN - 1), kept unconverted until used so that the loads of the
// next run overlap the current one; zeros past L or where !ok. kVec: the row is 16-byte aligned (fwd_vectorized),
// t0 a multiple of kN.
template <typename T, int kN>
struct alignas(kN * sizeof(T) >= 16 ? 16 : kN * sizeof(T)) Run {
  T v[kN];
};
template <bool kVec, typename T, int kN>
__device__ __forceinline__ void load_run(Run<T, kN> &r, const T *row, int t0, int L, bool ok) {
  if (kVec && ok && t0 + kN <= L) {
    copy_vec<kN * sizeof(T)>(r.v, row + t0);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) r.v[j] = (ok && t0 + j < L) ? row[t0 + j] : from_f<T>(0.f);
  }
}
// ... stored where lo <= t < hi (a segment's timesteps)
template <bool kVec, typename T, int kN>
__device__ __forceinline__ void store_run(T *row, const Run<T, kN> &r, int t0, int lo, int hi, bool ok) {
  if (kVec && ok && t0 >= lo && t0 + kN <= hi) {
    copy_vec<kN * sizeof(T)>(row + t0, r.v);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) if (ok && t0 + j >= lo && t0 + j < hi) row[t0 + j] = r.v[j];
  }
}

// A lane's share of the warp's B and C for one run: state n = lane / 2, timesteps t0 + kFwdRun / 2 * (lane % 2) + k
template <typename w_t>
struct RunBC {
  Run<w_t, kFwdRun / 2> B, C;
};
template <bool kVec, typename w_t>
__device__ __forceinline__ void load_bc(RunBC<w_t> &r, const w_t *Bp, const w_t *Cp, int t0, int L, int lane,
                                        int dstate) {
  const int n = lane >> 1, tb = t0 + (lane & 1) * (kFwdRun / 2);
  load_run<kVec>(r.B, Bp + (int64_t)n * L, tb, L, n < dstate);
  load_run<kVec>(r.C, Cp + (int64_t)n * L, tb, L, n < dstate);
}
// ... stored as fp32 {B_n, C_n} pairs at bc[t][n]
template <typename w_t>
__device__ __forceinline__ void put_bc(float2 (*bc)[16], const RunBC<w_t> &r, int lane) {
  const int n = lane >> 1, tb = (lane & 1) * (kFwdRun / 2);
#pragma unroll
  for (int k = 0; k < kFwdRun / 2; ++k) bc[tb + k][n] = make_float2(to_f(r.B.v[k]), to_f(r.C.v[k]));
}

// Which carried states a scan kernel handles (its kStates): none, per token (state_slots) or at row edges (row_slots)
enum StatesKind : int { kNoStates = 0, kTokenStates = 1, kRowStates = 2 };

// the variant a launch takes; row-edge states are compiled for the gated scan (z: the Mamba mixer's) only, the
// Python side hands them per token otherwise (ops/selective_scan_interface.py, _state_args)
template <typename F>
inline void states_switch(const ScanParams &p, F &&f) {
  if (p.row_slots != nullptr) f(std::integral_constant<int, kRowStates>{});
  else if (p.state_slots != nullptr) f(std::integral_constant<int, kTokenStates>{});
  else f(std::integral_constant<int, kNoStates>{});
}

// What a lane loads for one run: its share of its channel's u, delta (and z), its share of B / C and, lanes <
// kFwdRun, the position id of timestep t0 + lane (and, with carried states, its two state slots).
template <typename in_t, typename w_t, int kR>
struct FwdRunIn {
  Run<in_t, kR> u, delta, z;
  RunBC<w_t> bc;
  int pos;
  int islot, fslot;   // kTokenStates only: state_slots[0 / 1] of timestep t0 + lane (-1: none)
};

// kStates (StatesKind): kNoStates, the plain kernel (no loads, no ballots). kTokenStates: carried states per token
// (ScanParams::state_slots). A sequence start with an initial-state slot loads h from initial_state before its first
// step and keeps it (the step is h <- exp2(dA2) h0 + bx, not a reset); a sequence's last token with a final-state slot
// stores h to final_state. Both are rare, warp-uniform branches on a ballot of the run's slots. kRowStates: states at
// row edges only (ScanParams::row_slots), the plain kernel with the states outside its loop: h loaded before the
// row's first run (whose reset at t = 0 is skipped) and stored after its last (the steps past L leave it unchanged:
// dt is 0 there). A variant of its own: in the plain kernel the few extra values cost registers (ptxas).
template <typename in_t, typename w_t, bool kHasZ, bool kVec, int kP, int kStates>
__global__ void __launch_bounds__(32, FwdLayout<kP>::kMinBlocks) scan_fwd_kernel(const ScanParams p) {
  constexpr bool kTok = kStates == kTokenStates, kRow = kStates == kRowStates;
  using Lay = FwdLayout<kP>;
  constexpr int kS = Lay::kS, kCh = Lay::kCh, kR = Lay::kR;
  // [half of the warp][timestep of the run][state]: a second half only where a warp has 32 channels, used only when
  // its two halves of 16 channels fall in different B/C groups (_group_slices)
  __shared__ __align__(16) float2 bc[Lay::kHalves][kFwdRun][16];   // read as float4 where kP == 1
  __shared__ float4 pre[kFwdRun][kCh];   // [timestep][channel]: {dt, dt u, D u, silu(z)}
  __shared__ float outv[kFwdRun][kCh];   // [timestep][channel]: the output before rounding to in_t
  const int lane = threadIdx.x;
  const int ch = lane / kP, sub = lane % kP;
  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kCh;
  const int d = d0 + ch;
  const int L = p.seqlen;
  const int *pos = p.pos + (int64_t)b * L;
  // this warp's segment of the row (grid z): timesteps [seg_lo, seg_hi), from the run holding seg_lo
  const int seg_lo = segment_bound(pos, blockIdx.z, gridDim.z, L, lane);
  const int seg_hi = segment_bound(pos, blockIdx.z + 1, gridDim.z, L, lane);
  if (seg_lo >= seg_hi) return;   // warp-uniform: an empty segment
  const bool d_ok = d < p.dim;
  const int grp_lo = d0 / p.dim_per_group;
  const int grp_hi = Lay::kHalves == 2 ? min(d0 + 16, p.dim - 1) / p.dim_per_group : grp_lo;
  const bool split = grp_hi != grp_lo;   // warp-uniform
  const int half = split ? (ch >> 4) : 0;

  float A2[kS];
#pragma unroll
  for (int j = 0; j < kS; ++j) {
    const int n = sub + kP * j;
    A2[j] = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] * kLog2e : 0.f;
  }
  const bool has_bias = p.delta_bias != nullptr, has_D = p.D != nullptr;
  const float bias = (d_ok && has_bias) ? p.delta_bias[d] : 0.f;
  const float Dd = (d_ok && has_D) ? p.D[d] : 0.f;

  const int64_t row = (int64_t)b * p.x_bs + (int64_t)(d_ok ? d : 0) * p.x_ds;
  const in_t *u = reinterpret_cast<const in_t *>(p.u) + row;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + row;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + row : nullptr;
  in_t *out = reinterpret_cast<in_t *>(p.out) + row;
  const w_t *Bp = reinterpret_cast<const w_t *>(p.B) + ((int64_t)b * p.n_groups + grp_lo) * p.dstate * L;
  const w_t *Cp = reinterpret_cast<const w_t *>(p.C) + ((int64_t)b * p.n_groups + grp_lo) * p.dstate * L;
  const int64_t hi_off = (int64_t)(grp_hi - grp_lo) * p.dstate * L;
  float *saved = p.saved + ((int64_t)b * p.dim + d) * p.nchunks * kLanes;

  float h[kS];
#pragma unroll
  for (int j = 0; j < kS; ++j) h[j] = 0.f;
  // carried states: this row's slots; thread state k is state index sub + kP k of channel d
  const int *slots_i = kTok ? p.state_slots + (int64_t)b * L : nullptr;
  const int *slots_f = kTok ? p.state_slots + ((int64_t)p.batch + b) * L : nullptr;
  auto state_ok = [&](int k) { return d_ok && sub + kP * k < p.dstate; };
  auto state_off = [&](int slot, int k) { return ((int64_t)slot * p.dim + d) * p.dstate + sub + kP * k; };
  // row-edge states (plain kernel): bit 0 of cont0 keeps the state at the first run's t = 0 (cleared after it)
  unsigned cont0 = 0;
  if (kRow && p.initial_state != nullptr && seg_lo == 0) {
    const int slot = p.row_slots[b];   // warp-uniform
    if (slot >= 0) {
#pragma unroll
      for (int k = 0; k < kS; ++k) h[k] = state_ok(k) ? p.initial_state[state_off(slot, k)] : 0.f;
      cont0 = 1u;
    }
  }

  using In = FwdRunIn<in_t, w_t, kR>;
  auto load = [&](In &r, int t0) {
    const int ts = t0 + sub * kR;   // this lane's share of the channel's run
    load_run<kVec>(r.u, u, ts, L, d_ok);
    load_run<kVec>(r.delta, delta, ts, L, d_ok);
    if constexpr (kHasZ) load_run<kVec>(r.z, z, ts, L, d_ok);
    load_bc<kVec>(r.bc, Bp, Cp, t0, L, lane, p.dstate);
    r.pos = (lane < kFwdRun && t0 + lane < L) ? pos[t0 + lane] : 1;
    if constexpr (kTok) {
      const bool in = lane < kFwdRun && t0 + lane < L;
      r.islot = in ? slots_i[t0 + lane] : -1;
      r.fslot = in ? slots_f[t0 + lane] : -1;
    }
  };
  // one run: stage what `cur` holds, start loading the next run into it, compute this one
  auto run = [&](int t0, In &cur) {
    __syncwarp();   // the last run's reads of bc / pre / outv are done
    put_bc(bc[0], cur.bc, lane);
    if (Lay::kHalves == 2 && split) {    // rare: the second half's group, loaded now
      RunBC<w_t> hi;
      load_bc<kVec>(hi, Bp + hi_off, Cp + hi_off, t0, L, lane, p.dstate);
      put_bc(bc[Lay::kHalves - 1], hi, lane);
    }
    // per (channel, timestep), this lane's kR timesteps: {dt, dt u, D u, silu(z)} into the channel's column of pre
    // (no state needed: fully unrolled)
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      const int j = sub * kR + k;
      const float uv = to_f(cur.u.v[k]);
      float dtv = to_f(cur.delta.v[k]);
      dtv = has_bias ? dtv + bias : dtv;
      dtv = p.softplus ? softplus_(dtv) : dtv;
      dtv = t0 + j < L ? dtv : 0.f;   // past L: the state passes through unchanged
      float zs = 1.f;
      if constexpr (kHasZ) { const float zv = to_f(cur.z.v[k]); zs = zv * sigmoidf_(zv); }
      pre[j][ch] = make_float4(dtv, dtv * uv, __fmul_rn(Dd, uv), zs);
    }
    // bit j: timestep t0 + j starts a sequence (not the row's first token where it continues a row-edge state)
    const unsigned starts = __ballot_sync(0xffffffffu, cur.pos == 0) & ~cont0;
    cont0 = 0;
    // carried states: bit j of inits / finals: timestep t0 + j loads / stores a state (slots kept: cur is reloaded)
    unsigned inits = 0, finals = 0;
    int my_islot = -1, my_fslot = -1;
    if constexpr (kTok) {
      inits = __ballot_sync(0xffffffffu, cur.islot >= 0 && p.initial_state != nullptr);
      finals = __ballot_sync(0xffffffffu, cur.fslot >= 0 && p.final_state != nullptr);
      my_islot = cur.islot;
      my_fslot = cur.fslot;
    }
    __syncwarp();   // bc and pre written
    if (t0 + kFwdRun < seg_hi) load(cur, t0 + kFwdRun);   // cur is consumed: it takes the next run
    // the recurrence over the run's timesteps. With 8 or 16 states a thread the loop stays rolled (unrolled, the
    // compiler would hoist every timestep's exponentials and run out of registers); with 2 or 4 (few channels, where
    // a warp's latency sets the time) it is unrolled, and the sums across the channel's lanes wait for the run's
    // end, so that its 8 timesteps' shuffles overlap instead of each stalling the chain.
    // a run where no timestep loads or stores a state takes the plain loop (kSt false: no per-timestep test)
    auto steps = [&](auto states_tag) {
      constexpr bool kSt = decltype(states_tag)::value;
      constexpr bool kDeferLanes = kP >= 4;
      float yq[kFwdRun];
  #pragma unroll(kDeferLanes ? kFwdRun : 2)
      for (int j = 0; j < kFwdRun; ++j) {
        const float4 pr = pre[j][ch];
        bool keep = !((starts >> j) & 1u);
        if constexpr (kSt) {
          if ((inits >> j) & 1u) {   // warp-uniform: the sequence continues from its initial state
            const int slot = __shfl_sync(0xffffffffu, my_islot, j);
  #pragma unroll
            for (int k = 0; k < kS; ++k) h[k] = state_ok(k) ? p.initial_state[state_off(slot, k)] : 0.f;
            keep = true;
          }
        }
        float c[kS];
        if constexpr (kP == 1) {
          const float4 *bcj = reinterpret_cast<const float4 *>(bc[half][j]);
  #pragma unroll
          for (int k = 0; k < 8; ++k) {
            const float4 v = bcj[k];   // {B, C} of states 2k and 2k + 1
            h[2 * k] = scan_step(pr.x * A2[2 * k], pr.y * v.x, h[2 * k], keep);
            h[2 * k + 1] = scan_step(pr.x * A2[2 * k + 1], pr.y * v.z, h[2 * k + 1], keep);
            c[2 * k] = v.y;
            c[2 * k + 1] = v.w;
          }
        } else {
  #pragma unroll
          for (int k = 0; k < kS; ++k) {
            const float2 v = bc[0][j][sub + kP * k];   // {B, C} of state sub + kP k
            h[k] = scan_step(pr.x * A2[k], pr.y * v.x, h[k], keep);
            c[k] = v.y;
          }
        }
        if constexpr (kSt) {
          if ((finals >> j) & 1u) {   // warp-uniform: the sequence ends here and returns its state
            const int slot = __shfl_sync(0xffffffffu, my_fslot, j);
            if (t0 + j >= seg_lo && t0 + j < seg_hi) {   // by the segment that holds the timestep
  #pragma unroll
              for (int k = 0; k < kS; ++k)
                if (state_ok(k)) p.final_state[state_off(slot, k)] = h[k];
            }
          }
        }
        const float yt = sum_states_thread<kP>(h, c);
        if constexpr (kDeferLanes) {
          yq[j] = yt;
        } else {
          const float y = sum_states_lanes<kP>(yt);
          const float ov = has_D ? __fadd_rn(y, pr.z) : y;   // as the backward recomputes it
          if (sub == 0) outv[j][ch] = kHasZ ? ov * pr.w : ov;
        }
      }
      if constexpr (kDeferLanes) {
  #pragma unroll
        for (int j = 0; j < kFwdRun; ++j) {
          const float4 pr = pre[j][ch];
          const float y = sum_states_lanes<kP>(yq[j]);
          const float ov = has_D ? __fadd_rn(y, pr.z) : y;
          if (sub == 0) outv[j][ch] = kHasZ ? ov * pr.w : ov;
        }
      }
    };
    if constexpr (kTok) {
      if (inits | finals) steps(std::true_type{});   // warp-uniform
      else steps(std::false_type{});
    } else {
      steps(std::false_type{});
    }
    if constexpr (kP > 1) __syncwarp();   // outv written by the channel's first lane
    Run<in_t, kR> o;
#pragma unroll
    for (int k = 0; k < kR; ++k) o.v[k] = from_f<in_t>(outv[sub * kR + k][ch]);
    store_run<kVec>(out, o, t0 + sub * kR, seg_lo, seg_hi, d_ok);
    const int t_end = t0 + kFwdRun, t_last = min(t_end, L) - 1;
    // the state at the end of chunk t0 / 64, by the segment that holds the chunk's last timestep
    if (d_ok && (t_end % kChunk == 0 || t_end >= L) && t_last >= seg_lo && t_last < seg_hi) {
      float *sv = saved + (t0 / kChunk) * kLanes;
      if constexpr (kVec && kP == 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          reinterpret_cast<float4 *>(sv)[k] = make_float4(h[4 * k], h[4 * k + 1], h[4 * k + 2], h[4 * k + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < kS; ++j) sv[sub + kP * j] = h[j];
      }
    }
  };

  // timesteps of the first run before seg_lo belong to the segment before: computed (from a zero state, dropped at
  // seg_lo, a sequence start) but not stored; so are those of the last run from seg_hi on
  const int t_first = seg_lo - seg_lo % kFwdRun;
  In buf;
  load(buf, t_first);
  for (int t0 = t_first; t0 < seg_hi; t0 += kFwdRun) run(t0, buf);
  if (kRow && p.final_state != nullptr && seg_hi == L) {   // the row's final state
    const int slot = p.row_slots[p.batch + b];   // warp-uniform
    if (slot >= 0) {
#pragma unroll
      for (int k = 0; k < kS; ++k)
        if (state_ok(k)) p.final_state[state_off(slot, k)] = h[k];
    }
  }
}

// The backward: a thread carries two states of one channel (n and n + 8), 8 threads a channel, 128 threads the
// block's 16 channels. What a timestep reads ({dt, dt*u}, {dy, u}, one 128-bit
// {B_n, C_n, B_n+8, C_n+8}, the reset mask) and the sums over states (y, and the two sums du and ddelta are made of)
// are shared by two states. dB and dC are summed over the warp's 4 channels with two shuffles per timestep as the
// reverse walk produces them, then over the block's 4 warps in shared memory.
constexpr int kWarps = kThreads / 32;   // 4
template <typename in_t, typename w_t>
struct BwdSmem {
  RawChunk<in_t, w_t, 4> raw;
  float2 dt_dtu[kChunk][kPad];   // {dt, dt*u}; pairs read together: one 64-bit load each
  float2 dy_u[kChunk][kPad];     // {dy, u}
  float sig_m[kChunk][kPad];     // d softplus / d x; column kDB (the padding) holds timestep tt's reset mask
  float gz[kChunk][kPad];        // dz = (y + D u) * gz: dout * sigmoid(z) * (1 + z (1 - sigmoid(z)))
  float zs[kChunk][kPad];        // silu(z), for the recomputed forward output
  float4 BC[kChunk][kLanes / 2]; // {B_n, C_n, B_n+8, C_n+8}
  // [buffer][warp][kind: dB_n, dB_n+8, dC_n, dC_n+8][n][j ^ red_swizzle(kind, n)]: a warp's 32 stores of one
  // timestep and its 32 loads in the block sum each hit 32 different banks
  float red[2][kWarps][4][8][kSub];
  float bias[kDB];      // delta_bias of the block's channels
  int slot_i[kChunk];   // carried states (kTokenStates): the chunk's state_slots, -1 outside the segment
  int slot_f[kChunk];
  unsigned slot_bits[kChunk / 32];   // a ballot of the chunk's slots a warp of timesteps (kTokenStates)
};
// 75 KiB for 16-bit inputs: three blocks (12 warps) an SM
static_assert(sizeof(BwdSmem<__nv_bfloat16, __nv_bfloat16>) + 1024 <= 233472 / 3, "three backward blocks per SM");

__device__ __forceinline__ int red_swizzle(int kind, int n) { return ((kind << 2) | (n >> 1)) & 15; }

// threadIdx.x read anew (volatile: never shared with an earlier read), for values a rare path should derive itself
__device__ __forceinline__ int thread_index_x() {
#if defined(__CUDA_ARCH__)
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#else
  return threadIdx.x;   // the CPU emulation (tests/ops/test_kernel_emulation.py)
#endif
}

// arr[i] for a run-time i, as selects (a run-time index would put the array in local memory)
template <int N>
__device__ __forceinline__ float pick(const float (&arr)[N], int i) {
  float v = arr[0];
#pragma unroll
  for (int k = 1; k < N; ++k) v = k == i ? arr[k] : v;
  return v;
}
template <int N>
__device__ __forceinline__ void put(float (&arr)[N], int i, float v) {
#pragma unroll
  for (int k = 0; k < N; ++k) arr[k] = k == i ? v : arr[k];
}

// kTokenStates: carried states per token (ScanParams::state_slots). The recomputations load h from initial_state
// before a start
// with a slot and keep it (as the forward does); the reverse walk adds the gradient of final_state to the adjoint at
// a sequence's last token with a slot, and at a start with a slot stores the adjoint it would hand to the timestep
// before (the gradient of the initial state) instead of handing it on. Only the 16-step sub-chunks that hold a slot
// (a block-uniform mask made from the slots staged in shared memory) do this, in rolled loops; every other sub-chunk
// runs the plain unrolled code, so the hot code is the plain kernel's. kNoStates: the plain kernel. kRowStates:
// states at row edges (ScanParams::row_slots), the plain kernel with the states outside its loops: the row's first
// chunk recomputed from the initial state (its reset at t = 0 skipped) and the adjoint left after t = 0 stored as its
// gradient; the walk starting from the final state's gradient, which the steps past L hand on unchanged (kept there:
// dt is 0).
template <typename in_t, typename w_t, bool kHasZ, bool kAsync, int kStates>
__global__ void __launch_bounds__(kThreads, 3) scan_bwd_kernel(const ScanParams p) {
  constexpr bool kTok = kStates == kTokenStates, kRow = kStates == kRowStates;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdSmem<in_t, w_t> &sm = *reinterpret_cast<BwdSmem<in_t, w_t> *>(smem_raw);
  auto &raw = sm.raw;
  const int tid = threadIdx.x;
  const int n = tid & 7;        // states n and n + 8
  const int dl = tid >> 3;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kind = lane >> 3;   // which of dB_n, dB_n+8, dC_n, dC_n+8 this lane sums over the warp's channels
  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kDB;
  const int d = d0 + dl;
  const int L = p.seqlen;
  const int *pos = p.pos + (int64_t)b * L;
  // this block's segment of the row (grid z), [seg_lo, seg_hi): its chunks, walked in reverse, see every other
  // timestep as padding (no input, no output, the state and the adjoint dropped), so nothing crosses seg_lo (a
  // sequence start: the adjoint it hands back is dropped anyway) or seg_hi (the next segment's start)
  const int seg_lo = segment_bound(pos, blockIdx.z, gridDim.z, L, lane);
  const int seg_hi = segment_bound(pos, blockIdx.z + 1, gridDim.z, L, lane);
  if (seg_lo >= seg_hi) return;   // block-uniform: an empty segment (its dA / dD / ddelta_bias rows stay zero)
  const int c_lo = seg_lo / kChunk, c_hi = (seg_hi - 1) / kChunk;
  const bool d_ok = d < p.dim;
  const int grp = d0 / p.dim_per_group;
  const float Aa = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] : 0.f;
  const float Ab = (d_ok && n + 8 < p.dstate) ? p.A[(int64_t)d * p.dstate + n + 8] : 0.f;
  const float A2a = Aa * kLog2e, A2b = Ab * kLog2e;
  const float Dd = (d_ok && p.D) ? p.D[d] : 0.f;

  const int64_t row = (int64_t)b * p.x_bs;   // channel d's row: + d * ds
  const int ds = p.x_ds;
  const in_t *u = reinterpret_cast<const in_t *>(p.u) + row;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + row;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + row : nullptr;
  const in_t *dout = reinterpret_cast<const in_t *>(p.dout) + row;
  const int64_t bc_off = ((int64_t)b * p.n_groups + grp) * p.dstate * L;
  const w_t *Bp = reinterpret_cast<const w_t *>(p.B) + bc_off;
  const w_t *Cp = reinterpret_cast<const w_t *>(p.C) + bc_off;
  float *dBp = p.dB + bc_off;
  float *dCp = p.dC + bc_off;
  // deterministic mode: this block's [dB | dC] (2, dstate, L), stored (every element, once), not added
  float *det_slot = p.det_part ? p.det_part + ((int64_t)b * gridDim.x + blockIdx.x) * 2 * p.dstate * L : nullptr;
  in_t *du = reinterpret_cast<in_t *>(p.du) + row;
  in_t *ddelta = reinterpret_cast<in_t *>(p.ddelta) + row;
  in_t *dz = kHasZ ? reinterpret_cast<in_t *>(p.dz) + row : nullptr;
  in_t *out_rec = p.out_rec ? reinterpret_cast<in_t *>(p.out_rec) + row : nullptr;
  const bool want_y = kHasZ || out_rec != nullptr;   // the forward output is recomputed (block-uniform)

  float gca = 0.f, gcb = 0.f;   // adjoints carried from t+1 (already multiplied by a_{t+1})
  // row-edge states (plain kernel; block-uniform): the slots of this row's initial / final state, -1: none
  int edge_i = -1, edge_f = -1;
  if constexpr (kRow) {
    if (seg_lo == 0 && p.initial_state != nullptr) edge_i = p.row_slots[b];
    if (seg_hi == L && p.dfinal_state != nullptr) edge_f = p.row_slots[p.batch + b];
  }
  auto edge_at = [&](int slot) { return ((int64_t)slot * p.dim + d) * p.dstate + n; };
  if (edge_f >= 0) {
    gca = (d_ok && n < p.dstate) ? p.dfinal_state[edge_at(edge_f)] : 0.f;
    gcb = (d_ok && n + 8 < p.dstate) ? p.dfinal_state[edge_at(edge_f) + 8] : 0.f;
  }
  // dA, dD, ddelta_bias: summed per chunk, then over the row's chunks (not one running sum of L terms: as accurate as
  // upstream's block reductions, test_scan_bf16_accuracy_no_worse_than_upstream_one_by_one)
  float dAa_acc = 0.f, dAb_acc = 0.f, dD_acc = 0.f, dbias_acc = 0.f;

  const int rows = p.dim - d0;
  // 16-byte copies (block-uniform): every staged row starts 16-byte aligned
  const bool vec16 = kAsync && L % (16 / sizeof(in_t)) == 0 && L % (16 / sizeof(w_t)) == 0 &&
                     (row | (int64_t)ds) % (16 / sizeof(in_t)) == 0 &&
                     ((reinterpret_cast<uintptr_t>(p.u) | reinterpret_cast<uintptr_t>(p.delta) |
                       reinterpret_cast<uintptr_t>(p.z) | reinterpret_cast<uintptr_t>(p.dout) |
                       reinterpret_cast<uintptr_t>(p.B) | reinterpret_cast<uintptr_t>(p.C)) & 15) == 0;
  auto stage = [&](int t0) {
    stage_rows<kAsync>(raw.in[0], u + (int64_t)d0 * ds, ds, rows, t0, L, tid, vec16);
    stage_rows<kAsync>(raw.in[1], delta + (int64_t)d0 * ds, ds, rows, t0, L, tid, vec16);
    if constexpr (kHasZ) stage_rows<kAsync>(raw.in[2], z + (int64_t)d0 * ds, ds, rows, t0, L, tid, vec16);
    stage_rows<kAsync>(raw.in[3], dout + (int64_t)d0 * ds, ds, rows, t0, L, tid, vec16);
    stage_rows<kAsync>(raw.bc[0], Bp, L, p.dstate, t0, L, tid, vec16);
    stage_rows<kAsync>(raw.bc[1], Cp, L, p.dstate, t0, L, tid, vec16);
    stage_pos<kAsync>(raw.pos, pos, t0, L, tid);
    if constexpr (kAsync) cp_async_commit();
  };
  stage(c_hi * kChunk);
  if (tid < kDB) sm.bias[tid] = p.delta_bias && tid < rows ? p.delta_bias[d0 + tid] : 0.f;   // read after a barrier

  for (int c = c_hi; c >= c_lo; --c) {
    const int t0 = c * kChunk;
    float dAa_chunk = 0.f, dAb_chunk = 0.f, dD_chunk = 0.f, dbias_chunk = 0.f;
    if constexpr (kAsync) cp_async_wait_all();
    __syncthreads();
    // a thread converts timestep tt = tid % 64 of channels tid / 64, + 2, + 4, ... (fixed trip counts, no division)
    static_assert(kThreads % kChunk == 0 && kDB % (kThreads / kChunk) == 0, "whole channels a pass");
    const int cv_tt = tid % kChunk, cv_t = t0 + cv_tt;
    const bool cv_in = cv_t >= seg_lo && cv_t < seg_hi;
#pragma unroll 2
    for (int k = 0; k < kDB * kChunk / kThreads; ++k) {
      const int dd = tid / kChunk + k * (kThreads / kChunk), tt = cv_tt;
      float dtv = 0.f, uv = 0.f, dyv = 0.f, sg = 0.f, gzv = 0.f, zsv = 0.f;
      if (cv_in && dd < rows) {
        uv = to_f(raw.in[0][dd][tt]);
        dtv = to_f(raw.in[1][dd][tt]);
        if (p.delta_bias) dtv += sm.bias[dd];
        if (p.softplus) { sg = sigmoidf_(dtv); dtv = softplus_(dtv); } else { sg = 1.f; }
        const float g = to_f(raw.in[3][dd][tt]);
        if (kHasZ) {
          const float zv = to_f(raw.in[2][dd][tt]);
          const float sz = sigmoidf_(zv);
          dyv = g * zv * sz;
          gzv = g * sz * (1.f + zv * (1.f - sz));
          zsv = zv * sz;
        } else {
          dyv = g;
        }
      }
      sm.dt_dtu[tt][dd] = make_float2(dtv, dtv * uv);
      sm.dy_u[tt][dd] = make_float2(dyv, uv);
      sm.sig_m[tt][dd] = sg;
      if (kHasZ) { sm.gz[tt][dd] = gzv; sm.zs[tt][dd] = zsv; }
    }
#pragma unroll 2
    for (int k = 0; k < kLanes * kChunk / kThreads; ++k) {
      const int nn = tid / kChunk + k * (kThreads / kChunk), tt = cv_tt;
      float bv = 0.f, cv = 0.f;
      if (nn < p.dstate && cv_in) { bv = to_f(raw.bc[0][nn][tt]); cv = to_f(raw.bc[1][nn][tt]); }
      float *slot = reinterpret_cast<float *>(&sm.BC[tt][nn & 7]) + (nn >> 3) * 2;
      slot[0] = bv;
      slot[1] = cv;
    }
    if (tid < kChunk) {   // keep the state: not at a sequence start (unless it starts from a state), nor outside
      const int t = t0 + tid;   // the segment
      const bool in_seg = t >= seg_lo && t < seg_hi;
      int si = -1;
      if constexpr (kTok) {
        si = in_seg && p.initial_state ? p.state_slots[(int64_t)b * L + t] : -1;
        const int sf = in_seg && p.dfinal_state ? p.state_slots[((int64_t)p.batch + b) * L + t] : -1;
        sm.slot_i[tid] = si;
        sm.slot_f[tid] = sf;
        // bit tt of warp w's word: timestep 32 w + tt loads or stores a state (warps 0 and 1 are whole here)
        const unsigned any = __ballot_sync(0xffffffffu, si >= 0 || sf >= 0);
        if (lane == 0) sm.slot_bits[warp] = any;
      }
      float keep = (!in_seg || (raw.pos[tid] == 0 && si < 0)) ? 0.f : 1.f;
      if constexpr (kRow) {   // the row's continued first token; past L, the final state's gradient passes on
        if ((t == 0 && edge_i >= 0) || (t >= L && edge_f >= 0)) keep = 1.f;
      }
      sm.sig_m[tid][kDB] = keep;
    }
    __syncthreads();
    if (c > c_lo) stage(t0 - kChunk);   // overlaps with this chunk's backward
    // carried states: bit s of slot_subs says that sub-chunk s holds a timestep that loads or stores a state
    // (block-uniform: from the ballots of the slots as they were staged). Such a sub-chunk takes a compact rolled
    // path (below); the others, and every sub-chunk of a kernel without states, the unrolled plain code. One copy of
    // the hot code: two unrolled bodies (plain and with states) on one multiprocessor thrashed its instruction cache
    // (ncu, RESULTS.md)
    unsigned slot_subs = 0;
    if constexpr (kTok) {
      static_assert(kChunk == 64 && kSub == 16, "two words of slot bits, two sub-chunks a word");
      const unsigned w0 = sm.slot_bits[0], w1 = sm.slot_bits[1];
      slot_subs = (w0 & 0xffffu ? 1u : 0u) | (w0 >> 16 ? 2u : 0u) | (w1 & 0xffffu ? 4u : 0u) | (w1 >> 16 ? 8u : 0u);
    }
    // the rolled path's index of a thread's state n of slot `slot`, derived there from the thread's index read anew,
    // so that nothing of it is kept live through the plain code (registers)
    struct StateAt { int64_t i; bool a, b; };   // index of state n of the slot; states n / n + 8 exist
    auto state_at = [&](int slot) -> StateAt {
      const int t = thread_index_x(), nn = t & 7, dd = blockIdx.x * kDB + (t >> 3);
      const bool ok = dd < p.dim;
      return {((int64_t)slot * p.dim + dd) * p.dstate + nn, ok && nn < p.dstate, ok && nn + 8 < p.dstate};
    };
    auto state_pair = [&](const float *states, int slot, float &a, float &b) {
      const StateAt at = state_at(slot);
      a = at.a ? states[at.i] : 0.f;
      b = at.b ? states[at.i + 8] : 0.f;
    };

    // states at the start of every sub-chunk
    float hsa[kNSub] = {}, hsb[kNSub] = {};
    {
      float ha = 0.f, hb = 0.f;
      if (c > 0 && d_ok) {
        const float *sv = p.saved + (((int64_t)b * p.dim + d) * p.nchunks + (c - 1)) * kLanes;
        ha = sv[n];
        hb = sv[n + 8];
      } else if (c == 0 && edge_i >= 0 && d_ok) {   // the row's initial state
        ha = n < p.dstate ? p.initial_state[edge_at(edge_i)] : 0.f;
        hb = n + 8 < p.dstate ? p.initial_state[edge_at(edge_i) + 8] : 0.f;
      }
#pragma unroll 1
      for (int s = 0; s < kNSub; ++s) {
        put(hsa, s, ha);
        put(hsb, s, hb);
        float yv[kSub];
        if (kTok && ((slot_subs >> s) & 1u)) {
          // with slots: a sequence start with an initial-state slot continues from that state
          float yl[kSub];
#pragma unroll 1
          for (int j = 0; j < kSub; ++j) {
            const int tt = s * kSub + j;
            const float2 dd = sm.dt_dtu[tt][dl];
            const float4 bc = sm.BC[tt][n];
            const float keep = sm.sig_m[tt][kDB];
            const int si = sm.slot_i[tt];
            if (si >= 0) state_pair(p.initial_state, si, ha, hb);
            ha = scan_step(dd.x * A2a, dd.y * bc.x, ha, keep);
            hb = scan_step(dd.x * A2b, dd.y * bc.z, hb, keep);
            yl[j] = want_y ? __fadd_rn(__fmul_rn(ha, bc.y), __fmul_rn(hb, bc.w)) : 0.f;
          }
#pragma unroll
          for (int j = 0; j < kSub; ++j) yv[j] = yl[j];
        } else {
#pragma unroll
          for (int j = 0; j < kSub; ++j) {
            const int tt = s * kSub + j;
            const float2 dd = sm.dt_dtu[tt][dl];
            const float4 bc = sm.BC[tt][n];
            const float keep = sm.sig_m[tt][kDB];
            ha = scan_step(dd.x * A2a, dd.y * bc.x, ha, keep);
            hb = scan_step(dd.x * A2b, dd.y * bc.z, hb, keep);
            yv[j] = want_y ? __fadd_rn(__fmul_rn(ha, bc.y), __fmul_rn(hb, bc.w)) : 0.f;   // as the forward rounds it
          }
        }
        if (want_y) {
          // dz needs the forward output y + D u in fp32: y = sum_n C h is recomputed here (the same states, the
          // same reduction tree and, with no fused multiply-add, the same rounding as the forward, so out_rec is the
          // forward's output bit for bit) and the forward output need not be kept for the backward
          reduce_scatter8(yv, n);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int tt = s * kSub + 2 * n + r, t = t0 + tt;
            if (d_ok && t >= seg_lo && t < seg_hi) {
              const float o = p.D ? __fadd_rn(yv[r], __fmul_rn(Dd, sm.dy_u[tt][dl].y)) : yv[r];
              if (kHasZ) dz[(int64_t)d * ds + t] = from_f<in_t>(o * sm.gz[tt][dl]);
              if (out_rec) out_rec[(int64_t)d * ds + t] = from_f<in_t>(kHasZ ? o * sm.zs[tt][dl] : o);
            }
          }
        }
      }
    }

#pragma unroll 1
    for (int s = kNSub - 1; s >= 0; --s) {
      const float hsa_s = pick(hsa, s), hsb_s = pick(hsb, s);
      float (*red)[4][8][kSub] = sm.red[s & 1];
      // dB_n, dB_n+8, dC_n, dC_n+8 of timestep j of the sub-chunk, summed over the warp's 4 channels: lane keeps `kind`
      auto reduce_dbc = [&](int j, float ga, float gb, float dtu, float dy, float ha, float hb) {
        const bool hi = lane & 16;
        const float v0 = ga * dtu, v1 = gb * dtu, v2 = dy * ha, v3 = dy * hb;
        const float k0 = (hi ? v2 : v0) + __shfl_xor_sync(0xffffffffu, hi ? v0 : v2, 16);
        const float k1 = (hi ? v3 : v1) + __shfl_xor_sync(0xffffffffu, hi ? v1 : v3, 16);
        const bool hi2 = lane & 8;
        red[warp][kind][n][j ^ red_swizzle(kind, n)] = (hi2 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, hi2 ? k0 : k1, 8);
      };
      // the recomputation's step at timestep tt (scan_step's bits), keeping the decays for the reverse walk
      auto recompute_step = [&](int tt, float &ha, float &hb, float &a_a, float &a_b) {
        const float2 dd = sm.dt_dtu[tt][dl];
        const float4 bc = sm.BC[tt][n];
        const bool keep = sm.sig_m[tt][kDB] != 0.f;
        a_a = exp2f(dd.x * A2a);
        a_b = exp2f(dd.x * A2b);
        const float bxa = dd.y * bc.x, bxb = dd.y * bc.z;
        ha = keep ? fmaf(a_a, ha, bxa) : bxa;
        hb = keep ? fmaf(a_b, hb, bxb) : bxb;
      };
      // the reverse walk's step at timestep j of the sub-chunk, from the adjoints gca / gcb carried from j + 1: the
      // states h (ha, hb) and h[t-1] (hpa, hpb), the decays; its sums over the thread's two states go to gs / gas
      auto reverse_step = [&](int j, float ha, float hb, float hpa, float hpb, float a_a, float a_b, float &gs,
                              float &gas) {
        const int tt = s * kSub + j;
        const float2 dyu = sm.dy_u[tt][dl];
        const float2 dd = sm.dt_dtu[tt][dl];
        const float4 bc = sm.BC[tt][n];
        const bool keep = sm.sig_m[tt][kDB] != 0.f;
        const float ga = fmaf(bc.y, dyu.x, gca), gb = fmaf(bc.w, dyu.x, gcb);
        reduce_dbc(j, ga, gb, dd.y, dyu.x, ha, hb);
        gs = fmaf(ga, bc.x, gb * bc.z);
        // at a reset nothing flows to or from the sequence before: the terms through h[t-1] are dropped, not
        // multiplied by zero (an inf or NaN on either side stays on its side)
        const float ta = ga * a_a, tb = gb * a_b;   // the adjoint handed to t - 1
        const float gaa = keep ? ta * hpa : 0.f;
        const float gab = keep ? tb * hpb : 0.f;
        gas = fmaf(gaa, Aa, gab * Ab);
        dAa_chunk = fmaf(gaa, dd.x, dAa_chunk);
        dAb_chunk = fmaf(gab, dd.x, dAb_chunk);
        gca = keep ? ta : 0.f;
        gcb = keep ? tb : 0.f;
      };
      float gsum[kSub], gasum[kSub];   // per timestep, over this thread's two states: g B, and g h[t-1] a A
      if (kTok && ((slot_subs >> s) & 1u)) {
        // with slots, rolled: the states recomputed as above; the reverse walk adds the gradient of final_state to
        // the adjoint at a sequence's last token with a slot (what comes from t + 1 is 0 there: a start or
        // outside), and at a start with a slot stores the adjoint it would hand back (the gradient of the initial
        // state, whose value is the state before the start) instead of handing it on
        float hva[kSub], hvb[kSub], ava[kSub], avb[kSub], gsl[kSub], gasl[kSub];
        float ha = hsa_s, hb = hsb_s;
#pragma unroll 1
        for (int j = 0; j < kSub; ++j) {
          const int si = sm.slot_i[s * kSub + j];
          if (si >= 0) state_pair(p.initial_state, si, ha, hb);
          recompute_step(s * kSub + j, ha, hb, ava[j], avb[j]);
          hva[j] = ha;
          hvb[j] = hb;
        }
#pragma unroll 1
        for (int j = kSub - 1; j >= 0; --j) {
          const int sf = sm.slot_f[s * kSub + j], si = sm.slot_i[s * kSub + j];
          if (sf >= 0 && p.dfinal_state) {
            float fa, fb;
            state_pair(p.dfinal_state, sf, fa, fb);
            gca += fa;
            gcb += fb;
          }
          float hpa = j > 0 ? hva[j - 1] : hsa_s, hpb = j > 0 ? hvb[j - 1] : hsb_s;
          if (si >= 0) state_pair(p.initial_state, si, hpa, hpb);
          reverse_step(j, hva[j], hvb[j], hpa, hpb, ava[j], avb[j], gsl[j], gasl[j]);
          if (si >= 0) {
            const StateAt at = state_at(si);
            if (at.a && p.dinitial_state) p.dinitial_state[at.i] = gca;
            if (at.b && p.dinitial_state) p.dinitial_state[at.i + 8] = gcb;
            gca = 0.f;
            gcb = 0.f;
          }
        }
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          gsum[j] = gsl[j];
          gasum[j] = gasl[j];
        }
      } else {
        float hva[kSub], hvb[kSub], ava[kSub], avb[kSub];
        {
          float ha = hsa_s, hb = hsb_s;
#pragma unroll
          for (int j = 0; j < kSub; ++j) {
            recompute_step(s * kSub + j, ha, hb, ava[j], avb[j]);
            hva[j] = ha;
            hvb[j] = hb;
          }
        }
#pragma unroll
        for (int j = kSub - 1; j >= 0; --j) {
          const float hpa = j > 0 ? hva[j > 0 ? j - 1 : 0] : hsa_s;
          const float hpb = j > 0 ? hvb[j > 0 ? j - 1 : 0] : hsb_s;
          reverse_step(j, hva[j], hvb[j], hpa, hpb, ava[j], avb[j], gsum[j], gasum[j]);
        }
      }
      // sums over the 16 states: lane n gets timesteps s*16 + 2n and s*16 + 2n + 1
      // du = dt sum_n g B + D dy;  d(delta before softplus) = (u sum_n g B + sum_n g h[t-1] a A) sigmoid
      reduce_scatter8(gsum, n);
      reduce_scatter8(gasum, n);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tt = s * kSub + 2 * n + r, t = t0 + tt;
        const float2 dyu = sm.dy_u[tt][dl];
        const float duf = fmaf(sm.dt_dtu[tt][dl].x, gsum[r], dyu.x * Dd);
        const float ddf = fmaf(dyu.y, gsum[r], gasum[r]) * sm.sig_m[tt][dl];
        if (d_ok && t >= seg_lo && t < seg_hi) {
          const int64_t off = (int64_t)d * ds + t;
          du[off] = from_f<in_t>(duf);
          ddelta[off] = from_f<in_t>(ddf);
          dD_chunk = fmaf(dyu.x, dyu.y, dD_chunk);
          dbias_chunk += ddf;
        }
      }
      __syncthreads();
      // dB, dC over the block's 4 warps: 512 sums (kind, n, j), four a thread, 16 consecutive timesteps a row
      // thread tid sums (kind q, n = tid / 16, timestep j = tid % 16) for the four kinds q (kThreads == 8 * kSub)
      static_assert(kThreads == 8 * kSub, "one (n, j) a thread");
      {
        const int rn = tid / kSub, rj = tid % kSub, t = t0 + s * kSub + rj;
        if (t >= seg_lo && t < seg_hi) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int sj = rj ^ red_swizzle(q, rn), state = rn + 8 * (q & 1);
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) v += red[w][q][rn][sj];
            if (state < p.dstate) {
              if (det_slot) det_slot[((int64_t)(q >> 1) * p.dstate + state) * L + t] = v;
              else atomicAdd((q >> 1 ? dCp : dBp) + (int64_t)state * L + t, v);
            }
          }
        }
      }
    }
    dAa_acc += dAa_chunk;
    dAb_acc += dAb_chunk;
    dD_acc += dD_chunk;
    dbias_acc += dbias_chunk;
  }
  if (edge_i >= 0 && d_ok && p.dinitial_state != nullptr) {   // the adjoint t = 0 hands back: the initial state's
    if (n < p.dstate) p.dinitial_state[edge_at(edge_i)] = gca;
    if (n + 8 < p.dstate) p.dinitial_state[edge_at(edge_i) + 8] = gcb;
  }
  // per (batch row, segment): the caller sums them (no atomics: the same bits every run)
  const int64_t prow = (int64_t)b * gridDim.z + blockIdx.z;
  if (d_ok && n < p.dstate) p.dA[(prow * p.dim + d) * p.dstate + n] = dAa_acc;
  if (d_ok && n + 8 < p.dstate) p.dA[(prow * p.dim + d) * p.dstate + n + 8] = dAb_acc;
#pragma unroll
  for (int o = 4; o >= 1; o >>= 1) {
    dD_acc += __shfl_xor_sync(0xffffffffu, dD_acc, o);
    dbias_acc += __shfl_xor_sync(0xffffffffu, dbias_acc, o);
  }
  if (d_ok && n == 0) {
    if (p.dD) p.dD[prow * p.dim + d] = dD_acc;
    if (p.ddelta_bias) p.ddelta_bias[prow * p.dim + d] = dbias_acc;
  }
}

// cp.async moves 4-byte units: every row it reads must start 4-byte aligned (for 16-bit tensors: seqlen even and the
// tensor's data 4-byte aligned, which a contiguous view at an odd element offset is not); else the kernels stage
// with plain loads (tests/ops/test_kernel_emulation.py: a misaligned cp.async faults the GPU).
template <typename in_t, typename w_t>
bool use_async(const ScanParams &p) {
  auto aligned4 = [](const void *q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 4 == 0; };
  return (sizeof(in_t) == 4 || (p.seqlen % 2 == 0 && p.x_bs % 2 == 0 && p.x_ds % 2 == 0)) &&
         (sizeof(w_t) == 4 || p.seqlen % 2 == 0) && aligned4(p.u) &&
         aligned4(p.delta) && aligned4(p.z) && aligned4(p.dout) && aligned4(p.B) && aligned4(p.C) && aligned4(p.pos);
}

// the forward's 16-byte loads and stores: every row of u / delta / z / out and of B / C, and saved, starts 16-byte
// aligned
template <typename in_t, typename w_t>
bool fwd_vectorized(const ScanParams &p) {
  auto aligned = [](const void *q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return (int64_t)p.seqlen * sizeof(in_t) % 16 == 0 && (int64_t)p.seqlen * sizeof(w_t) % 16 == 0 &&
         p.x_bs * (int64_t)sizeof(in_t) % 16 == 0 && p.x_ds * (int64_t)sizeof(in_t) % 16 == 0 && aligned(p.u) &&
         aligned(p.delta) && aligned(p.z) && aligned(p.out) && aligned(p.B) && aligned(p.C) && aligned(p.saved);
}

template <typename in_t, typename w_t, int kP>
void fwd_launch_lanes(const ScanParams &p, cudaStream_t st) {
  constexpr int kCh = FwdLayout<kP>::kCh;
  const dim3 grid((p.dim + kCh - 1) / kCh, p.batch, max(1, p.fwd_segments));
  bool_switch(p.z != nullptr, [&](auto has_z) {
    constexpr bool kZ = decltype(has_z)::value;
    bool_switch(fwd_vectorized<in_t, w_t>(p), [&](auto vec) {
      constexpr bool kV = decltype(vec)::value;
      states_switch(p, [&](auto states) {
        constexpr int kSt = decltype(states)::value;
        if constexpr (kSt != kRowStates || kZ) {
          auto kernel = scan_fwd_kernel<in_t, w_t, kZ, kV, kP, kSt>;
          kernel<<<grid, 32, 0, st>>>(p);
        }
      });
    });
  });
}

template <typename in_t, typename w_t>
void fwd_launch(const ScanParams &p, cudaStream_t st) {
  switch (p.fwd_lanes ? p.fwd_lanes : scan_fwd_lanes(p.batch, p.dim, p.fwd_segments, p.sm_count)) {
    case 1: fwd_launch_lanes<in_t, w_t, 1>(p, st); break;
    case 2: fwd_launch_lanes<in_t, w_t, 2>(p, st); break;
    case 4: fwd_launch_lanes<in_t, w_t, 4>(p, st); break;
    default: fwd_launch_lanes<in_t, w_t, 8>(p, st); break;
  }
}

template <typename in_t, typename w_t>
void bwd_launch(const ScanParams &p, cudaStream_t st) {
  const dim3 grid((p.dim + kDB - 1) / kDB, p.batch, max(1, p.bwd_segments));
  const int smem = sizeof(BwdSmem<in_t, w_t>);
  bool_switch(p.z != nullptr, [&](auto has_z) {
    constexpr bool kZ = decltype(has_z)::value;
    bool_switch(use_async<in_t, w_t>(p), [&](auto async) {
      constexpr bool kA = decltype(async)::value;
      states_switch(p, [&](auto states) {
        constexpr int kSt = decltype(states)::value;
        if constexpr (kSt != kRowStates || kZ) {
          auto kernel = scan_bwd_kernel<in_t, w_t, kZ, kA, kSt>;
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
          kernel<<<grid, kThreads, smem, st>>>(p);
        }
      });
    });
  });
}

// u / delta / z in one dtype; B / C in that dtype or float32
}  // namespace

// The forward takes the fewest threads a channel (the least work repeated per (channel, timestep)) that still give
// each multiprocessor SCAN_FWD_WARPS_PER_SM warps: fewer, and a warp's chain of timesteps sets the time (see
// scan_fwd_kernel; measured in RESULTS.md). A row cut into segments counts as at most two rows: a row of one long
// sequence leaves all but its first segment empty, and with the lanes chosen for that many full rows its warps would
// crawl (bench_scan_segments.py, RESULTS.md: with two, packed rows run within 13 % of their best layout on average,
// rows of one sequence 15 % slower than without segments).
int scan_fwd_lanes(int batch, int dim, int segments, int sm_count) {
  const int64_t rows = (int64_t)batch * min(max(segments, 1), 2);
  for (int lanes = 1; lanes < 8; lanes *= 2)
    if (rows * ((dim + 32 / lanes - 1) / (32 / lanes)) >= (int64_t)kScanFwdWarpsPerSM * sm_count) return lanes;
  return 8;
}

void scan_fwd_launch(const ScanParams &p, cudaStream_t st) {
  dtype_switch(p.in_dtype, [&](auto tag) {
    using in_t = decltype(tag);
    if (p.w_f32) fwd_launch<in_t, float>(p, st);
    else fwd_launch<in_t, in_t>(p, st);
  });
}

void scan_bwd_launch(const ScanParams &p, cudaStream_t st) {
  dtype_switch(p.in_dtype, [&](auto tag) {
    using in_t = decltype(tag);
    if (p.w_f32) bwd_launch<in_t, float>(p, st);
    else bwd_launch<in_t, in_t>(p, st);
  });
}

}  // namespace packloader_ops
