// Thin torch binding: fills the parameter structs from tensors prepared (contiguous, right dtypes, outputs
// allocated) by ops/_cuda.py and launches on the current stream.
#include <limits>
#include <optional>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops_common.h"

namespace po = packloader_ops;
using torch::Tensor;
using OptT = std::optional<Tensor>;

static int dtype_code(const Tensor &t) {
  if (t.scalar_type() == torch::kFloat32) return po::kF32;
  if (t.scalar_type() == torch::kFloat16) return po::kF16;
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "packloader ops: unsupported dtype ", t.scalar_type());
  return po::kBF16;
}

template <typename T>
static T *ptr_or_null(const OptT &t) {
  return t.has_value() ? reinterpret_cast<T *>(t->data_ptr()) : nullptr;
}

// u's layout, which every (batch, dim, seqlen) tensor of a scan shares (ScanParams::x_bs / x_ds): time unit-strided,
// the strides equal wherever a size is above 1 (ops/_cuda.py lays them out alike)
static void check_scan_layout(const Tensor &u, std::initializer_list<const Tensor *> ts) {
  TORCH_CHECK(u.dim() == 3 && (u.size(2) <= 1 || u.stride(2) == 1), "scan: u must be (batch, dim, seqlen) with a "
              "unit time stride, got strides ", u.strides());
  for (const Tensor *t : ts) {
    bool same = t->sizes() == u.sizes();
    for (int i = 0; same && i < 3; ++i) same = u.size(i) <= 1 || t->stride(i) == u.stride(i);
    TORCH_CHECK(same, "scan: every (batch, dim, seqlen) tensor must have u's shape and strides ", u.strides(),
                ", got shape ", t->sizes(), " strides ", t->strides());
  }
}

static po::ScanParams scan_params(const Tensor &u, const Tensor &delta, const Tensor &A, const Tensor &B,
                                  const Tensor &C, const OptT &D, const OptT &z, const OptT &delta_bias,
                                  const Tensor &pos, bool softplus, int64_t nchunks) {
  po::ScanParams p{};
  p.batch = u.size(0);
  p.dim = u.size(1);
  p.seqlen = u.size(2);
  p.dstate = A.size(1);
  p.n_groups = B.size(1);
  p.dim_per_group = p.dim / p.n_groups;
  p.nchunks = nchunks;
  p.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  p.softplus = softplus;
  p.in_dtype = dtype_code(u);
  p.w_f32 = B.scalar_type() == torch::kFloat32;
  TORCH_CHECK(u.stride(1) <= std::numeric_limits<int>::max(), "scan: u's channel stride must be below 2^31");
  p.x_bs = u.stride(0);
  p.x_ds = (int)u.stride(1);
  p.u = u.data_ptr();
  p.delta = delta.data_ptr();
  p.B = B.data_ptr();
  p.C = C.data_ptr();
  p.z = ptr_or_null<void>(z);
  p.A = A.data_ptr<float>();
  p.D = ptr_or_null<const float>(D);
  p.delta_bias = ptr_or_null<const float>(delta_bias);
  p.pos = pos.data_ptr<int>();
  return p;
}

