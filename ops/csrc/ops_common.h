// Shared declarations of the packed selective-scan and causal-conv1d kernels (no torch headers here).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace packloader_ops {

// dtype codes shared with the binding: 0 float32, 1 float16, 2 bfloat16
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// All (batch, dim, seqlen) tensors are contiguous; B/C are (batch, n_groups, dstate, seqlen) contiguous;
// position_ids (batch, seqlen) int32 contiguous. Channels of one thread block always share one group.
struct ScanParams {
  int batch, dim, seqlen, dstate, n_groups, dim_per_group, nchunks;
  int sm_count;     // the GPU's multiprocessors: the forward's layout depends on how many warps fill them
  int fwd_lanes;    // threads a channel in the forward (1, 2, 4, 8); 0 (what the binding passes): scan_fwd_lanes
  // segments a row is cut into at sequence starts, run side by side (grid z; 0 or 1: none), chosen by the caller
  // (ops/contract.py, scan_segments); the backward writes dA / dD / ddelta_bias per (row, segment)
  int fwd_segments, bwd_segments;
  bool softplus;
  int in_dtype;     // u, delta, z, dout, out, du, ddelta, dz
  bool w_f32;       // B, C are float32 (else in_dtype)
  // strides (elements) of the batch and channel axes of every (batch, dim, seqlen) tensor: u, delta, z, out, dout,
  // out_rec, du, ddelta, dz share one layout, time unit-strided: contiguous (dim * seqlen, seqlen) or channel-major
  // (seqlen, batch * seqlen), the (dim, batch x time) matrices of the mixer's projections (ops/contract.py)
  int64_t x_bs;
  int x_ds;         // below 2^31 (binding.cpp): offsets d * x_ds + t in 64 bits, the stride in one register
  const void *u, *delta, *B, *C, *z;
  const float *A, *D, *delta_bias;   // D / delta_bias may be null
  const int *pos;
  // forward outputs
  void *out;        // y (+ D u) (* silu(z) when z is given)
  float *saved;     // (batch, dim, nchunks, 16): state at the end of every chunk
  // backward
  const void *dout;
  void *out_rec;                     // may be null: the forward's out, recomputed bit for bit (the backward
                                     // recomputes it for dz anyway; a caller that needs it then need not keep it)
  void *du, *ddelta, *dz;
  float *dB, *dC;                    // fp32 accumulators (batch, n_groups, dstate, seqlen), zeroed by the caller
  float *dA, *dD, *ddelta_bias;      // fp32 per (batch row, segment): (batch * bwd_segments, dim, dstate),
                                     // (batch * bwd_segments, dim); the caller sums them
  // deterministic mode (else null: atomics for dB / dC): each channel block stores its own [dB | dC] sums, which the
  // caller adds in a fixed order (no float atomics: the same bits every run)
  float *det_part;                   // (batch, blocks, 2, dstate, seqlen) fp32, written in full; blocks = the grid's x
  // carried states (all null: every sequence starts from zero and no state is returned, the kernels' plain variant)
  const int *state_slots;            // (2, batch, seqlen) int32: [0] at a sequence start, the slot of initial_state it
                                     // starts from (-1: from zero); [1] at a sequence's last token, the slot of
                                     // final_state it ends in (-1: none); -1 at every other token
  const int *row_slots;              // (2, batch) int32, instead of state_slots where states sit only at row edges
                                     // (context parallelism's chunks): [0][b] the slot of initial_state row b's first
                                     // token starts from, [1][b] the slot of final_state its last token ends in (-1:
                                     // none). The plain kernels read them once a row, outside their loops
  const float *initial_state;        // (slots, dim, dstate) fp32: h before the sequence's first token
  float *final_state;                // forward: (slots, dim, dstate) fp32, h after the sequence's last token
  const float *dfinal_state;         // backward: the gradient of final_state (may be null: zero)
  float *dinitial_state;             // backward: the gradient of initial_state (written where a slot starts)
};

// The constants shared with Python live in ops/contract.py; the build (ops/_build.py) passes them as -D flags.
#if !defined(PACKLOADER_SCAN_CHUNK) || !defined(PACKLOADER_SCAN_LANES) || !defined(PACKLOADER_CONV_SLOT_STEPS) || \
    !defined(PACKLOADER_SCAN_BLOCK_CHANNELS) || !defined(PACKLOADER_CONV_MASK_RUN) || \
    !defined(PACKLOADER_SCAN_FWD_WARPS_PER_SM)
#error "build through ops/_build.py, which defines PACKLOADER_SCAN_CHUNK, _SCAN_LANES, _CONV_SLOT_STEPS, _CONV_MASK_RUN, _SCAN_BLOCK_CHANNELS, _SCAN_FWD_WARPS_PER_SM from ops/contract.py"
#endif
constexpr int kScanChunk = PACKLOADER_SCAN_CHUNK;   // timesteps staged in shared memory at a time; one saved state a chunk
constexpr int kScanLanes = PACKLOADER_SCAN_LANES;   // state lanes per channel (dstate padded up to this)
constexpr int kScanFwdWarpsPerSM = PACKLOADER_SCAN_FWD_WARPS_PER_SM;   // the forward's layout choice (scan_fwd_lanes)

void scan_fwd_launch(const ScanParams &p, cudaStream_t stream);
// threads a channel (1, 2, 4 or 8) the forward takes for this many channels (rows cut into this many segments) on
// this many multiprocessors
int scan_fwd_lanes(int batch, int dim, int segments, int sm_count);
void scan_bwd_launch(const ScanParams &p, cudaStream_t stream);

