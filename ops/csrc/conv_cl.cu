// Packed causal conv1d, channel-last kernels (x is (batch, seqlen, dim) memory): each thread owns consecutive
// channels (one vector load per timestep) and a run of timesteps, sliding a window of the last W inputs (forward)
// or the last W gradients (backward) through registers; position_ids[t] is one broadcast load per timestep. On rows
// aligned to the vectors the loads of a few timesteps are issued together (see kGroupClFwd / kGroupClBwd).
#include "conv_common.cuh"
#include "dispatch.cuh"

namespace packloader_ops {
namespace conv {
namespace {
// channel-last

constexpr int kBXCL = 32, kBYCL = 4;   // 32 threads over channels x 4 over time
// Each thread runs over kRunCl* consecutive timesteps of its channels; on vector-aligned rows it issues the loads of
// kGroupCl* timesteps before using the first. Measured on the H200 (B=8, D=4096, L=4096 bf16, fwd / fwd+bwd ms):
// runs of 32 and groups of 8 in both passes 0.231 / 0.764; forward runs of 64: 0.205 / 0.727 (128: 0.193 forward, but
// 1.4x slower at 2 x 2048 x 4096 for want of blocks); and backward runs of 64 in groups of 4: 0.203 / 0.619
// (causal-conv1d 0.164 / 0.676). Groups of 16, the next group's loads issued before this one's are used, or 8-byte
// loads: all slower (RESULTS.md).
constexpr int kRunClFwd = 64;
constexpr int kGroupClFwd = 8;
constexpr int kRunClBwd = 64;
constexpr int kGroupClBwd = 4;
static_assert(kBYCL * kRunClBwd >= PACKLOADER_CONV_SLOT_STEPS, "one dweight slot per block row of timesteps");

template <typename T>
struct ClVec { static constexpr int kFwd = 16 / sizeof(T) > 8 ? 8 : 16 / sizeof(T); static constexpr int kBwd = 4; };

// the weights and bias of channels d0 .. d0 + kV - 1 (clamped to the last channel: lanes past it are never stored)
template <int kW, int kV>
__device__ __forceinline__ void load_channel_params(const ConvParams &p, int d0, float (&w)[kW][kV], float (&bias)[kV]) {
#pragma unroll
  for (int c = 0; c < kV; ++c) {
    const int d = min(d0 + c, p.dim - 1);
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k][c] = p.weight[d * kW + k];
    bias[c] = p.bias ? p.bias[d] : 0.f;
  }
}

// (At most 128 registers, 4 blocks an SM: the grouped loads need ~170 otherwise, 2 blocks an SM. Measured on the
// H200 at B=8, D=4096, L=4096 bf16: 0.231 against 0.288 ms, despite ~90 bytes of spills for 16-bit types.)
template <typename T, int kW>
__global__ void __launch_bounds__(kBXCL * kBYCL, 4) conv_fwd_cl(const ConvParams p) {
  constexpr int kV = ClVec<T>::kFwd;
  const int b = blockIdx.z;
  const int L = p.seqlen;
  const int d0 = (blockIdx.x * kBXCL + threadIdx.x) * kV;
  const int t0 = (blockIdx.y * kBYCL + threadIdx.y) * kRunClFwd;
  if (d0 >= p.dim || t0 >= L) return;
  const int nv = min(kV, p.dim - d0);
  const T *x = reinterpret_cast<const T *>(p.x) + b * p.x_bs + d0;
  T *out = reinterpret_cast<T *>(p.out) + b * p.x_bs + d0;
  const int *pos = p.pos + (int64_t)b * L;
  float w[kW][kV], bias[kV];
  load_channel_params<kW, kV>(p, d0, w, bias);
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
  const int tend = min(t0 + kRunClFwd, L);
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
    // groups of kGroupClFwd timesteps, every load of a group issued before the first is used
#pragma unroll 1
    for (int tg = t0; tg < tend; tg += kGroupClFwd) {
      GVec<T, kV> raw[kGroupClFwd];
      int rr[kGroupClFwd];
#pragma unroll
      for (int i = 0; i < kGroupClFwd; ++i) {
        const int t = tg + i;
        raw[i].load(x + (int64_t)t * p.x_ls, t < tend ? kV : 0);
        rr[i] = t < tend ? pos[t] : 0;
      }
#pragma unroll
      for (int i = 0; i < kGroupClFwd; ++i) {
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

// silu is a compile-time switch (as a run-time flag the kernel took 2.5 % longer; RESULTS.md, eleventh session)
template <typename T, int kW, bool kSilu>
__global__ void __launch_bounds__(kBXCL * kBYCL) conv_bwd_cl(const ConvParams p) {
  constexpr int kV = ClVec<T>::kBwd;
  __shared__ float s_red[kBYCL][kBXCL * kV][kW + 1];
  const int b = blockIdx.z;
  const int L = p.seqlen;
  const int d0 = (blockIdx.x * kBXCL + threadIdx.x) * kV;
  const int t0 = (blockIdx.y * kBYCL + threadIdx.y) * kRunClBwd;
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
    load_channel_params<kW, kV>(p, d0, w, bias);
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
    const int tend = min(t0 + kRunClBwd, L);
    const int tlast = min(t0 + kRunClBwd + kW - 1, L + kW - 1);
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
        if constexpr (kSilu) {
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
      // groups of kGroupClBwd timesteps, every load of a group issued before the first is used
#pragma unroll 1
      for (int tg = t0; tg < tlast; tg += kGroupClBwd) {
        GVec<T, kV> rx[kGroupClBwd], rg[kGroupClBwd];
        int rp[kGroupClBwd];
#pragma unroll
        for (int i = 0; i < kGroupClBwd; ++i) {
          const int t = tg + i;
          const int in = t < L && t < tlast ? kV : 0;
          rx[i].load(x + (int64_t)t * p.x_ls, in);
          rg[i].load(dout + (int64_t)t * p.g_ls, in);
          rp[i] = in ? pos[t] : 0;
        }
#pragma unroll
        for (int i = 0; i < kGroupClBwd; ++i) {
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
    p.dw_part[((int64_t)dw_slot() * p.dim + d) * (kW + 1) + k] = s;
  }
}

// ------------------------------------------------------------------------------------------------------------
// launch
}  // namespace

template <typename T, int kW>
int launch_cl(const ConvParams &p, cudaStream_t st, bool bwd) {
  const int kV = bwd ? ClVec<T>::kBwd : ClVec<T>::kFwd;
  const int run = bwd ? kRunClBwd : kRunClFwd;
  const dim3 grid((p.dim + kBXCL * kV - 1) / (kBXCL * kV), (p.seqlen + kBYCL * run - 1) / (kBYCL * run), p.batch);
  const dim3 block(kBXCL, kBYCL);
  // whole vectors of kV channels at aligned addresses: the grouped loads
  const int vb = kV * (int)sizeof(T);
  auto al = [vb](const void *ptr) { return reinterpret_cast<uintptr_t>(ptr) % vb == 0; };
  ConvParams q = p;
  q.cl_vec = p.dim % kV == 0 && al(p.x) && (p.x_ls * sizeof(T)) % vb == 0 && (p.x_bs * sizeof(T)) % vb == 0 &&
             (bwd ? al(p.dout) && al(p.dx) && (p.g_ls * sizeof(T)) % vb == 0 && (p.g_bs * sizeof(T)) % vb == 0
                  : al(p.out));
  if (!bwd) conv_fwd_cl<T, kW><<<grid, block, 0, st>>>(q);
  else if (p.silu) conv_bwd_cl<T, kW, true><<<grid, block, 0, st>>>(q);
  else conv_bwd_cl<T, kW, false><<<grid, block, 0, st>>>(q);
  return bwd ? (int)(grid.y * grid.z) : 0;
}

#define INSTANTIATE(T, W) template int launch_cl<T, W>(const ConvParams &, cudaStream_t, bool);
PACKLOADER_CONV_FOR_EACH_TYPE_WIDTH(INSTANTIATE)
#undef INSTANTIATE

}  // namespace conv
}  // namespace packloader_ops
