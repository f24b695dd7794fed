"""The kernel contract of ``ops``: what each kernel op receives and returns, and the constants it depends on.

This module is the one home of the constants shared by the Python side and the CUDA sources (the CUDA build
receives them as ``-D`` definitions; nothing is copied by hand into the headers).

Seven ops are registered with ``torch.library.custom_op`` in the ``packloader`` namespace (``torch.ops.packloader``).
Each has a fake (meta) implementation giving output shapes, dtypes and strides, a reference implementation in
pure PyTorch (every device but CUDA; any float dtype, float64 included), a CUDA implementation that calls the
compiled kernels (``ops._cuda``), and, for the two forward ops, an autograd formula that calls the matching
backward op. Notation: ``b`` batch, ``d`` channels, ``L`` seqlen, ``n`` dstate, ``g`` groups of B/C, ``w`` conv width.

Boundaries
    ``position_ids``: int32, contiguous, ``(b, L)``; restarts at 0 at every sequence start (column 0 of every
    row is a start). The scan drops its state where ``position_ids == 0``; conv tap ``k`` (the input ``k`` steps
    back) is used at time ``t`` only where ``position_ids[t] >= k``. A row without boundaries is
    ``arange(L)``. The ops do not validate them (that is done once per step where they enter a model:
    :mod:`ops.boundaries`).

Carried states (:mod:`ops.states`)
    ``state_slots``: int32, contiguous, ``(2, b, L)``. Plane 0: at a sequence's first token, the slot of
    ``initial_state`` the sequence starts from (the scan's first step is ``h = exp(delta A) h0 + delta B u`` instead of
    the reset); -1 elsewhere (and everywhere without ``initial_state``). Plane 1: at a sequence's last token, the slot
    of ``final_state`` its state is written to; -1 elsewhere. A slot appears at most once in each plane. Row edges:
    ``(2, b)`` slots put states at rows' first and last tokens only (``[0][r]`` at row ``r``'s first token, ``[1][r]``
    at its last; ``states.token_slots`` spreads them over the tokens); the plain kernels read them once a row. The functional
    ops number slots by sequence in ``cu_seqlens`` order (flash-linear-attention's convention, with a flag per
    sequence like vLLM's ``has_initial_state``); a caller that carries few sequences numbers just those. The conv
    kernels run as without states; the first ``w - 1`` outputs of each continued sequence are then recomputed from its
    state (``conv_states_fwd`` below, in the fused mixers that carry states; torch ops in the functional entry,
    ``ops.packed_causal_conv1d``).

``packloader::selective_scan_fwd(u, delta, A, B, C, D?, z?, delta_bias?, position_ids, delta_softplus,
state_slots?=None, initial_state?=None, num_final_states=0) -> (out, saved, final_state)``
    - ``u``, ``delta``: ``(b, d, L)``, last dim contiguous; ``z`` (optional): ``(b, d, L)``. Float dtype of
      ``u``; the kernel takes float32/float16/bfloat16 (``delta``, ``z`` are cast to ``u``'s dtype).
    - ``A``: ``(d, n)``; ``D``, ``delta_bias`` (optional): ``(d,)``. float32 (float64 for the reference).
    - ``B``, ``C``: ``(b, n, L)`` or grouped ``(b, g, n, L)`` with ``d % g == 0``; ``u``'s dtype or float32.
    - ``delta_softplus``: ``delta <- softplus(delta + delta_bias)``.
    - Layout: ``u`` contiguous or channel-major (:func:`is_channel_major`: memory ``(d, b, L)``, the layout of the
      fused mixer's projections, one ``(d, b * L)`` matrix); every ``(b, d, L)`` output has ``u``'s layout (a
      contiguous one when ``u`` has any other, which the kernel path copies), and the kernel path lays ``delta``,
      ``z`` (and ``dout``) out as ``u``.
    - ``out``: ``(b, d, L)``, ``u``'s dtype and layout: ``y (+ D u)``, times ``silu(z)`` when ``z`` is given.
    - ``saved``: ``(b, d, ceil(L / SCAN_CHUNK), SCAN_LANES)`` float32, contiguous: the state ``h`` after the
      last timestep of every chunk of ``SCAN_CHUNK`` timesteps (lanes ``>= n`` are 0). It is the only thing the
      backward needs besides the inputs. Every implementation fills it the same way, so a forward run by the
      reference and a backward run by the kernel (or the other way round) are consistent.
    - ``initial_state`` (optional, with ``state_slots``): ``(slots, d, n)`` float32 (float64 for the reference).
    - ``final_state``: ``(num_final_states, d, n)`` float32 (float64 for float64 inputs), zeros in slots no sequence
      ends in; an empty ``(0,)`` tensor when ``num_final_states`` is 0. The chunk states in ``saved`` include the
      initial states' contribution.
    - Saved for backward (autograd): all inputs and ``saved``; not ``out``. Without ``state_slots`` the kernels are the
      plain ones (a compile-time variant: no slot is loaded, the same code and bits as without states); so are they
      with row-edge slots, which load and store states outside their loops.

``packloader::selective_scan_bwd(u, delta, A, B, C, D?, z?, delta_bias?, position_ids, delta_softplus, saved,
dout, recompute_out=False, state_slots?=None, initial_state?=None, dfinal_state?=None) -> (du, ddelta, dA, dB, dC,
dD, dz, ddelta_bias, out, dinitial_state)``
    - ``dout``: ``(b, d, L)`` (any strides), the gradient of ``out``.
    - Each gradient has its input's shape and dtype; ``du``, ``ddelta``, ``dz`` and ``out`` have ``u``'s layout (as
      the forward's ``out``). An optional input that was not given gets an empty
      float32 tensor of shape ``(0,)`` in its place (custom ops cannot return None).
    - ``out``: with ``recompute_out``, the forward's ``out`` recomputed (the backward recomputes it anyway; the
      CUDA kernel gives the forward's bits exactly, but on rows of one sequence that the forward cut along time,
      ``ops/time_split.py``: there within rounding), so a caller that needs it in its backward (``out_proj``'s
      weight gradient in the fused mixer) need not keep it from the forward; else an empty ``(0,)`` tensor.
    - ``dfinal_state`` (optional): the gradient of ``final_state``; it enters the adjoint at each sequence's last
      token. ``dinitial_state``: ``initial_state``'s shape, the adjoint a continued sequence's first step hands back
      (``exp(delta A) gh``, not handed on to the sequence before); zeros in unused slots; empty without states.

``packloader::conv_runmask(position_ids) -> runmask``
    - The channel-first conv kernels' boundaries, one 16-bit word per run of ``CONV_MASK_RUN`` timesteps: bit ``i``
      of word ``r`` is set when token ``r * CONV_MASK_RUN - 4 + i`` starts a sequence (``position_ids == 0``, or
      ``t <= 0``) or lies outside the row. ``(b, conv_mask_stride(L))`` int16, words past the last run 0.
    - A function of ``position_ids`` alone: a caller that runs the conv forward and backward on the same rows
      computes it once and hands it to both (the ops compute it themselves when it is not given).

``packloader::causal_conv1d_fwd(x, weight, bias?, position_ids, silu, runmask?) -> out``
    - ``x``: ``(b, d, L)``, channel-first contiguous, dense channel-last (memory ``(b, L, d)``,
      ``x.stride() == (L*d, 1, d)``) or channel-major (memory ``(d, b, L)``, :func:`is_channel_major`); the
      functional entry copies any other layout to channel-first.
    - ``weight``: ``(d, w)`` with ``CONV_MIN_WIDTH <= w <= CONV_MAX_WIDTH`` on the kernel (any ``w`` for the
      reference); ``bias`` (optional): ``(d,)``. Any float dtype (the kernel computes in float32).
    - ``silu``: apply SiLU to the output.
    - ``runmask`` (optional): ``conv_runmask(position_ids)``, used by the kernels that read boundaries as masks
      (channel-first rows); never validated against ``position_ids`` (the caller computed it from them).
    - ``out``: ``x``'s shape, dtype and strides. Saved for backward: ``x``, ``weight``, ``bias``, ``position_ids``,
      ``runmask``.

``packloader::causal_conv1d_bwd(x, weight, bias?, position_ids, silu, dout, runmask?) -> (dx, dweight, dbias)``
    - ``dout``: ``(b, d, L)``, any strides. ``dx`` has ``x``'s strides; ``dweight``, ``dbias`` their inputs'
      shapes and dtypes; ``dbias`` is an empty float32 ``(0,)`` tensor without a bias.

``packloader::conv_states_fwd(out, x, weight, bias?, silu, initial_state, start, length, has_initial_state) ->
final_state``
    - ``S`` sequences given by their tokens in the flattened ``(b * L)`` row-major order: ``start``, ``length``
      ``(S,)`` int64; ``has_initial_state`` ``(S,)`` bool; ``initial_state`` ``(S, d, w - 1)`` in ``x``'s dtype, the
      ``w - 1`` inputs before each sequence, oldest first.
    - ``out`` (mutated; any strides): the conv's output of ``x`` (``causal_conv1d_fwd``); for every sequence with a
      state, its first ``min(w - 1, length)`` outputs are recomputed with the taps before its start reading the state
      (``silu``, ``bias`` as in the conv); every other element is left as it was.
    - ``final_state``: ``(S, d, w - 1)`` in ``x``'s dtype, each sequence's last ``w - 1`` inputs (its initial
      state's, or zeros without one, before a short sequence's start), the layout ``initial_state`` takes.

``packloader::conv_states_bwd(dout, x, weight, bias?, silu, initial_state, start, length, has_initial_state,
initial_grad) -> (dx_head, dweight, dbias, dinitial_state)``
    - ``dout`` (mutated): the gradient of ``out``, read at the outputs ``conv_states_fwd`` wrote, then zeroed there
      (their gradient goes through the recomputation; hand ``dout`` to ``causal_conv1d_bwd`` after).
    - ``dx_head``: ``(S, w - 1, d)``, the gradient of each sequence's first ``w - 1`` inputs through the recomputed
      outputs (zeros past its end and for sequences without a state), to be added into ``causal_conv1d_bwd``'s
      ``dx``; ``dweight`` ``(d, w)``, ``dbias`` ``(d,)`` (empty without a bias): the recomputation's share;
      ``dinitial_state``: ``initial_state``'s shape with ``initial_grad``, else empty. float32 (float64 for the
      reference on float64 inputs); summed over the sequences in order (the same bits every run).

Dispatch (:mod:`ops.backends`): the tensors' device picks the implementation; ``with ops.use_backend("reference"):``
makes CUDA tensors run the reference too; a case the kernel cannot take raises (never a silent fallback).

Where later changes go: a switch that changes how a kernel runs (a deterministic mode, say) is read by the CUDA
implementation when it runs, like the override; a new boundary rule (causal-conv1d's ``seq_idx == -1`` padding, say)
is resolved with the others in :mod:`ops.boundaries` and reaches the ops as one more argument of their schema.
"""
from __future__ import annotations

