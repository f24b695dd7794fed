// Packed selective scan (Mamba-1), forward and backward, with a state reset where position_ids == 0.
//
// Layout: a thread block owns 16 channels of one batch row. In the backward, each channel's dstate (padded to 16)
// state lanes are 16 consecutive threads, so every thread carries ONE scalar state h[b, d, n] sequentially
// through time; the forward gives each thread two states (n and n + 8) of one channel, 8 threads a channel.  Timesteps are staged in shared memory 64 at a time (u, delta after softplus, dt*u, masks,
// B and C shared by the block's 16 channels).  Per timestep a thread does one exp2 and a few FMAs; the sum
// over the 16 states (y = sum_n C h) is done every 16 timesteps with a butterfly reduce-scatter across the
// 16 lanes, so lane n ends up owning timestep 16*s + n and writes it.
// Reset: where pos_t == 0 the update is h_t = delta_t B_t u_t, a select that drops the carried state instead of
// multiplying it by zero, and in backward the adjoint handed from t to t-1 and the terms through h_{t-1} are
// dropped the same way: not even an inf or NaN (0 * inf is NaN) crosses a boundary, forward or backward, nor the
// chunk carry (the saved chunk-end states feed the same select).
// Backward recomputes states per 64-step chunk from the forward's saved chunk-end states, keeping the state at
// each 16-step sub-chunk start in registers, then re-running each sub-chunk (16 states + 16 decays in
// registers) and walking it in reverse.  dB/dC are summed over the block's channels in shared memory and added
// to fp32 buffers with one atomic per (block, n, t) (deterministic mode: ordered adds, see det_sem); dA, dD, ddelta_bias are reduced per thread/lane group and
// stored per batch row (the caller sums the rows: no atomics, the same bits every run).
#include "dispatch.cuh"

#include "ops_common.h"
#include "dtype_utils.cuh"
#include "cp_async.cuh"