// carried states (ops/contract.py): state_slots (2, batch, seqlen) int32, or (2, batch) for states at row edges
// only, initial_state / final_state (slots, dim, dstate) float32 contiguous; all absent for the plain scan. Sets
// p.state_slots or p.row_slots.
static void check_states(po::ScanParams &p, const Tensor &u, const Tensor &A, const OptT &slots,
                         std::initializer_list<const OptT *> st) {
  p.state_slots = nullptr;
  p.row_slots = nullptr;
  if (!slots.has_value()) {
    for (const OptT *t : st) TORCH_CHECK(!t->has_value(), "scan: states given without state_slots");
    return;
  }
  const bool rows = slots->dim() == 2;
  TORCH_CHECK(slots->scalar_type() == at::kInt && slots->is_contiguous() && slots->device() == u.device() &&
                  (rows ? slots->sizes() == at::IntArrayRef({2, u.size(0)})
                        : slots->sizes() == at::IntArrayRef({2, u.size(0), u.size(2)})),
              "scan: state_slots must be int32 (2, batch, seqlen) or (2, batch), contiguous, on u's device");
  (rows ? p.row_slots : p.state_slots) = slots->data_ptr<int>();
  for (const OptT *t : st)
    if (t->has_value())
      TORCH_CHECK((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() && (*t)->device() == u.device() &&
                      (*t)->dim() == 3 && (*t)->size(1) == u.size(1) && (*t)->size(2) == A.size(1),
                  "scan: states must be float32 (slots, dim, dstate), contiguous, on u's device");
}

void scan_fwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, OptT D, OptT z, OptT delta_bias, Tensor pos,
              bool softplus, Tensor out, Tensor saved, int64_t segments, int64_t lanes, OptT state_slots,
              OptT initial_state, OptT final_state) {
  c10::cuda::CUDAGuard guard(u.device());
  TORCH_CHECK(segments >= 1 && segments <= 65535, "scan_fwd: segments must be in [1, 65535], got ", segments);
  TORCH_CHECK(lanes == 0 || lanes == 1 || lanes == 2 || lanes == 4 || lanes == 8,
              "scan_fwd: lanes must be 0 (chosen), 1, 2, 4 or 8, got ", lanes);
  po::ScanParams p = scan_params(u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved.size(2));
  p.fwd_segments = segments;
  p.fwd_lanes = lanes;
  if (z.has_value()) check_scan_layout(u, {&delta, &*z, &out});
  else check_scan_layout(u, {&delta, &out});
  p.out = out.data_ptr();
  p.saved = saved.data_ptr<float>();
  check_states(p, u, A, state_slots, {&initial_state, &final_state});
  TORCH_CHECK(p.row_slots == nullptr || z.has_value(), "scan_fwd: row-edge state_slots (2, batch) need z");
  p.initial_state = ptr_or_null<const float>(initial_state);
  p.final_state = ptr_or_null<float>(final_state);
  po::scan_fwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scan_bwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, OptT D, OptT z, OptT delta_bias, Tensor pos,
              bool softplus, Tensor saved, Tensor dout, OptT out_rec, Tensor du, Tensor ddelta, OptT dz, Tensor dA,
              Tensor dB, Tensor dC, OptT dD, OptT ddelta_bias, OptT det_part, int64_t segments, OptT state_slots,
              OptT initial_state, OptT dfinal_state, OptT dinitial_state) {
  c10::cuda::CUDAGuard guard(u.device());
  TORCH_CHECK(segments >= 1 && segments <= 65535 && dA.size(0) == u.size(0) * segments &&
                  (!dD.has_value() || dD->size(0) == dA.size(0)) &&
                  (!ddelta_bias.has_value() || ddelta_bias->size(0) == dA.size(0)),
              "scan_bwd: dA / dD / ddelta_bias need batch * segments rows (segments = ", segments, ")");
  po::ScanParams p = scan_params(u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved.size(2));
  p.bwd_segments = segments;
  {
    std::vector<const Tensor *> ts{&delta, &dout, &du, &ddelta};
    for (const OptT *t : {&z, &out_rec, &dz})
      if (t->has_value()) ts.push_back(&**t);
    for (const Tensor *t : ts) check_scan_layout(u, {t});
  }
  p.saved = saved.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.out_rec = ptr_or_null<void>(out_rec);
  p.du = du.data_ptr();
  p.ddelta = ddelta.data_ptr();
  p.dz = ptr_or_null<void>(dz);
  p.dA = dA.data_ptr<float>();
  p.dB = dB.data_ptr<float>();
  p.dC = dC.data_ptr<float>();
  p.dD = ptr_or_null<float>(dD);
  p.ddelta_bias = ptr_or_null<float>(ddelta_bias);
  // deterministic mode: [dB | dC] per channel block, (batch, blocks, 2, dstate, seqlen) float32, written in full
  if (det_part.has_value()) {
    const int64_t blocks = (u.size(1) + PACKLOADER_SCAN_BLOCK_CHANNELS - 1) / PACKLOADER_SCAN_BLOCK_CHANNELS;
    TORCH_CHECK(det_part->scalar_type() == at::kFloat && det_part->is_contiguous() && det_part->device() == u.device() &&
                    det_part->sizes() == at::IntArrayRef({u.size(0), blocks, 2, B.size(2), u.size(2)}),
                "scan_bwd: det_part must be float32 (batch, blocks, 2, dstate, seqlen), contiguous, on u's device");
  }
  p.det_part = ptr_or_null<float>(det_part);
  check_states(p, u, A, state_slots, {&initial_state, &dfinal_state, &dinitial_state});
  TORCH_CHECK(p.row_slots == nullptr || z.has_value(), "scan_bwd: row-edge state_slots (2, batch) need z");
  TORCH_CHECK(initial_state.has_value() == dinitial_state.has_value(),
              "scan_bwd: dinitial_state must be given exactly when initial_state is");
  p.initial_state = ptr_or_null<const float>(initial_state);
  p.dfinal_state = ptr_or_null<const float>(dfinal_state);
  p.dinitial_state = ptr_or_null<float>(dinitial_state);
  po::scan_bwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

static po::ConvParams conv_params(const Tensor &x, const Tensor &weight, const OptT &bias, const Tensor &pos,
                                  bool silu) {
  po::ConvParams p{};
  p.batch = x.size(0);
  p.dim = x.size(1);
  p.seqlen = x.size(2);
  p.width = weight.size(1);
  p.silu = silu;
  p.dtype = dtype_code(x);
  p.x_bs = x.stride(0);
  p.x_cs = x.stride(1);
  p.x_ls = x.stride(2);
  p.channel_last = x.stride(1) == 1 && x.size(1) > 1;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr<float>();
  p.bias = ptr_or_null<const float>(bias);
  p.pos = pos.data_ptr<int>();
  return p;
}

// the channel-first kernels' boundary words: the caller's (packloader::conv_runmask of these position_ids), else
// scratch the launch fills (none for channel-last x, whose kernels read position_ids directly)
static Tensor conv_runmask_for(const Tensor &x, const OptT &given, po::ConvParams &p) {
  const bool channel_last = x.stride(1) == 1 && x.size(1) > 1;
  const int64_t stride = po::conv_mask_stride((int)x.size(2));
  if (given && !channel_last) {
    TORCH_CHECK(given->scalar_type() == at::kShort && given->is_contiguous() && given->device() == x.device() &&
                    given->dim() == 2 && given->size(0) == x.size(0) && given->size(1) == stride,
                "runmask must be packloader::conv_runmask(position_ids): int16 (", x.size(0), ", ", stride,
                ") contiguous on x's device, got ", given->sizes());
    p.runmask = reinterpret_cast<uint16_t *>(given->data_ptr());
    p.runmask_given = true;
    return *given;
  }
  Tensor scratch = at::empty({channel_last ? 0 : x.size(0), stride}, x.options().dtype(at::kShort));
  p.runmask = scratch.numel() ? reinterpret_cast<uint16_t *>(scratch.data_ptr()) : nullptr;
  p.runmask_given = false;
  return scratch;
}

Tensor conv_runmask(Tensor pos) {
  c10::cuda::CUDAGuard guard(pos.device());
  TORCH_CHECK(pos.scalar_type() == at::kInt && pos.is_contiguous() && pos.dim() == 2,
              "position_ids must be int32 (batch, seqlen) contiguous");
  Tensor mask = at::empty({pos.size(0), (int64_t)po::conv_mask_stride((int)pos.size(1))}, pos.options().dtype(at::kShort));
  po::conv_runmask_launch(pos.data_ptr<int>(), reinterpret_cast<uint16_t *>(mask.data_ptr()), (int)pos.size(0),
                          (int)pos.size(1), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mask;
}

void conv_fwd(Tensor x, Tensor weight, OptT bias, Tensor pos, bool silu, Tensor out, OptT runmask) {
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(out.strides() == x.strides(), "out must have x's layout");
  po::ConvParams p = conv_params(x, weight, bias, pos, silu);
  Tensor mask = conv_runmask_for(x, runmask, p);
  p.out = out.data_ptr();
  po::conv_fwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t conv_bwd(Tensor x, Tensor weight, OptT bias, Tensor pos, bool silu, Tensor dout, Tensor dx, Tensor dw_part,
                 Tensor dweight, OptT dbias, OptT runmask) {
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(dx.strides() == x.strides(), "dx must have x's layout");
  po::ConvParams p = conv_params(x, weight, bias, pos, silu);
  Tensor mask = conv_runmask_for(x, runmask, p);
  p.g_bs = dout.stride(0);
  p.g_cs = dout.stride(1);
  p.g_ls = dout.stride(2);
  p.dout = dout.data_ptr();
  p.dx = dx.data_ptr();
  p.dw_part = dw_part.data_ptr<float>();
  TORCH_CHECK(dweight.scalar_type() == at::kFloat && dweight.is_contiguous() && dweight.numel() == x.size(1) * weight.size(1),
              "dweight: float32 (dim, width), contiguous");
  TORCH_CHECK(bias.has_value() == dbias.has_value(), "dbias is given exactly when bias is");
  if (dbias) TORCH_CHECK(dbias->scalar_type() == at::kFloat && dbias->is_contiguous() && dbias->numel() == x.size(1),
                         "dbias: float32 (dim,), contiguous");
  p.dweight = dweight.data_ptr<float>();
  p.dbias = ptr_or_null<float>(dbias);
  const int slots = po::conv_bwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return slots;
}

// the conv's carried states (conv_states.cu): S sequences' flat spans start / length (S,) int64, has (S,) bool,
// initial_state (S, dim, width - 1) in x's dtype, contiguous; out (forward) / dout (backward) with any strides
static po::ConvStateParams conv_state_params(const Tensor &out, const Tensor &x, const Tensor &weight,
                                             const OptT &bias, bool silu, const Tensor &initial_state,
                                             const Tensor &start, const Tensor &length, const Tensor &has) {
  const int64_t S = start.size(0);
  TORCH_CHECK(S <= 65535, "conv_states: at most 65535 sequences, got ", S);
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "conv_states: out must be x's shape and dtype");
  TORCH_CHECK(start.scalar_type() == at::kLong && length.scalar_type() == at::kLong && has.scalar_type() == at::kBool &&
                  start.is_contiguous() && length.is_contiguous() && has.is_contiguous() && length.size(0) == S &&
                  has.size(0) == S,
              "conv_states: start, length (S,) int64 and has (S,) bool, contiguous");
  TORCH_CHECK(initial_state.scalar_type() == x.scalar_type() && initial_state.is_contiguous() &&
                  initial_state.sizes() == at::IntArrayRef({S, x.size(1), weight.size(1) - 1}),
              "conv_states: initial_state must be (S, dim, width - 1) in x's dtype, contiguous");
  po::ConvStateParams p{};
  p.batch = x.size(0);
  p.dim = x.size(1);
  p.seqlen = x.size(2);
  p.width = weight.size(1);
  p.slots = S;
  p.silu = silu;
  p.dtype = dtype_code(x);
  p.x_bs = x.stride(0);
  p.x_cs = x.stride(1);
  p.x_ls = x.stride(2);
  p.o_bs = out.stride(0);
  p.o_cs = out.stride(1);
  p.o_ls = out.stride(2);
  p.x = x.data_ptr();
  p.weight = weight.data_ptr<float>();
  p.bias = ptr_or_null<const float>(bias);
  p.start = start.data_ptr<int64_t>();
  p.length = length.data_ptr<int64_t>();
  p.has = has.data_ptr<bool>();
  p.initial_state = initial_state.data_ptr();
  p.out = out.data_ptr();
  return p;
}

void conv_states_fwd(Tensor out, Tensor x, Tensor weight, OptT bias, bool silu, Tensor initial_state, Tensor start,
                     Tensor length, Tensor has, Tensor final_state) {
  c10::cuda::CUDAGuard guard(x.device());
  po::ConvStateParams p = conv_state_params(out, x, weight, bias, silu, initial_state, start, length, has);
  TORCH_CHECK(final_state.sizes() == initial_state.sizes() && final_state.scalar_type() == x.scalar_type() &&
                  final_state.is_contiguous(),
              "conv_states_fwd: final_state must be initial_state's shape and dtype, contiguous");
  p.final_state = final_state.data_ptr();
  po::conv_states_fwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void conv_states_bwd(Tensor dout, Tensor x, Tensor weight, OptT bias, bool silu, Tensor initial_state, Tensor start,
                     Tensor length, Tensor has, Tensor dx_head, Tensor dw_part, OptT dinitial_state) {
  c10::cuda::CUDAGuard guard(x.device());
  po::ConvStateParams p = conv_state_params(dout, x, weight, bias, silu, initial_state, start, length, has);
  const int64_t S = p.slots, W = p.width;
  TORCH_CHECK(dx_head.scalar_type() == at::kFloat && dx_head.is_contiguous() &&
                  dx_head.sizes() == at::IntArrayRef({S, W - 1, x.size(1)}),
              "conv_states_bwd: dx_head must be float32 (S, width - 1, dim), contiguous");
  TORCH_CHECK(dw_part.scalar_type() == at::kFloat && dw_part.is_contiguous() &&
                  dw_part.sizes() == at::IntArrayRef({S, x.size(1), W + 1}),
              "conv_states_bwd: dw_part must be float32 (S, dim, width + 1), contiguous");
  if (dinitial_state)
    TORCH_CHECK(dinitial_state->scalar_type() == at::kFloat && dinitial_state->is_contiguous() &&
                    dinitial_state->sizes() == initial_state.sizes(),
                "conv_states_bwd: dinitial_state must be float32 with initial_state's shape, contiguous");
  p.dx_head = dx_head.data_ptr<float>();
  p.dw_part = dw_part.data_ptr<float>();
  p.dinitial_state = ptr_or_null<float>(dinitial_state);
  po::conv_states_bwd_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// reductions over token segments (segment_sums.cu): delta, x, z (batch, dim, seqlen) of one dtype and bc (batch,
// dstate, seqlen), any strides with time unit-strided; A (dim, dstate) and delta_bias (dim) float32 contiguous;
// start, length (S,) int64 contiguous, max_length at least the longest (a host int: it sets the parts); sums (S, dim,
// dstate) and dt_sums (S, dim) float32 contiguous, written in full
void segment_sums(bool forward, Tensor delta, OptT delta_bias, Tensor A, Tensor x, OptT z, Tensor bc, bool softplus,
                  Tensor start, Tensor length, int64_t max_length, Tensor sums, Tensor dt_sums) {
  c10::cuda::CUDAGuard guard(delta.device());
  const int64_t S = start.size(0), dim = delta.size(1), dstate = A.size(1);
  TORCH_CHECK(S <= 65535, "segment_sums: at most 65535 segments, got ", S);
  TORCH_CHECK(dstate <= 16 && bc.dim() == 3 && bc.size(0) == delta.size(0) && bc.size(1) == dstate &&
                  bc.size(2) == delta.size(2) && bc.stride(2) == 1,
              "segment_sums: bc must be (batch, dstate <= 16, seqlen), time unit-strided");
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type() && delta.stride(2) == 1 &&
                  x.stride(2) == 1,
              "segment_sums: delta and x must be (batch, dim, seqlen) of one dtype, time unit-strided");
  if (z) TORCH_CHECK(!forward && z->sizes() == delta.sizes() && z->scalar_type() == delta.scalar_type() &&
                         z->stride(2) == 1,
                     "segment_sums: z (backward only) must be delta's shape and dtype, time unit-strided");
  TORCH_CHECK(bc.scalar_type() == at::kFloat || bc.scalar_type() == delta.scalar_type(),
              "segment_sums: bc must be float32 or delta's dtype");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.size(0) == dim, "segment_sums: A (dim, dstate) float32");
  if (delta_bias) TORCH_CHECK(delta_bias->scalar_type() == at::kFloat && delta_bias->is_contiguous() &&
                                  delta_bias->numel() == dim, "segment_sums: delta_bias (dim,) float32");
  TORCH_CHECK(start.scalar_type() == at::kLong && length.scalar_type() == at::kLong && start.is_contiguous() &&
                  length.is_contiguous() && length.size(0) == S,
              "segment_sums: start, length (S,) int64, contiguous");
  TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.is_contiguous() &&
                  sums.sizes() == at::IntArrayRef({S, dim, dstate}) && dt_sums.scalar_type() == at::kFloat &&
                  dt_sums.is_contiguous() && dt_sums.sizes() == at::IntArrayRef({S, dim}),
              "segment_sums: sums (S, dim, dstate) and dt_sums (S, dim) float32, contiguous");
  po::SegmentSumsParams p{};
  p.batch = delta.size(0);
  p.dim = dim;
  p.seqlen = delta.size(2);
  p.dstate = dstate;
  p.segments = S;
  p.forward = forward;
  p.softplus = softplus;
  p.in_dtype = dtype_code(delta);
  p.w_f32 = bc.scalar_type() == at::kFloat;
  p.delta_bs = delta.stride(0);
  p.delta_ds = delta.stride(1);
  p.x_bs = x.stride(0);
  p.x_ds = x.stride(1);
  p.z_bs = z ? z->stride(0) : 0;
  p.z_ds = z ? z->stride(1) : 0;
  p.bc_bs = bc.stride(0);
  p.bc_ns = bc.stride(1);
  p.delta = delta.data_ptr();
  p.x = x.data_ptr();
  p.z = ptr_or_null<const void>(z);
  p.bc = bc.data_ptr();
  p.A = A.data_ptr<float>();
  p.delta_bias = ptr_or_null<const float>(delta_bias);
  p.start = start.data_ptr<int64_t>();
  p.length = length.data_ptr<int64_t>();
  p.sums = sums.data_ptr<float>();
  p.dt_sums = dt_sums.data_ptr<float>();
  TORCH_CHECK(max_length >= 0 && max_length <= p.seqlen, "segment_sums: max_length must be in [0, seqlen]");
  p.parts = po::segment_sums_parts(S, dim, max_length, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  Tensor part_sums, part_dt;
  if (p.parts > 1) {   // scratch for the parts' sums (segment_sums.cu combines them)
    part_sums = at::empty({p.parts, S, dim, dstate}, sums.options());
    part_dt = at::empty({p.parts, S, dim}, sums.options());
    p.part_sums = part_sums.data_ptr<float>();
    p.part_dt = part_dt.data_ptr<float>();
  }
  po::segment_sums_launch(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#ifndef PACKLOADER_SOURCE_DIGEST
#error "build through ops/_build.py, which defines PACKLOADER_SOURCE_DIGEST (ops/_build.py, source_digest)"
#endif
#define PACKLOADER_STR2(x) #x
#define PACKLOADER_STR(x) PACKLOADER_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the sources this module was built from (ops/_build.py refuses an installed ops._C built from others)
  m.attr("source_digest") = PACKLOADER_STR(PACKLOADER_SOURCE_DIGEST);
  m.def("scan_fwd", &scan_fwd, "packed selective scan forward");
  m.def("scan_bwd", &scan_bwd, "packed selective scan backward");
  m.def("conv_runmask", &conv_runmask, "boundary words of the channel-first conv kernels");
  m.def("conv_fwd", &conv_fwd, "packed causal conv1d forward");
  m.def("conv_bwd", &conv_bwd, "packed causal conv1d backward");
  m.def("conv_states_fwd", &conv_states_fwd, "the conv's carried states: the continued outputs, the final states");
  m.def("conv_states_bwd", &conv_states_bwd, "the conv's carried states: backward");
  m.def("segment_sums", &segment_sums, "reductions over token segments of the scan's inputs (ops/time_split.py)");
}