import torch

SCAN_CHUNK = 64        # timesteps a scan block stages at a time; the forward saves one state per chunk
SCAN_LANES = 16        # state lanes per channel in the CUDA scan (dstate is padded up to this)
MAX_DSTATE = 16        # largest d_state the CUDA scan takes
CONV_MIN_WIDTH = 2     # conv widths the CUDA conv takes
CONV_MAX_WIDTH = 4
CONV_SLOT_STEPS = 128  # the conv backward writes one dweight/dbias partial per block; at most one per this many steps
CONV_MASK_RUN = 8      # timesteps per word of the conv's boundary mask (conv_runmask): a channel-first thread's run
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # activation dtypes the CUDA kernels take
SCAN_BLOCK_CHANNELS = 16   # channels of one CUDA scan block; they must share a B/C group (else: group by group)
# the scan forward gives a channel the fewest threads (1, 2, 4 or 8) that still make at least this many warps per
# multiprocessor (with fewer, one warp's chain of timesteps sets the time): ops/csrc/selective_scan.cu, scan_fwd_lanes
# (a row cut into segments counts as two rows there)
SCAN_FWD_WARPS_PER_SM = 7
# A packed row's sequences are independent: where a grid is too small to fill the GPU, the scan cuts each row at
# sequence starts into segments that run side by side (scan_segments). The backward aims at this many blocks of 128
# threads per multiprocessor (it runs 3 at a time), and no segment is planned shorter than SCAN_MIN_SEGMENT timesteps.
SCAN_BWD_BLOCKS_PER_SM = 6
SCAN_MIN_SEGMENT = 256
# Rows of one sequence have no start to cut at; the scan cuts them along time instead (ops/time_split.py: a reduction
# pass gives each piece its initial state) only on grids of at most this many blocks of SCAN_BLOCK_CHANNELS channels
# per multiprocessor (batch x dim <= 2,112 on an H100): measured there, the cut lost once the uncut grid was twice
# that (bench_time_split.py, RESULTS.md)
TIME_SPLIT_MAX_BLOCKS_PER_SM = 1