namespace packloader_ops {

namespace {

constexpr int kLanes = kScanLanes;      // 16
constexpr int kDB = PACKLOADER_SCAN_BLOCK_CHANNELS;   // channels per block (16)
constexpr int kThreads = kLanes * kDB;  // 256
constexpr int kSub = 16;                // timesteps per reduce-scatter group (== kLanes)
constexpr int kChunk = kScanChunk;      // 64
constexpr int kNSub = kChunk / kSub;    // 4
static_assert(kNSub == 4, "sub-chunk start selection below assumes 4 sub-chunks");
constexpr int kPad = kDB + 1;           // padded row length (bank conflicts)
constexpr float kLog2e = 1.4426950408889634f;

// v[j] (j = 0..15) in each of 16 lanes -> v[0] of lane l holds sum over the 16 lanes of v[l].
__device__ __forceinline__ void reduce_scatter16(float (&v)[16], int lane16) {
  {
    const bool hi = lane16 & 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float send = hi ? v[j] : v[j + 8];
      float keep = hi ? v[j + 8] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
  }
  {
    const bool hi = lane16 & 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float send = hi ? v[j] : v[j + 4];
      float keep = hi ? v[j + 4] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    }
  }
  {
    const bool hi = lane16 & 2;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float send = hi ? v[j] : v[j + 2];
      float keep = hi ? v[j + 2] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
  }
  {
    const bool hi = lane16 & 1;
    float send = hi ? v[0] : v[1];
    float keep = hi ? v[1] : v[0];
    v[0] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
  }
}

__device__ __forceinline__ float softplus_(float x) { return x <= 20.f ? log1pf(__expf(x)) : x; }

// One step of the recurrence, h <- exp2(dA2) h + bx, or h <- bx at a sequence start (keep == 0): a select that drops
// the carried state (not a multiply by zero: an inf or NaN state stays in its sequence). The decay is computed either
// way, so the select needs no branch. The forward and both backward recomputations call this: the same bits.
__device__ __forceinline__ float scan_step(float dA2, float bx, float h, float keep) {
  const float carried = fmaf(exp2f(dA2), h, bx);
  return keep != 0.f ? carried : bx;
}

// ---- raw staging: the next chunk's inputs are copied into shared memory with cp.async (cp_async.cuh; 4-byte units,
// zero-filled past the end) while the current chunk computes; a conversion pass then turns them into the fp32 arrays.
template <typename in_t, typename w_t, int kNIn>
struct RawChunk {
  in_t in[kNIn][kDB][kChunk];   // forward: u, delta, z; backward: u, delta, z, dout
  w_t bc[2][kLanes][kChunk];    // B, C
  int pos[kChunk];
};

// rows r < 16 of a (rows, L) matrix with row stride `stride`, timesteps t0..t0+63, into dst[r][0..63].
// kAsync: cp.async in 4-byte units (needs 4-byte aligned rows: L even for 16-bit types); else plain loads.
template <bool kAsync, int kNThreads = kThreads, typename T>
__device__ __forceinline__ void stage_rows(T (*dst)[kChunk], const T *src, int64_t stride, int rows, int t0, int L,
                                           int tid) {
  if constexpr (kAsync) {
    constexpr int kEpu = 4 / sizeof(T);
    constexpr int kUpr = kChunk / kEpu;
    for (int i = tid; i < 16 * kUpr; i += kNThreads) {
      const int r = i / kUpr, tu = (i % kUpr) * kEpu, t = t0 + tu;
      const bool ok = r < rows && t < L;
      cp_async4(&dst[r][tu], ok ? (const void *)(src + r * stride + t) : (const void *)src,
                ok ? (int)(min(kEpu, L - t) * sizeof(T)) : 0);
    }
  } else {
    for (int i = tid; i < 16 * kChunk; i += kNThreads) {
      const int r = i / kChunk, tt = i % kChunk, t = t0 + tt;
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
// The same tree as the last three levels of reduce_scatter16 (the forward's first level is inside each thread).
__device__ __forceinline__ void reduce_scatter8(float (&v)[16], int lane8) {
  {
    const bool hi = lane8 & 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float send = hi ? v[j] : v[j + 8];
      const float keep = hi ? v[j + 8] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    }
  }
  {
    const bool hi = lane8 & 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float send = hi ? v[j] : v[j + 4];
      const float keep = hi ? v[j + 4] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
  }
  {
    const bool hi = lane8 & 1;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float send = hi ? v[j] : v[j + 2];
      const float keep = hi ? v[j + 2] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    }
  }
}

// The forward: a thread carries TWO states of one channel (n and n + 8), so what a timestep reads ({dt, dt*u}, one
// 128-bit {B_n, C_n, B_n+8, C_n+8}, the reset mask) and the sum over states are shared by two states; a block is
// the 16 channels of the backward, with half its threads.
constexpr int kFwdThreads = kThreads / 2;   // 128
struct FwdSmem {
  float2 dt_dtu[kChunk][kPad];
  float skip[kChunk][kPad];
  float zs[kChunk][kPad];
  float4 BC[kChunk][kLanes / 2];   // {B_n, C_n, B_n+8, C_n+8}
  float m[kChunk];
};

template <typename in_t, typename w_t, bool kHasZ, bool kAsync>
__global__ void __launch_bounds__(kFwdThreads, 4) scan_fwd_kernel(const ScanParams p) {
  __shared__ FwdSmem sm;
  __shared__ __align__(16) RawChunk<in_t, w_t, 3> raw;
  const int tid = threadIdx.x;
  const int n = tid & 7;    // states n and n + 8
  const int dl = tid >> 3;
  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kDB;
  const int d = d0 + dl;
  const int L = p.seqlen;
  const bool d_ok = d < p.dim;
  const int grp = d0 / p.dim_per_group;
  const float A2a = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] * kLog2e : 0.f;
  const float A2b = (d_ok && n + 8 < p.dstate) ? p.A[(int64_t)d * p.dstate + n + 8] * kLog2e : 0.f;

  const in_t *u = reinterpret_cast<const in_t *>(p.u) + ((int64_t)b * p.dim) * L;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + ((int64_t)b * p.dim) * L;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + ((int64_t)b * p.dim) * L : nullptr;
  const w_t *Bp = reinterpret_cast<const w_t *>(p.B) + ((int64_t)b * p.n_groups + grp) * p.dstate * L;
  const w_t *Cp = reinterpret_cast<const w_t *>(p.C) + ((int64_t)b * p.n_groups + grp) * p.dstate * L;
  const int *pos = p.pos + (int64_t)b * L;
  in_t *out = reinterpret_cast<in_t *>(p.out) + ((int64_t)b * p.dim) * L;

  const int rows = p.dim - d0;
  auto stage = [&](int t0) {
    stage_rows<kAsync, kFwdThreads>(raw.in[0], u + (int64_t)d0 * L, L, rows, t0, L, tid);
    stage_rows<kAsync, kFwdThreads>(raw.in[1], delta + (int64_t)d0 * L, L, rows, t0, L, tid);
    if constexpr (kHasZ) stage_rows<kAsync, kFwdThreads>(raw.in[2], z + (int64_t)d0 * L, L, rows, t0, L, tid);
    stage_rows<kAsync, kFwdThreads>(raw.bc[0], Bp, L, p.dstate, t0, L, tid);
    stage_rows<kAsync, kFwdThreads>(raw.bc[1], Cp, L, p.dstate, t0, L, tid);
    stage_pos<kAsync>(raw.pos, pos, t0, L, tid);
    if constexpr (kAsync) cp_async_commit();
  };
  stage(0);

  float ha = 0.f, hb = 0.f;
  for (int c = 0; c < p.nchunks; ++c) {
    const int t0 = c * kChunk;
    if constexpr (kAsync) cp_async_wait_all();
    __syncthreads();
    for (int i = tid; i < kDB * kChunk; i += kFwdThreads) {
      const int dd = i / kChunk, tt = i % kChunk, dg = d0 + dd, t = t0 + tt;
      float dtv = 0.f, uv = 0.f, zs = 0.f, skip = 0.f;
      if (dg < p.dim && t < L) {
        uv = to_f(raw.in[0][dd][tt]);
        dtv = to_f(raw.in[1][dd][tt]);
        if (p.delta_bias) dtv += p.delta_bias[dg];
        if (p.softplus) dtv = softplus_(dtv);
        if (p.D) skip = __fmul_rn(p.D[dg], uv);
        if (kHasZ) { const float zv = to_f(raw.in[2][dd][tt]); zs = zv * sigmoidf_(zv); }
      }
      sm.dt_dtu[tt][dd] = make_float2(dtv, dtv * uv);
      sm.skip[tt][dd] = skip;
      if (kHasZ) sm.zs[tt][dd] = zs;
    }
    for (int i = tid; i < kLanes * kChunk; i += kFwdThreads) {
      const int nn = i / kChunk, tt = i % kChunk, t = t0 + tt;
      float bv = 0.f, cv = 0.f;
      if (nn < p.dstate && t < L) { bv = to_f(raw.bc[0][nn][tt]); cv = to_f(raw.bc[1][nn][tt]); }
      float *slot = reinterpret_cast<float *>(&sm.BC[tt][nn & 7]) + (nn >> 3) * 2;
      slot[0] = bv;
      slot[1] = cv;
    }
    if (tid < kChunk) sm.m[tid] = (t0 + tid < L && raw.pos[tid] == 0) ? 0.f : 1.f;
    __syncthreads();
    if (c + 1 < p.nchunks) stage(t0 + kChunk);   // overlaps with this chunk's scan

#pragma unroll 1
    for (int s = 0; s < kNSub; ++s) {
      float yv[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int tt = s * kSub + j;
        const float2 dd = sm.dt_dtu[tt][dl];
        const float4 bc = sm.BC[tt][n];
        const float keep = sm.m[tt];
        ha = scan_step(dd.x * A2a, dd.y * bc.x, ha, keep);
        hb = scan_step(dd.x * A2b, dd.y * bc.z, hb, keep);
        // no fused multiply-add: the backward recomputes y = sum_n C h with these exact roundings
        yv[j] = __fadd_rn(__fmul_rn(ha, bc.y), __fmul_rn(hb, bc.w));
      }
      reduce_scatter8(yv, n);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tt = s * kSub + 2 * n + r, t = t0 + tt;
        if (d_ok && t < L) {
          const float o = p.D ? __fadd_rn(yv[r], sm.skip[tt][dl]) : yv[r];   // as the backward recomputes it
          out[(int64_t)d * L + t] = from_f<in_t>(kHasZ ? o * sm.zs[tt][dl] : o);
        }
      }
    }
    if (d_ok) {
      float *sv = p.saved + (((int64_t)b * p.dim + d) * p.nchunks + c) * kLanes;
      sv[n] = ha;
      sv[n + 8] = hb;
    }
  }
}

