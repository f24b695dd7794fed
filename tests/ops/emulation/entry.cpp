// Entry points of the emulated kernels (cuda_host.h), called through ctypes by tests/ops/test_kernel_emulation.py:
// the parameters ops/csrc/binding.cpp fills, then the real launchers.
#include "cuda_host.h"
#include "ops_common.h"
#include "dtype_utils.cuh"

using namespace packloader_ops;

// The scan forward's threads a channel (ScanParams::fwd_lanes; 0: chosen by scan_fwd_lanes for an H200's 132
// multiprocessors), so that the tests run every layout at small sizes
static int emu_fwd_lanes = 0;
extern "C" void emu_set_fwd_lanes(int lanes) { emu_fwd_lanes = lanes; }
// the scans' (batch, dim) strides of every (batch, dim, seqlen) tensor (ScanParams::x_bs / x_ds); 0: contiguous
static int64_t emu_scan_x_bs = 0, emu_scan_x_ds = 0;
extern "C" void emu_set_scan_layout(int64_t x_bs, int64_t x_ds) { emu_scan_x_bs = x_bs; emu_scan_x_ds = x_ds; }
extern "C" int emu_scan_fwd_lanes(int batch, int dim, int segments, int sm_count) {
  return scan_fwd_lanes(batch, dim, segments, sm_count);
}

extern "C" int emu_fault_count() { return emu_faults.exchange(0); }
extern "C" const char *emu_first_fault() { return emu_fault_text; }

static ScanParams scan_params(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                              int softplus, const void *u, const void *delta, const float *A, const void *B,
                              const void *C, const float *D, const void *z, const float *delta_bias, const int *pos,
                              float *saved) {
  ScanParams p{};
  p.batch = batch; p.dim = dim; p.seqlen = seqlen; p.dstate = dstate; p.n_groups = n_groups;
  p.sm_count = 132;
  p.fwd_lanes = emu_fwd_lanes;
  p.dim_per_group = dim / n_groups; p.nchunks = (seqlen + kScanChunk - 1) / kScanChunk; p.softplus = softplus;
  p.in_dtype = in_dtype; p.w_f32 = w_f32;
  p.x_bs = emu_scan_x_bs ? emu_scan_x_bs : (int64_t)dim * seqlen;   // emu_set_scan_layout; else contiguous
  p.x_ds = emu_scan_x_ds ? (int)emu_scan_x_ds : seqlen;
  p.u = u; p.delta = delta; p.B = B; p.C = C; p.z = z; p.A = A; p.D = D; p.delta_bias = delta_bias; p.pos = pos;
  p.saved = saved;
  return p;
}

extern "C" void emu_scan_fwd(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                             int softplus, const void *u, const void *delta, const float *A, const void *B,
                             const void *C, const float *D, const void *z, const float *delta_bias, const int *pos,
                             void *out, float *saved, int segments, int lanes, const int *state_slots,
                             const float *initial_state, float *final_state, const int *row_slots) {
  ScanParams p = scan_params(in_dtype, w_f32, batch, dim, seqlen, dstate, n_groups, softplus, u, delta, A, B, C, D,
                             z, delta_bias, pos, saved);
  p.fwd_segments = segments;
  if (lanes) p.fwd_lanes = lanes;
  p.out = out;
  p.state_slots = state_slots; p.initial_state = initial_state; p.final_state = final_state;
  p.row_slots = row_slots;
  scan_fwd_launch(p, nullptr);
}

// deterministic mode when det_part (scan_bwd's shape) is given; segments as binding.cpp's scan_fwd / scan_bwd take
// them (a row cut at sequence starts into that many segments, run side by side)
extern "C" void emu_scan_bwd(int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate, int n_groups,
                             int softplus, const void *u, const void *delta, const float *A, const void *B,
                             const void *C, const float *D, const void *z, const float *delta_bias, const int *pos,
                             float *saved, const void *dout, void *out_rec, void *du, void *ddelta, void *dz,
                             float *dA, float *dB, float *dC, float *dD, float *ddelta_bias, float *det_part,
                             int segments, const int *state_slots, const float *initial_state,
                             const float *dfinal_state, float *dinitial_state, const int *row_slots) {
  ScanParams p = scan_params(in_dtype, w_f32, batch, dim, seqlen, dstate, n_groups, softplus, u, delta, A, B, C, D,
                             z, delta_bias, pos, saved);
  p.dout = dout; p.out_rec = out_rec; p.du = du; p.ddelta = ddelta; p.dz = dz;
  p.dA = dA; p.dB = dB; p.dC = dC; p.dD = dD; p.ddelta_bias = ddelta_bias;
  p.det_part = det_part;
  p.bwd_segments = segments;   // dA / dD / ddelta_bias: batch * segments rows
  p.state_slots = state_slots; p.initial_state = initial_state; p.dfinal_state = dfinal_state;
  p.dinitial_state = dinitial_state;
  p.row_slots = row_slots;
  scan_bwd_launch(p, nullptr);
}