# The ops' outputs follow their inputs' strides (the conv) and the CUDA implementations read raw pointers: a compiler
# (inductor) must hand them their inputs with exactly the strides seen when tracing.
OP_TAGS = (getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order,)


def is_channel_major(t: torch.Tensor) -> bool:
    """Whether a ``(b, d, L)`` tensor is laid out as ``(d, b, L)`` in memory (strides ``(L, b * L, 1)``): the fused
    mixer's activations, each one ``(d, b * L)`` matrix, so that a projection or its weight gradient is one GEMM over
    all ``b * L`` tokens. With ``b == 1`` it is also contiguous."""
    if t.dim() != 3:
        return False
    b, d, L = t.shape
    return (L <= 1 or t.stride(2) == 1) and (b <= 1 or t.stride(0) == L) and (d <= 1 or t.stride(1) == b * L)


def conv_mask_stride(seqlen: int) -> int:
    """Words per row of ``conv_runmask``'s mask: one per run of ``CONV_MASK_RUN`` timesteps, padded to a multiple of 8
    (16 bytes)."""
    return (-(-seqlen // CONV_MASK_RUN) + 7) // 8 * 8


def scan_chunks(seqlen: int) -> int:
    """Number of chunks of ``SCAN_CHUNK`` timesteps (the third dim of the scan's ``saved``)."""
    return (seqlen + SCAN_CHUNK - 1) // SCAN_CHUNK


def scan_blocks(dim: int) -> int:
    """Channel blocks of ``SCAN_BLOCK_CHANNELS`` channels per batch row in the CUDA scan's backward (the second dim of
    the deterministic mode's ``det_part``: one [dB | dC] slot per block)."""
    return -(-dim // SCAN_BLOCK_CHANNELS)


def scan_segments(units: int, seqlen: int, target: int) -> int:
    """Segments (a power of two) each row of the scan is cut into: the fewest that make ``units`` (the grid's warps or
    blocks for whole rows) times the segments reach ``target``, none planned shorter than ``SCAN_MIN_SEGMENT``.

    Segment ``k`` of ``K`` runs from the first sequence start at or after ``k * seqlen / K`` to the next segment's
    start (``ops/csrc/selective_scan.cu``, ``segment_bound``): rows with fewer, longer sequences get empty segments
    and are no faster, but never wrong; the bits are those of one pass over the row."""
    k = 1
    while units * k < target and seqlen >= 2 * k * SCAN_MIN_SEGMENT:
        k *= 2
    return k


def scan_fwd_segments(batch: int, dim: int, seqlen: int, sm_count: int) -> int:
    """Segments of the forward: warps of one thread a channel (32 channels a warp) against
    ``SCAN_FWD_WARPS_PER_SM`` warps per multiprocessor."""
    return scan_segments(batch * -(-dim // 32), seqlen, SCAN_FWD_WARPS_PER_SM * sm_count)


def scan_bwd_segments(batch: int, dim: int, seqlen: int, sm_count: int) -> int:
    """Segments of the backward: blocks of ``SCAN_BLOCK_CHANNELS`` channels against ``SCAN_BWD_BLOCKS_PER_SM`` blocks
    per multiprocessor. dA / dD / ddelta_bias come per (row, segment)."""
    return scan_segments(batch * scan_blocks(dim), seqlen, SCAN_BWD_BLOCKS_PER_SM * sm_count)