template <typename in_t, typename w_t>
struct BwdSmem {
  RawChunk<in_t, w_t, 4> raw;
  float2 dt_dtu[kChunk][kPad];   // {dt, dt*u}; pairs read together: one 64-bit load each
  float2 dy_u[kChunk][kPad];     // {dy, u}
  float sig[kChunk][kPad];   // d softplus / d x
  float gz[kChunk][kPad];    // dz = (y + D u) * gz: dout * sigmoid(z) * (1 + z (1 - sigmoid(z)))
  float zs[kChunk][kPad];    // silu(z), for the recomputed forward output
  float2 BC[kChunk][kPad];
  float m[kChunk];
  float red[2][2][kThreads / 32][kLanes][kSub + 1];   // [buffer][dB|dC][warp][n][j]
  float chunk_dbc[2][kLanes][kChunk];                 // deterministic mode: the chunk's dB / dC block sums
};

template <typename in_t, typename w_t, bool kHasZ, bool kAsync>
__global__ void __launch_bounds__(kThreads, 2) scan_bwd_kernel(const ScanParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdSmem<in_t, w_t> &sm = *reinterpret_cast<BwdSmem<in_t, w_t> *>(smem_raw);
  auto &raw = sm.raw;
  const int tid = threadIdx.x;
  const int n = tid & 15;
  const int dl = tid >> 4;
  const int warp = tid >> 5;
  const int half = dl & 1;   // which of the warp's two channels
  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kDB;
  const int d = d0 + dl;
  const int L = p.seqlen;
  const bool d_ok = d < p.dim;
  const int grp = d0 / p.dim_per_group;
  const float Anat = (d_ok && n < p.dstate) ? p.A[(int64_t)d * p.dstate + n] : 0.f;
  const float A2 = Anat * kLog2e;
  const float Dd = (d_ok && p.D) ? p.D[d] : 0.f;

  const int64_t row = ((int64_t)b * p.dim) * L;
  const in_t *u = reinterpret_cast<const in_t *>(p.u) + row;
  const in_t *delta = reinterpret_cast<const in_t *>(p.delta) + row;
  const in_t *z = kHasZ ? reinterpret_cast<const in_t *>(p.z) + row : nullptr;
  const in_t *dout = reinterpret_cast<const in_t *>(p.dout) + row;
  const int64_t bc_off = ((int64_t)b * p.n_groups + grp) * p.dstate * L;
  const w_t *Bp = reinterpret_cast<const w_t *>(p.B) + bc_off;
  const w_t *Cp = reinterpret_cast<const w_t *>(p.C) + bc_off;
  float *dBp = p.dB + bc_off;
  float *dCp = p.dC + bc_off;
  const int *pos = p.pos + (int64_t)b * L;
  in_t *du = reinterpret_cast<in_t *>(p.du) + row;
  in_t *ddelta = reinterpret_cast<in_t *>(p.ddelta) + row;
  in_t *dz = kHasZ ? reinterpret_cast<in_t *>(p.dz) + row : nullptr;
  in_t *out_rec = p.out_rec ? reinterpret_cast<in_t *>(p.out_rec) + row : nullptr;
  const bool want_y = kHasZ || out_rec != nullptr;   // the forward output is recomputed (block-uniform)

  float gc = 0.f;        // adjoint carried from t+1 (already multiplied by a_{t+1})
  // dA, dD, ddelta_bias: summed per chunk, then over the row's chunks (not one running sum of L terms: as accurate as
  // upstream's block reductions, test_scan_bf16_accuracy_no_worse_than_upstream_one_by_one)
  float dA_acc = 0.f, dD_acc = 0.f, dbias_acc = 0.f;

  const int rows = p.dim - d0;
  auto stage = [&](int t0) {
    stage_rows<kAsync>(raw.in[0], u + (int64_t)d0 * L, L, rows, t0, L, tid);
    stage_rows<kAsync>(raw.in[1], delta + (int64_t)d0 * L, L, rows, t0, L, tid);
    if constexpr (kHasZ) stage_rows<kAsync>(raw.in[2], z + (int64_t)d0 * L, L, rows, t0, L, tid);
    stage_rows<kAsync>(raw.in[3], dout + (int64_t)d0 * L, L, rows, t0, L, tid);
    stage_rows<kAsync>(raw.bc[0], Bp, L, p.dstate, t0, L, tid);
    stage_rows<kAsync>(raw.bc[1], Cp, L, p.dstate, t0, L, tid);
    stage_pos<kAsync>(raw.pos, pos, t0, L, tid);
    if constexpr (kAsync) cp_async_commit();
  };
  stage((p.nchunks - 1) * kChunk);

  for (int c = p.nchunks - 1; c >= 0; --c) {
    const int t0 = c * kChunk;
    float dA_chunk = 0.f, dD_chunk = 0.f, dbias_chunk = 0.f;
    if constexpr (kAsync) cp_async_wait_all();
    __syncthreads();
    for (int i = tid; i < kDB * kChunk; i += kThreads) {
      const int dd = i / kChunk, tt = i % kChunk, dg = d0 + dd, t = t0 + tt;
      float dtv = 0.f, uv = 0.f, dyv = 0.f, sg = 0.f, gzv = 0.f, zsv = 0.f;
      if (dg < p.dim && t < L) {
        uv = to_f(raw.in[0][dd][tt]);
        dtv = to_f(raw.in[1][dd][tt]);
        if (p.delta_bias) dtv += p.delta_bias[dg];
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
      sm.sig[tt][dd] = sg;
      if (kHasZ) { sm.gz[tt][dd] = gzv; sm.zs[tt][dd] = zsv; }
    }
    for (int i = tid; i < kLanes * kChunk; i += kThreads) {
      const int nn = i / kChunk, tt = i % kChunk, t = t0 + tt;
      float bv = 0.f, cv = 0.f;
      if (nn < p.dstate && t < L) { bv = to_f(raw.bc[0][nn][tt]); cv = to_f(raw.bc[1][nn][tt]); }
      sm.BC[tt][nn] = make_float2(bv, cv);
    }
    if (tid < kChunk) sm.m[tid] = (t0 + tid < L && raw.pos[tid] == 0) ? 0.f : 1.f;
    __syncthreads();
    if (c > 0) stage(t0 - kChunk);   // overlaps with this chunk's backward

    // states at the start of every sub-chunk
    float hs[kNSub];
    {
      float h = (c > 0 && d_ok) ? p.saved[(((int64_t)b * p.dim + d) * p.nchunks + (c - 1)) * kLanes + n] : 0.f;
#pragma unroll 1
      for (int s = 0; s < kNSub; ++s) {
        hs[s] = h;
        float yv[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          const int tt = s * kSub + j;
          h = scan_step(sm.dt_dtu[tt][dl].x * A2, sm.dt_dtu[tt][dl].y * sm.BC[tt][n].x, h, sm.m[tt]);
          yv[j] = want_y ? __fmul_rn(h, sm.BC[tt][n].y) : 0.f;   // as the forward rounds it
        }
        if (want_y) {
          // dz needs the forward output y + D u in fp32: y = sum_n C h is recomputed here (the same states, the
          // same reduction and, with no fused multiply-add, the same rounding as the forward, so out_rec is the
          // forward's output bit for bit) and the forward output need not be kept for the backward
          reduce_scatter16(yv, n);
          const int tt = s * kSub + n, t = t0 + tt;
          if (d_ok && t < L) {
            const float o = p.D ? __fadd_rn(yv[0], __fmul_rn(Dd, sm.dy_u[tt][dl].y)) : yv[0];
            if (kHasZ) dz[(int64_t)d * L + t] = from_f<in_t>(o * sm.gz[tt][dl]);
            if (out_rec) out_rec[(int64_t)d * L + t] = from_f<in_t>(kHasZ ? o * sm.zs[tt][dl] : o);
          }
        }
      }
    }

#pragma unroll 1
    for (int s = kNSub - 1; s >= 0; --s) {
      float hv[kSub], av[kSub];
      // select instead of a run-time register-array index
      const float hstart = s == 0 ? hs[0] : s == 1 ? hs[1] : s == 2 ? hs[2] : hs[3];
      {
        float h = hstart;
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          const int tt = s * kSub + j;
          av[j] = exp2f(sm.dt_dtu[tt][dl].x * A2);
          const float bx = sm.dt_dtu[tt][dl].y * sm.BC[tt][n].x;
          h = sm.m[tt] != 0.f ? fmaf(av[j], h, bx) : bx;
          hv[j] = h;
        }
      }
      float dBv[kSub], dCv[kSub], duv[kSub], ddv[kSub];
#pragma unroll
      for (int j = kSub - 1; j >= 0; --j) {
        const int tt = s * kSub + j;
        const float dyv = sm.dy_u[tt][dl].x;
        const float Bn = sm.BC[tt][n].x;
        const float dtv = sm.dt_dtu[tt][dl].x;
        const float g = fmaf(sm.BC[tt][n].y, dyv, gc);
        const float hprev = j > 0 ? hv[j > 0 ? j - 1 : 0] : hstart;
        dCv[j] = dyv * hv[j];
        dBv[j] = g * sm.dt_dtu[tt][dl].y;
        duv[j] = g * dtv * Bn;
        // at a reset nothing flows to or from the sequence before: the terms through h[t-1] are dropped, not
        // multiplied by zero (an inf or NaN on either side stays on its side)
        const bool keep = sm.m[tt] != 0.f;
        const float ga = keep ? g * hprev * av[j] : 0.f;
        ddv[j] = fmaf(ga, Anat, g * Bn * sm.dy_u[tt][dl].y);
        dA_chunk = fmaf(ga, dtv, dA_chunk);
        gc = keep ? g * av[j] : 0.f;
      }
      // sums over the 16 states: lane n gets timestep s*16+n
      reduce_scatter16(duv, n);
      reduce_scatter16(ddv, n);
      {
        const int tt = s * kSub + n, t = t0 + tt;
        const float dyv = sm.dy_u[tt][dl].x;
        const float duf = fmaf(dyv, Dd, duv[0]);
        const float ddf = ddv[0] * sm.sig[tt][dl];
        if (d_ok && t < L) {
          const int64_t off = (int64_t)d * L + t;
          du[off] = from_f<in_t>(duf);
          ddelta[off] = from_f<in_t>(ddf);
          dD_chunk = fmaf(dyv, sm.dy_u[tt][dl].y, dD_chunk);
          dbias_chunk += ddf;
        }
      }
      // dB, dC: sum the warp's two channels (reduce-scatter over the half-warp pair), then over the 8 warps
      float (*red)[kThreads / 32][kLanes][kSub + 1] = sm.red[s & 1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float sB = half ? dBv[j] : dBv[j + 8];
        const float kB = half ? dBv[j + 8] : dBv[j];
        const float sC = half ? dCv[j] : dCv[j + 8];
        const float kC = half ? dCv[j + 8] : dCv[j];
        red[0][warp][n][half * 8 + j] = kB + __shfl_xor_sync(0xffffffffu, sB, 16);
        red[1][warp][n][half * 8 + j] = kC + __shfl_xor_sync(0xffffffffu, sC, 16);
      }
      __syncthreads();
      {
        const int rn = tid >> 4, rj = tid & 15, t = t0 + s * kSub + rj;
        float sb = 0.f, sc = 0.f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) { sb += red[0][w][rn][rj]; sc += red[1][w][rn][rj]; }
        if (p.det_sem) {
          sm.chunk_dbc[0][rn][s * kSub + rj] = sb;
          sm.chunk_dbc[1][rn][s * kSub + rj] = sc;
        } else if (rn < p.dstate && t < L) {
          atomicAdd(dBp + (int64_t)rn * L + t, sb);
          atomicAdd(dCp + (int64_t)rn * L + t, sc);
        }
      }
    }
    dA_acc += dA_chunk;
    dD_acc += dD_chunk;
    dbias_acc += dbias_chunk;
    if (p.det_sem) {
      // Deterministic mode: the blocks of a batch row add their sums for this chunk in the order of blockIdx.x, each
      // after the one before it (a ticket per (row, chunk)). Blocks start in index order, so the one waited for is
      // already running or done. Plain adds through L2 (__ldcg / __stcg), published by a fence before the ticket.
      int *ticket = p.det_sem + (int64_t)b * p.nchunks + c;
      __syncthreads();
      if (tid == 0) {
        while (atomicAdd(ticket, 0) != (int)blockIdx.x) {
        }
        __threadfence();
      }
      __syncthreads();
      for (int i = tid; i < kLanes * kChunk; i += kThreads) {
        const int rn = i / kChunk, tt = i % kChunk, t = t0 + tt;
        if (rn < p.dstate && t < L) {
          float *pb = dBp + (int64_t)rn * L + t, *pc = dCp + (int64_t)rn * L + t;
          __stcg(pb, __ldcg(pb) + sm.chunk_dbc[0][rn][tt]);
          __stcg(pc, __ldcg(pc) + sm.chunk_dbc[1][rn][tt]);
        }
      }
      __threadfence();
      __syncthreads();
      if (tid == 0) atomicAdd(ticket, 1);
    }
  }
  // per batch row: the caller sums the rows (no atomics: the same bits every run)
  if (d_ok && n < p.dstate) p.dA[((int64_t)b * p.dim + d) * p.dstate + n] = dA_acc;
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) {
    dD_acc += __shfl_xor_sync(0xffffffffu, dD_acc, o);
    dbias_acc += __shfl_xor_sync(0xffffffffu, dbias_acc, o);
  }
  if (d_ok && n == 0) {
    if (p.dD) p.dD[(int64_t)b * p.dim + d] = dD_acc;
    if (p.ddelta_bias) p.ddelta_bias[(int64_t)b * p.dim + d] = dbias_acc;
  }
}