// Causal conv1d. x/out/dout/dx share one layout given by strides (elements); weight (dim, width) fp32.
struct ConvParams {
  int batch, dim, seqlen, width;
  bool silu;
  int dtype;
  int64_t x_bs, x_cs, x_ls;     // strides of x (and of out / dx, which have x's layout)
  int64_t g_bs, g_cs, g_ls;     // strides of dout
  bool channel_last;
  const void *x;
  const float *weight, *bias;   // bias may be null
  const int *pos;
  uint16_t *runmask;            // (batch, conv_mask_stride(seqlen)) boundary words for the channel-first kernels:
  bool runmask_given;           // filled by the caller (conv_runmask_launch) when set, else scratch the launch fills
  bool cl_vec;                  // channel-last rows aligned to the kernels' vectors (set by the launcher)
  void *out;
  const void *dout;
  void *dx;
  float *dw_part;               // fp32 (slots, dim, width + 1) block partials of [dweight | dbias]: the backward
                                // fills the first slots (it returns how many; at most batch * ceil(seqlen /
                                // SLOT_STEPS)), then sums them in slot order into dweight / dbias
  float *dweight, *dbias;       // fp32 (dim, width), (dim); dbias null without bias
};

// Row stride (in 16-bit words) of the channel-first kernels' boundary masks: one word per run of
// PACKLOADER_CONV_MASK_RUN timesteps, padded to a multiple of 8 words (16 bytes); ops/contract.py, conv_mask_stride.
constexpr int kConvMaskRun = PACKLOADER_CONV_MASK_RUN;
#ifdef __CUDACC__
__host__ __device__
#endif
inline int conv_mask_stride(int seqlen) { return ((seqlen + kConvMaskRun - 1) / kConvMaskRun + 7) / 8 * 8; }

// The boundary words of conv_runmask (ops/contract.py): (batch, conv_mask_stride(seqlen)), every word written.
void conv_runmask_launch(const int *pos, uint16_t *mask, int batch, int seqlen, cudaStream_t stream);

void conv_fwd_launch(const ConvParams &p, cudaStream_t stream);
int conv_bwd_launch(const ConvParams &p, cudaStream_t stream);   // returns the dw_part slots written and summed

// The conv's carried states (conv_states.cu; ops/contract.py, packloader::conv_states_fwd / _bwd): a fix-up after the
// packed conv of S sequences given by their flat token spans (start = row * seqlen + column, length).
struct ConvStateParams {
  int batch, dim, seqlen, width, slots;   // slots: S
  bool silu;
  int dtype;                    // x, out, initial_state, final_state
  int64_t x_bs, x_cs, x_ls;     // strides of x
  int64_t o_bs, o_cs, o_ls;     // strides of out (forward: the conv's output; backward: its gradient)
  const void *x;
  const float *weight, *bias;   // (dim, width) fp32; bias (dim) or null
  const int64_t *start, *length;   // (S,)
  const bool *has;              // (S,): the sequence continues initial_state
  const void *initial_state;    // (S, dim, width - 1) contiguous
  void *out;                    // in place: forward, the first width - 1 outputs of a continued sequence; backward,
                                // read there, then zeroed
  void *final_state;            // forward: (S, dim, width - 1) contiguous
  float *dx_head;               // backward: (S, width - 1, dim) fp32, the gradient of each sequence's first inputs
  float *dw_part;               // backward: (S, dim, width + 1) fp32, per-sequence [dweight | dbias]
  float *dinitial_state;        // backward: (S, dim, width - 1) fp32, or null
};

void conv_states_fwd_launch(const ConvStateParams &p, cudaStream_t stream);
void conv_states_bwd_launch(const ConvStateParams &p, cudaStream_t stream);

// Reductions over token segments of the scan's inputs (segment_sums.cu; ops/time_split.py, segment_sums): for
// segment s, length[s] tokens of one row from flat token index start[s] (row * seqlen + column), per channel d and
// state n, forward: E = sum_t exp(A sum_{t' > t} dt_t') dt_t x_t bc_t (the state the segment ends in from zero;
// x = u, bc = B), backward: D = sum_t exp(A sum_{t' <= t} dt_t') bc_t x_t silu(z_t) (the adjoint its first step
// hands back; x = the output's gradient, bc = C, z optional); and the sum of dt over the segment. Sums are taken in
// tiles of the segment, each tile's weights from the dt inside it times one factor for the dt beyond it.
struct SegmentSumsParams {
  int batch, dim, seqlen, dstate, segments;
  bool forward, softplus;
  int in_dtype;                 // delta, x, z (one dtype)
  bool w_f32;                   // bc is float32 (else in_dtype)
  int64_t delta_bs, delta_ds, x_bs, x_ds, z_bs, z_ds, bc_bs, bc_ns;   // strides (elements); time unit-strided
  const void *delta, *x, *z, *bc;   // z may be null (backward only)
  const float *A, *delta_bias;      // (dim, dstate); (dim) or null
  const int64_t *start, *length;    // (segments,)
  float *sums;                      // (segments, dim, dstate)
  float *dt_sums;                   // (segments, dim)
  int parts;                        // each segment cut into this many parts of whole tiles, run side by side (>= 1)
  float *part_sums, *part_dt;       // parts > 1: scratch (parts, segments, dim, dstate) and (parts, segments, dim)
};
void segment_sums_launch(const SegmentSumsParams &p, cudaStream_t stream);
// the parts a launch cuts each segment into: enough blocks for this many multiprocessors, the longest segment
// max_length tokens (the caller's bound, known on the host)
int segment_sums_parts(int segments, int dim, int max_length, int sm_count);

}  // namespace packloader_ops
