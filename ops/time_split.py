"""Rows of one sequence cut along time into pieces that the scan kernels run side by side (small grids).

On a grid too small to fill the GPU (one or two rows of a few thousand channels: prefill, evaluation, small-batch
fine-tuning) the scan cuts packed rows at sequence starts into segments (``ops/contract.py``, ``scan_segments``); a
row that is one sequence has no start to cut at. Here it is cut anyway, into ``K`` pieces of ``piece`` timesteps (a
multiple of ``SCAN_CHUNK``), and each piece is run from its true initial state, which the scan's linearity gives
cheaply: within a piece ``k`` of timesteps ``[t0, t1)``::

    h(t1 - 1) = P_k h(t0 - 1) + E_k      P_k = exp(A sum_t dt_t),   E_k = sum_t exp(A sum_{s > t} dt_s) dt_t B_t u_t

so ``H_k`` (the state before piece ``k``) follows from ``H_0 = 0``, ``H_k = P_{k-1} H_{k-1} + E_{k-1}``. ``E`` and
the sums of ``dt`` are plain reductions over time (no recurrence), one CUDA kernel (``ops/csrc/segment_sums.cu``);
then one pass of the scan kernel over all pieces side by side, each continuing from ``H_k`` (the carried-state slots
of ``ops/contract.py``)::

    row      [ t0 ............................................................ L ]
    pieces   [ piece 0       | piece 1       | piece 2       | piece 3       ]
    pass     [ from 0        | from H_1      | from H_2      | from H_3      ]   side by side, the bits of one pass
                                                                               up to rounding

The backward mirrors it: the state before each piece is the forward's saved chunk state; the adjoint a piece hands
back through its start with no gradient entering its end, ``D_k = sum_t exp(A sum_{t0 <= s <= t} dt_s) C_t g_t``
(``g`` the output's gradient, gated by ``silu(z)``), is again a reduction; the gradient entering the end of piece
``k - 1`` is ``G_{k-1} = D_k + P_k G_k`` (``G_{K-1} = 0``); one pass of the backward kernel with those final-state
gradients gives every gradient exactly as the uncut backward does (up to rounding).

Used by the CUDA implementation of the scan ops (``ops.selective_scan_interface``) for calls without carried states
on rows known to be one sequence (``ops.boundaries.single_sequence_rows``), where Triton imports (the prefix over
pieces is a Triton kernel). The two kernels take any token spans (:func:`segment_sums`) and any chains of them
(:func:`chain_prefix`): the fused mixer with carried states (``ops/carry.py``) runs a step's chains of pieces through
them. The references (:func:`segment_sums_ref`, :func:`chain_prefix_ref`) are the oracle of the kernels and run the
same plan on any device (the CPU tests; the CUDA reduction also on the emulated kernels).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .contract import (SCAN_CHUNK, SCAN_FWD_WARPS_PER_SM, TIME_SPLIT_MAX_BLOCKS_PER_SM, scan_blocks,
                       scan_bwd_segments, scan_fwd_segments)
from .decode import HAS_TRITON

__all__ = ["split_plan", "piece_layout", "piece_spans", "segment_sums", "segment_sums_ref", "piece_sums",
           "piece_sums_ref", "piece_prefix", "piece_prefix_ref", "chain_prefix", "chain_prefix_ref",
           "fwd_lanes", "forward_states", "backward_states", "MAX_PIECES"]

MAX_PIECES = 64        # at most this many pieces a row (the plans stay far below)


def split_plan(which: str, batch: int, dim: int, seqlen: int, sm_count: int) -> Optional[Tuple[int, int]]:
    """``(pieces, piece)`` for rows of one sequence in the scan's forward (``which="fwd"``) or backward (``"bwd"``):
    the segments the plan of ``ops/contract.py`` gives packed rows of that grid, each ``piece`` timesteps (a multiple
    of ``SCAN_CHUNK``: the backward reads the state before a piece from the forward's saved chunk states); None where
    the grid is not small enough for the cut to pay (``TIME_SPLIT_MAX_BLOCKS_PER_SM``) or the plan does not cut (the
    row is too short)."""
    if batch * scan_blocks(dim) > TIME_SPLIT_MAX_BLOCKS_PER_SM * sm_count:
        return None
    plan = scan_fwd_segments if which == "fwd" else scan_bwd_segments
    k = plan(batch, dim, seqlen, sm_count)
    if k <= 1:
        return None
    piece = -(-seqlen // k)
    piece = -(-piece // SCAN_CHUNK) * SCAN_CHUNK
    pieces = -(-seqlen // piece)
    if pieces <= 1 or pieces > MAX_PIECES:
        return None
    return pieces, piece


def fwd_lanes(rows: int, dim: int, sm_count: int) -> int:
    """The scan forward's layout (threads a channel) for ``rows`` full rows: the fewest that make
    ``SCAN_FWD_WARPS_PER_SM`` warps a multiprocessor (``selective_scan.cu``, ``scan_fwd_lanes``, which counts a row cut
    into segments as at most two rows: here every piece is full)."""
    for lanes in (1, 2, 4):
        if rows * -(-dim // (32 // lanes)) >= SCAN_FWD_WARPS_PER_SM * sm_count:
            return lanes
    return 8


_layouts: dict = {}
_LAYOUTS_KEPT = 8


def piece_layout(batch: int, seqlen: int, pieces: int, piece: int, device) -> Tuple[torch.Tensor, ...]:
    """``(position_ids, state_slots, start, length)``: ids and slots (int32) that make the kernels run each piece as a
    sequence of its own that continues from a state: ids restart at every piece start; ``state_slots[0]`` names, at
    the start of piece ``k >= 1`` of row ``b``, initial-state slot ``b * pieces + k``, ``state_slots[1]`` at the end
    of piece ``k < pieces - 1`` final-state slot ``b * pieces + k`` (-1 elsewhere); the pieces' token spans (int64
    (batch * pieces,): the flat token index of each piece's start, its length; :func:`piece_spans`). Made once per
    shape and device (made afresh while a CUDA graph is captured or under ``torch.compile``); not to be changed."""
    device = torch.device(device)
    fresh = torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    key = (batch, seqlen, pieces, piece, str(device))
    got = None if fresh else _layouts.get(key)
    if got is not None:
        return got
    with torch.inference_mode(False):
        t = torch.arange(seqlen, dtype=torch.int32, device=device)
        pos = (t % piece).expand(batch, seqlen).contiguous()
        slots = torch.full((2, batch, seqlen), -1, dtype=torch.int32, device=device)
        k = torch.arange(pieces, dtype=torch.int32, device=device)
        slot = torch.arange(batch, dtype=torch.int32, device=device)[:, None] * pieces + k   # (batch, pieces)
        slots[0][:, piece::piece] = slot[:, 1:]                                            # piece starts, k >= 1
        slots[1][:, piece - 1:(pieces - 1) * piece:piece] = slot[:, :-1]                   # piece ends, k < K - 1
        t0 = torch.arange(pieces, dtype=torch.int64, device=device) * piece
        start = (torch.arange(batch, dtype=torch.int64, device=device)[:, None] * seqlen + t0).reshape(-1)
        length = (seqlen - t0).clamp(max=piece).repeat(batch)
        got = (pos, slots, start, length)
    if not fresh:
        if len(_layouts) >= _LAYOUTS_KEPT:
            _layouts.pop(next(iter(_layouts)))
        _layouts[key] = got
    return got


# --------------------------------------------------------------------------------------------------
# the reductions over segments (the pieces of a cut row; the pieces of a document chained in one step, ops/carry.py)

def _dt(delta: torch.Tensor, delta_bias: Optional[torch.Tensor], softplus: bool, ct: torch.dtype) -> torch.Tensor:
    dt = delta.to(ct)
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[:, None]
    return F.softplus(dt) if softplus else dt


def _tokens(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (batch, c, seqlen) at flat token indices ``idx`` (S, M) -> (S, M, c)."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[idx]


def segment_sums_ref(forward: bool, delta, delta_bias, A, x, z, bc, softplus: bool, start: torch.Tensor,
                     length: torch.Tensor, max_length: int):
    """The reductions over ``S`` segments in torch (float64 for float64 inputs, else float32): ``(sums, dt_sums)``,
    ``sums`` (S, dim, dstate), ``dt_sums`` (S, dim) the sum of ``dt`` over each segment's tokens.

    A segment is ``length[s]`` tokens of one row from flat token index ``start[s]`` (into (batch, seqlen); int64
    (S,) tensors on the inputs' device, ``max_length`` at least the longest, a host int: no wait for the device).
    ``forward``: ``sums[s] = E_s``, the state the segment ends in from a zero state (``x`` is ``u``, ``bc`` is
    ``B``); else ``D_s``, the adjoint its first step hands back with no gradient entering its end (``x`` is the
    output's gradient, gated by ``silu(z)`` where ``z`` is given; ``bc`` is ``C``). ``delta``, ``x``, ``z``: (batch,
    dim, seqlen); ``bc``: (batch, dstate, seqlen) or (batch, 1, dstate, seqlen); ``A`` (dim, dstate)."""
    ct = torch.float64 if delta.dtype == torch.float64 else torch.float32
    j = torch.arange(max(int(max_length), 1), device=start.device)
    valid = j < length[:, None]                                   # (S, M)
    idx = torch.where(valid, start[:, None] + j, start[:, None])
    dt = torch.where(valid[..., None], _tokens(_dt(delta, delta_bias, softplus, ct), idx), 0.0)   # (S, M, d)
    g = x.to(ct)
    if not forward and z is not None:
        g = g * F.silu(z.to(ct))
    g = torch.where(valid[..., None], _tokens(g, idx), 0.0)
    bcx = _tokens((bc[:, 0] if bc.dim() == 4 else bc).to(ct), idx)              # (S, M, n)
    if forward:      # exp(A * sum_{s > t} dt_s) dt_t u_t B_t
        expo = dt.flip(1).cumsum(1).flip(1) - dt
        term = dt * g
    else:            # exp(A * sum_{t0 <= s <= t} dt_s) C_t g_t
        expo = dt.cumsum(1)
        term = g
    w = torch.exp(expo[..., None] * A.to(ct))                                    # (S, M, d, n)
    sums = (w * term[..., None] * bcx[:, :, None, :]).sum(1)
    return sums, dt.sum(1)


def piece_spans(batch: int, seqlen: int, pieces: int, piece: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(start, length)`` (int64, (batch * pieces,)) of the pieces of :func:`piece_layout`, segment ``b * pieces +
    k`` piece ``k`` of row ``b`` (made once per shape and device, as the layout)."""
    return piece_layout(batch, seqlen, pieces, piece, device)[2:]


def piece_sums_ref(forward: bool, delta, delta_bias, A, x, z, bc, softplus: bool, pieces: int, piece: int):
    """:func:`segment_sums_ref` over the pieces of a cut: ``(sums (batch, pieces, dim, dstate), dt_sums (batch,
    pieces, dim))``."""
    batch, dim, L = delta.shape
    start, length = piece_spans(batch, L, pieces, piece, delta.device)
    sums, dts = segment_sums_ref(forward, delta, delta_bias, A, x, z, bc, softplus, start, length, piece)
    return sums.view(batch, pieces, dim, -1), dts.view(batch, pieces, dim)


def chain_prefix_ref(sums: torch.Tensor, dt_sums: torch.Tensor, A: torch.Tensor, offsets, h0=None,
                     inclusive: bool = True, reverse: bool = False) -> torch.Tensor:
    """(S, dim, dstate): along each chain ``c`` of segments ``offsets[c] .. offsets[c + 1] - 1`` (in list order, or
    reversed), ``h <- P_i h + sums_i`` with ``P_i = exp(A dt_sums_i)``, from ``h0[c]`` (zero without ``h0``); ``out[i]``
    is ``h`` after segment ``i`` (``inclusive``) or before it. ``sums`` (S, dim, dstate), ``dt_sums`` (S, dim),
    ``offsets`` (C + 1,) (a tensor or a list; every segment in a chain), ``h0`` (C, dim, dstate)."""
    P = torch.exp(dt_sums[..., None] * A.to(sums.dtype))
    out = torch.zeros_like(sums)
    offsets = offsets.tolist() if torch.is_tensor(offsets) else list(offsets)
    for c in range(len(offsets) - 1):
        order = range(offsets[c], offsets[c + 1])
        h = torch.zeros_like(sums[0]) if h0 is None else h0[c].to(sums.dtype)
        for i in (reversed(order) if reverse else order):
            if not inclusive:
                out[i] = h
            h = P[i] * h + sums[i]
            if inclusive:
                out[i] = h
    return out


def piece_prefix_ref(forward: bool, sums: torch.Tensor, dt_sums: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """(batch, pieces, dim, dstate): ``forward``: ``H_0 = 0, H_k = P_{k-1} H_{k-1} + E_{k-1}`` (the state before each
    piece); else ``G_{K-1} = 0, G_{k-1} = D_k + P_k G_k`` (the gradient entering each piece's end). ``P_k = exp(A
    dt_sums_k)``: :func:`chain_prefix_ref` along each row, exclusive."""
    batch, pieces = sums.shape[:2]
    out = chain_prefix_ref(sums.flatten(0, 1), dt_sums.flatten(0, 1), A, [b * pieces for b in range(batch + 1)],
                           inclusive=False, reverse=not forward)
    return out.view(sums.shape)


if HAS_TRITON:
    import triton
    import triton.language as tl


    @triton.jit
    def _chain_prefix_kernel(sums_ptr, dts_ptr, A_ptr, h0_ptr, off_ptr, out_ptr, dim, dstate, per_chain,
                             UNIFORM: tl.constexpr, HAS_H0: tl.constexpr, INCLUSIVE: tl.constexpr,
                             REVERSE: tl.constexpr, BLOCK: tl.constexpr):
        # program: BLOCK (channel, state) pairs of one chain, its segments in list order (or reversed)
        pid, c = tl.program_id(0), tl.program_id(1)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        ok = i < dim * dstate
        d = i // dstate
        A2 = tl.load(A_ptr + i, mask=ok, other=0.0) * 1.4426950408889634
        if UNIFORM:
            lo = c * per_chain
            hi = lo + per_chain
        else:
            lo = tl.load(off_ptr + c)
            hi = tl.load(off_ptr + c + 1)
        if HAS_H0:
            h = tl.load(h0_ptr + c.to(tl.int64) * dim * dstate + i, mask=ok, other=0.0).to(tl.float32)
        else:
            h = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, hi - lo):
            if REVERSE:
                at = (hi - 1 - j).to(tl.int64)
            else:
                at = (lo + j).to(tl.int64)
            if not INCLUSIVE:
                tl.store(out_ptr + at * dim * dstate + i, h, mask=ok)
            s = tl.load(dts_ptr + at * dim + d, mask=ok, other=0.0)
            e = tl.load(sums_ptr + at * dim * dstate + i, mask=ok, other=0.0)
            h = tl.exp2(A2 * s) * h + e
            if INCLUSIVE:
                tl.store(out_ptr + at * dim * dstate + i, h, mask=ok)


def _on(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s (CPU tensors: Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.device.type == "cuda"


def segment_sums(forward: bool, delta, delta_bias, A, x, z, bc, softplus: bool, start: torch.Tensor,
                 length: torch.Tensor, max_length: int):
    """:func:`segment_sums_ref`, by one CUDA kernel on CUDA tensors (``ops/csrc/segment_sums.cu``; float32 results;
    ``delta``, ``x``, ``z``: (batch, dim, seqlen), any strides with the time axis unit-strided; ``bc`` (batch,
    dstate, seqlen) or (batch, 1, dstate, seqlen) likewise; ``A`` / ``delta_bias`` float32). No wait for the device.
    The reference wherever the scan itself runs its reference (``ops.use_backend("reference")``, other devices,
    float64, dstate above the kernel's), under ``torch.compile`` and tensor subclasses, and where the kernels cannot
    load."""
    ext = _reduction_kernels(delta, A)
    if ext is None:
        return segment_sums_ref(forward, delta, delta_bias, A, x, z, bc, softplus, start, length, max_length)
    return _segment_sums_ext(ext, forward, delta, delta_bias, A, x, z, bc, softplus, start, length, max_length)


def _reduction_kernels(delta: torch.Tensor, A: torch.Tensor):
    """The compiled extension where :func:`segment_sums` runs its kernel (the scan's dispatch rule, plain eager mode),
    else None."""
    from . import backends
    try:
        if not backends.calls_directly(delta) or backends.implementation(
                "selective_scan", delta.device.type, delta.dtype, dstate=A.shape[1]) != "cuda":
            return None
        return backends.load_kernels()
    except backends.KernelUnsupportedError:
        return None


def _segment_sums_ext(ext, forward, delta, delta_bias, A, x, z, bc, softplus, start, length, max_length):
    """:func:`segment_sums` by ``ext.segment_sums`` (the compiled extension, or the kernel emulation's)."""
    batch, dim, L = delta.shape
    dstate = A.shape[1]
    S = start.numel()
    bc = bc[:, 0] if bc.dim() == 4 else bc
    dt = delta.dtype
    delta, x = _unit_time(delta), _unit_time(x.to(dt))
    z = None if forward or z is None else _unit_time(z.to(dt))
    bc = _unit_time(bc if bc.dtype in (dt, torch.float32) else bc.float())
    from ._cuda import kernel_outputs
    with kernel_outputs():   # written in full by the kernel
        sums = torch.empty(S, dim, dstate, device=delta.device, dtype=torch.float32)
        dts = torch.empty(S, dim, device=delta.device, dtype=torch.float32)
    if S:
        ext.segment_sums(bool(forward), delta, None if delta_bias is None else delta_bias.float().contiguous(),
                         A.float().contiguous(), x, z, bc, bool(softplus), start.long().contiguous(),
                         length.long().contiguous(), min(int(max_length), L), sums, dts)
    return sums, dts


def _unit_time(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def piece_sums(forward: bool, delta, delta_bias, A, x, z, bc, softplus: bool, pieces: int, piece: int):
    """:func:`segment_sums` over the pieces of a cut (:func:`piece_spans`): ``(sums (batch, pieces, dim, dstate),
    dt_sums (batch, pieces, dim))``."""
    batch, dim, L = delta.shape
    start, length = piece_spans(batch, L, pieces, piece, delta.device)
    sums, dts = segment_sums(forward, delta, delta_bias, A, x, z, bc, softplus, start, length, piece)
    return sums.view(batch, pieces, dim, -1), dts.view(batch, pieces, dim)


def chain_prefix(sums: torch.Tensor, dt_sums: torch.Tensor, A: torch.Tensor, offsets: torch.Tensor, h0=None,
                 inclusive: bool = True, reverse: bool = False) -> torch.Tensor:
    """:func:`chain_prefix_ref`, by one Triton kernel on CUDA tensors (float32; ``offsets`` an int64 device tensor:
    no wait for the device)."""
    if not _use_triton(sums) or sums.dtype == torch.float64:
        return chain_prefix_ref(sums, dt_sums, A, offsets, h0, inclusive, reverse)
    return _chain_prefix_triton(sums, dt_sums, A, offsets, None, h0, inclusive, reverse)


def _chain_prefix_triton(sums, dt_sums, A, offsets, per_chain, h0, inclusive, reverse):
    """``per_chain``: every chain that many consecutive segments (``offsets`` unused, the chains ``S / per_chain``)."""
    S, dim, dstate = sums.shape
    chains = S // per_chain if per_chain else offsets.numel() - 1
    out = torch.empty_like(sums)   # every segment is in a chain
    if S == 0 or chains == 0:
        return out
    BLOCK = 256
    with _on(sums):
        _chain_prefix_kernel[(triton.cdiv(dim * dstate, BLOCK), chains)](
            sums, dt_sums, A.contiguous(), h0.contiguous() if h0 is not None else sums,
            offsets if offsets is not None else dt_sums, out, dim, dstate, per_chain or 0,
            UNIFORM=bool(per_chain), HAS_H0=h0 is not None, INCLUSIVE=inclusive, REVERSE=reverse, BLOCK=BLOCK,
            num_warps=4)
    return out


def piece_prefix(forward: bool, sums: torch.Tensor, dt_sums: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """:func:`piece_prefix_ref`, by one Triton kernel on CUDA tensors (float32)."""
    if not _use_triton(sums) or sums.dtype == torch.float64:
        return piece_prefix_ref(forward, sums, dt_sums, A)
    batch, pieces = sums.shape[:2]
    out = _chain_prefix_triton(sums.flatten(0, 1), dt_sums.flatten(0, 1), A, None, pieces, None, False, not forward)
    return out.view(sums.shape)


# --------------------------------------------------------------------------------------------------
# what the scan kernels are called with

def forward_states(u, delta, A, B, delta_bias, softplus: bool, pieces: int, piece: int):
    """``(position_ids, state_slots, initial_state)`` for a forward of the scan over rows of one sequence (``u``,
    ``delta`` (batch, dim, seqlen), ``B`` (batch, 1, dstate, seqlen) or (batch, dstate, seqlen), ``A`` (dim, dstate))
    cut into ``pieces`` pieces of ``piece`` timesteps: each piece a sequence that continues from its true initial
    state, slot ``b * pieces + k`` of ``initial_state`` (batch * pieces, dim, dstate)."""
    batch, dim, L = u.shape
    sums, dts = piece_sums(True, delta, delta_bias, A, u, None, B, softplus, pieces, piece)
    init = piece_prefix(True, sums, dts, A).view(batch * pieces, dim, A.shape[1])
    pos, slots = piece_layout(batch, L, pieces, piece, u.device)[:2]
    return pos, slots, init


def backward_states(saved, dout, z, delta, A, C, delta_bias, softplus: bool, pieces: int, piece: int):
    """``(position_ids, state_slots, initial_state, dfinal_state)`` for the backward of :func:`forward_states`' cut:
    the state before each piece read from the forward's ``saved`` chunk states (``piece`` is a multiple of
    ``SCAN_CHUNK``), the gradient entering each piece's end from the pieces after it."""
    batch, dim, L = dout.shape
    dstate = A.shape[1]
    per = piece // SCAN_CHUNK
    init = torch.zeros(batch, pieces, dim, dstate, device=saved.device, dtype=saved.dtype)
    # the state after the last timestep of piece k - 1: chunk k * per - 1
    init[:, 1:] = saved[:, :, per - 1:(pieces - 1) * per:per, :dstate].transpose(1, 2)
    sums, dts = piece_sums(False, delta, delta_bias, A, dout, z, C, softplus, pieces, piece)
    dfinal = piece_prefix(False, sums, dts, A).view(batch * pieces, dim, dstate)
    pos, slots = piece_layout(batch, L, pieces, piece, dout.device)[:2]
    return pos, slots, init.view(batch * pieces, dim, dstate), dfinal