// cp.async moves 4-byte units: rows of 16-bit tensors must start 4-byte aligned (seqlen even); the rare odd
// seqlen stages with plain loads instead.
template <typename in_t, typename w_t>
bool use_async(const ScanParams &p) {
  return (sizeof(in_t) == 4 || p.seqlen % 2 == 0) && (sizeof(w_t) == 4 || p.seqlen % 2 == 0);
}

template <typename in_t, typename w_t>
void fwd_launch(const ScanParams &p, cudaStream_t st) {
  const dim3 grid((p.dim + kDB - 1) / kDB, p.batch);
  bool_switch(p.z != nullptr, [&](auto has_z) {
    bool_switch(use_async<in_t, w_t>(p), [&](auto async) {
      scan_fwd_kernel<in_t, w_t, decltype(has_z)::value, decltype(async)::value><<<grid, kFwdThreads, 0, st>>>(p);
    });
  });
}

template <typename in_t, typename w_t>
void bwd_launch(const ScanParams &p, cudaStream_t st) {
  const dim3 grid((p.dim + kDB - 1) / kDB, p.batch);
  const int smem = sizeof(BwdSmem<in_t, w_t>);
  bool_switch(p.z != nullptr, [&](auto has_z) {
    bool_switch(use_async<in_t, w_t>(p), [&](auto async) {
      auto kernel = scan_bwd_kernel<in_t, w_t, decltype(has_z)::value, decltype(async)::value>;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      kernel<<<grid, kThreads, smem, st>>>(p);
    });
  });
}

// u / delta / z in one dtype; B / C in that dtype or float32
}  // namespace

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