// x_strides / g_strides: (batch, dim, seqlen) strides in elements; runmask: (batch, conv_mask_stride(seqlen)) int16
// for channel-first x (binding.cpp's conv_runmask_for), else null: the caller's words when runmask_given, else scratch
static ConvParams conv_params(int dtype, int batch, int dim, int seqlen, int width, int silu, const void *x,
                              const int64_t *xs, const float *weight, const float *bias, const int *pos,
                              uint16_t *runmask, int runmask_given) {
  ConvParams p{};
  p.batch = batch; p.dim = dim; p.seqlen = seqlen; p.width = width; p.silu = silu; p.dtype = dtype;
  p.x_bs = xs[0]; p.x_cs = xs[1]; p.x_ls = xs[2];
  p.channel_last = xs[1] == 1 && dim > 1;
  p.x = x; p.weight = weight; p.bias = bias; p.pos = pos; p.runmask = runmask; p.runmask_given = runmask_given;
  return p;
}

extern "C" void emu_conv_runmask(const int *pos, uint16_t *mask, int batch, int seqlen) {
  conv_runmask_launch(pos, mask, batch, seqlen, nullptr);
}

extern "C" void emu_conv_fwd(int dtype, int batch, int dim, int seqlen, int width, int silu, const void *x,
                             const int64_t *xs, const float *weight, const float *bias, const int *pos,
                             uint16_t *runmask, int runmask_given, void *out) {
  ConvParams p = conv_params(dtype, batch, dim, seqlen, width, silu, x, xs, weight, bias, pos, runmask, runmask_given);
  p.out = out;
  conv_fwd_launch(p, nullptr);
}

extern "C" int emu_conv_bwd(int dtype, int batch, int dim, int seqlen, int width, int silu, const void *x,
                            const int64_t *xs, const float *weight, const float *bias, const int *pos,
                            uint16_t *runmask, int runmask_given, const void *dout, const int64_t *gs, void *dx,
                            float *dw_part, float *dweight, float *dbias) {
  ConvParams p = conv_params(dtype, batch, dim, seqlen, width, silu, x, xs, weight, bias, pos, runmask, runmask_given);
  p.g_bs = gs[0]; p.g_cs = gs[1]; p.g_ls = gs[2];
  p.dout = dout; p.dx = dx; p.dw_part = dw_part; p.dweight = dweight; p.dbias = dbias;
  return conv_bwd_launch(p, nullptr);
}

// the conv's carried states (conv_states.cu): bwd 0 runs the forward (out fixed up in place, final_state written),
// 1 the backward (out is dout: read, then zeroed; dx_head, dw_part, dinitial_state (may be null) written)
extern "C" void emu_conv_states(int bwd, int dtype, int batch, int dim, int seqlen, int width, int slots, int silu,
                                const void *x, const int64_t *xs, void *out, const int64_t *os, const float *weight,
                                const float *bias, const int64_t *start, const int64_t *length, const bool *has,
                                const void *initial_state, void *final_state, float *dx_head, float *dw_part,
                                float *dinitial_state) {
  ConvStateParams p{};
  p.batch = batch; p.dim = dim; p.seqlen = seqlen; p.width = width; p.slots = slots; p.silu = silu; p.dtype = dtype;
  p.x_bs = xs[0]; p.x_cs = xs[1]; p.x_ls = xs[2];
  p.o_bs = os[0]; p.o_cs = os[1]; p.o_ls = os[2];
  p.x = x; p.weight = weight; p.bias = bias; p.start = start; p.length = length; p.has = has;
  p.initial_state = initial_state; p.out = out; p.final_state = final_state;
  p.dx_head = dx_head; p.dw_part = dw_part; p.dinitial_state = dinitial_state;
  if (bwd) conv_states_bwd_launch(p, nullptr);
  else conv_states_fwd_launch(p, nullptr);
}

// reductions over token segments (segment_sums.cu): strides in elements, (batch, dim) for delta / x / z, (batch,
// dstate) for bc; z null (forward, or no gate); parts > 1 with scratch (parts, segments, dim, dstate) / (parts,
// segments, dim)
extern "C" void emu_segment_sums(int forward, int in_dtype, int w_f32, int batch, int dim, int seqlen, int dstate,
                                 int segments, int softplus, const void *delta, const int64_t *ds, const void *x,
                                 const int64_t *xs, const void *z, const int64_t *zs, const void *bc,
                                 const int64_t *bcs, const float *A, const float *delta_bias, const int64_t *start,
                                 const int64_t *length, float *sums, float *dt_sums, int parts, float *part_sums,
                                 float *part_dt) {
  SegmentSumsParams p{};
  p.batch = batch; p.dim = dim; p.seqlen = seqlen; p.dstate = dstate; p.segments = segments;
  p.forward = forward; p.softplus = softplus; p.in_dtype = in_dtype; p.w_f32 = w_f32;
  p.delta_bs = ds[0]; p.delta_ds = ds[1]; p.x_bs = xs[0]; p.x_ds = xs[1]; p.z_bs = zs[0]; p.z_ds = zs[1];
  p.bc_bs = bcs[0]; p.bc_ns = bcs[1];
  p.delta = delta; p.x = x; p.z = z; p.bc = bc; p.A = A; p.delta_bias = delta_bias;
  p.start = start; p.length = length; p.sums = sums; p.dt_sums = dt_sums;
  p.parts = parts; p.part_sums = part_sums; p.part_dt = part_dt;
  segment_sums_launch(p, nullptr);
}

extern "C" int emu_segment_sums_parts(int segments, int dim, int max_length, int sm_count) {
  return segment_sums_parts(segments, dim, max_length, sm_count);
}

// the kernels' softplus (dtype_utils.cuh), element by element
extern "C" void emu_softplus(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = softplus_(x[i]);
}
