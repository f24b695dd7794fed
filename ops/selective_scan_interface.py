"""Packing-safe selective scan (Mamba-1's SSM): the custom ops, the functional entry, the reference.

The scan runs, for every channel ``d`` and state index ``n``::

    h[t] = exp(delta[t] * A[d, n]) * h[t-1] + delta[t] * B[n, t] * u[t]
    y[t] = sum_n C[n, t] * h[t, n]  (+ D[d] * u[t])  (* silu(z[t]))

and in a packed row the state is reset to zero at every sequence start (``position_ids == 0``), so
no sequence sees another's state, in the forward or the backward pass::

    u            [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | pad ]
    position_ids [  0  1  2  3  4 |  0  1  2 |  0  1  2 |  0  ]
    state        [ h0 ...      h4 | 0-> ...  | 0-> ...  | 0-> ]   (h <- 0 before every 0)

Example::

    >>> import torch, ops
    >>> b, d, n, L = 1, 4, 3, 12
    >>> u, delta = torch.randn(b, d, L), torch.rand(b, d, L)
    >>> A = -torch.rand(d, n); B, C = torch.randn(b, n, L), torch.randn(b, n, L)
    >>> pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 0]])
    >>> y = ops.packed_selective_scan(u, delta, A, B, C, position_ids=pos)

The kernel ops ``torch.ops.packloader.selective_scan_fwd`` / ``selective_scan_bwd`` (their contract: see
:mod:`ops.contract`) are registered here: the reference implementation (every device but CUDA), the CUDA
implementation (``ops._cuda``), the fake implementation and the autograd formula.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import backends as _backends
from . import time_split
from .boundaries import PackedBoundaries, resolve_for_op, resolve_position_ids, single_sequence_rows
from .states import check_state, row_edge_slots, state_slots, token_slots
from .contract import (OP_TAGS, SCAN_BLOCK_CHANNELS, SCAN_CHUNK, SCAN_LANES, is_channel_major, scan_blocks,
                       scan_bwd_segments,
                       scan_chunks, scan_fwd_segments)

__all__ = ["packed_selective_scan", "selective_scan_ref", "linear_scan", "selective_scan_fwd", "selective_scan_bwd"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int = 2, method: str = "auto",
                reset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inclusive scan of ``h[t] = a[t] * h[t-1] + b[t]`` along ``dim`` (``h[-1] = 0``), out of place,
    differentiable by torch autograd.

    ``reset``: optional bool tensor broadcastable to ``a``; where it is set, ``h[t] = b[t]`` and the carried state
    is dropped, not multiplied by zero, so not even an inf or NaN state (nor its gradient) crosses the reset.
    ``method="sequential"``: the plain loop over time (the obviously-correct oracle);
    ``"parallel"``: Hillis-Steele doubling, ceil(log2 L) whole-tensor steps;
    ``"auto"``: sequential for L <= 32, else parallel.
    """
    L = a.shape[dim]
    if reset is not None:
        reset = torch.broadcast_to(reset, torch.broadcast_shapes(reset.shape, a.shape))
    if method == "auto":
        method = "sequential" if L <= 32 else "parallel"
    if method == "sequential":
        a_t, b_t = a.unbind(dim), b.unbind(dim)
        r_t = reset.unbind(dim) if reset is not None else None
        hs = []
        h = torch.zeros_like(b_t[0]) if L else None
        for t in range(L):
            if r_t is None:
                h = a_t[t] * h + b_t[t]
            else:
                h = torch.where(r_t[t], b_t[t], a_t[t] * torch.where(r_t[t], 0.0, h) + b_t[t])
            hs.append(h)
        return torch.stack(hs, dim) if hs else b.clone()
    if method != "parallel":
        raise ValueError(f"unknown method {method!r}")
    a = a.movedim(dim, -1)
    b = b.movedim(dim, -1)
    r = reset.movedim(dim, -1) if reset is not None else None
    shift = 1
    while shift < L:
        a_prev = F.pad(a[..., :-shift], (shift, 0), value=1.0)
        b_prev = F.pad(b[..., :-shift], (shift, 0), value=0.0)
        if r is None:
            b = a * b_prev + b
            a = a * a_prev
        else:
            # r: a reset lies within this element's span; then what came before it is dropped
            r_prev = F.pad(r[..., :-shift], (shift, 0), value=False)
            b = torch.where(r, b, a * torch.where(r, 0.0, b_prev) + b)
            a = torch.where(r, a, a * a_prev)
            r = r | r_prev
        shift *= 2
    return b.movedim(-1, dim)


def _expand_groups(X: torch.Tensor, dim: int) -> torch.Tensor:
    """(batch, n, L) -> (batch, 1, n, L); (batch, g, n, L) -> (batch, dim, n, L)."""
    if X.dim() == 3:
        return X.unsqueeze(1)
    g = X.shape[1]
    if dim % g:
        raise ValueError(f"dim {dim} is not a multiple of the number of groups {g}")
    return X.repeat_interleave(dim // g, dim=1)


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    method: str = "auto",
    validate: bool = True,
):
    """Pure-PyTorch packed selective scan: the oracle, and the CPU / float64 path.

    Same arguments and shapes as :func:`packed_selective_scan`. Computes in float32 (float64 for
    float64 inputs) and returns ``u``'s dtype. ``return_last_state`` returns ``(out, last_state)``
    with ``last_state`` (batch, dim, dstate) the state after the last token (of the last sequence
    of each row). ``method`` picks the time scan (see :func:`linear_scan`). ``validate=False`` skips
    the boundary check (for callers that already resolved and validated them).
    """
    dtype_in = u.dtype
    ct = _compute_dtype(u.dtype)
    batch, dim, seqlen = u.shape
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=u.device, validate=validate)
    u_ = u.to(ct)
    dt = delta.to(ct)
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    A_ = A.to(ct)
    Bx = _expand_groups(B.to(ct), dim)  # (batch, dim|1, n, L)
    Cx = _expand_groups(C.to(ct), dim)
    # (batch, dim, L, n)
    dA = torch.exp(dt.unsqueeze(-1) * A_[:, None, :])
    dBu = (dt * u_).unsqueeze(-1) * Bx.transpose(-1, -2)
    # the state restarts where a sequence starts (dropped, not multiplied by zero: an inf cannot cross either)
    reset = (pos == 0)[:, None, :, None] if pos is not None else None
    h = linear_scan(dA, dBu, dim=2, method=method, reset=reset)
    y = (h * Cx.transpose(-1, -2)).sum(-1)  # (batch, dim, L)
    if D is not None:
        y = y + D.to(ct)[:, None] * u_
    if z is not None:
        y = y * F.silu(z.to(ct))
    out = y.to(dtype_in)
    if return_last_state:
        return out, h[:, :, -1]
    return out


# ----------------------------------------------------------------------------------------------------------------
# The kernel ops (contract: ops/contract.py)

def _absent(like: torch.Tensor) -> torch.Tensor:
    """Stands in for the gradient of an optional input that was not given (custom ops cannot return None)."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


def _fresh(t: torch.Tensor, dtype: torch.dtype, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` copied into a new tensor of ``dtype``, contiguous or with the layout of the outputs of ``like`` (the
    strides the fake implementation promises)."""
    out = _new_like(like, dtype) if like is not None else torch.empty(t.shape, dtype=dtype, device=t.device)
    out.copy_(t)
    return out


def _out_strides(u: torch.Tensor) -> Tuple[int, ...]:
    """The strides of the scan's ``(b, d, L)`` outputs for input ``u`` (ops/contract.py): ``u``'s where it is
    channel-major, else contiguous."""
    if is_channel_major(u) and not u.is_contiguous():
        return tuple(u.stride())
    b, d, L = u.shape
    return (d * L, L, 1)


def _new_like(u: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An empty ``(b, d, L)`` output of the scan for input ``u`` (:func:`_out_strides`)."""
    return torch.empty_strided(u.shape, _out_strides(u), dtype=dtype or u.dtype, device=u.device)


def _as_layout(t: Optional[torch.Tensor], u: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` (``u``'s shape) laid out as the scan's outputs for ``u``: itself where it is, else a copy (the kernels
    take every ``(b, d, L)`` tensor of a call in one layout)."""
    if t is None:
        return None
    want = _out_strides(u)
    if all(n <= 1 or s == w for n, s, w in zip(t.shape, t.stride(), want)):
        return t
    out = _new_like(u, t.dtype)
    out.copy_(t)
    return out


def _lanes(dstate: int) -> int:
    return SCAN_LANES if dstate <= SCAN_LANES else dstate


def _token_states(states: torch.Tensor, slots: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """states[slots[b, t]] laid out (batch, dim, L, dstate) in ``ct``, zero where ``slots < 0``."""
    got = states.to(ct)[slots.long().clamp(min=0)]            # (batch, L, dim, dstate)
    got = torch.where((slots >= 0)[..., None, None], got, 0.0)
    return got.permute(0, 2, 1, 3)


def _scan_terms(u, delta, A, B, C, delta_bias, position_ids, delta_softplus, state_slots=None, initial_state=None):
    """The forward's intermediate values (compute dtype; state layout (batch, dim, L, dstate)). With an initial state
    a sequence's first step is ``h = dA h0 + dt B u`` (the carried state dropped, h0 put in its place): ``h0_tok``
    holds h0 at those tokens (else None)."""
    ct = _compute_dtype(u.dtype)
    dim = u.shape[1]
    u_ = u.to(ct)
    dt_raw = delta.to(ct)
    if delta_bias is not None:
        dt_raw = dt_raw + delta_bias.to(ct)[:, None]
    dt = F.softplus(dt_raw) if delta_softplus else dt_raw
    A_ = A.to(ct)
    Bx = _expand_groups(B.to(ct), dim).transpose(-1, -2)  # (batch, dim|1, L, n)
    Cx = _expand_groups(C.to(ct), dim).transpose(-1, -2)
    dA = torch.exp(dt.unsqueeze(-1) * A_[:, None, :])  # (batch, dim, L, n)
    dtu = dt * u_
    reset = (position_ids == 0)[:, None, :, None]  # (batch, 1, L, 1)
    x = dtu.unsqueeze(-1) * Bx
    h0_tok = None
    if initial_state is not None:
        h0_tok = _token_states(initial_state, state_slots[0], ct)
        x = x + dA * h0_tok
    h = linear_scan(dA, x, dim=2, reset=reset)
    return ct, u_, dt_raw, dt, A_, Bx, Cx, dA, dtu, reset, h, h0_tok


def _final_states(h: torch.Tensor, state_slots: Optional[torch.Tensor], num_final_states: int,
                  like: torch.Tensor) -> torch.Tensor:
    """final_state (num_final_states, dim, dstate), float32 (float64 for float64 inputs): h at the tokens of
    state_slots[1] (zeros elsewhere); an empty (0,) tensor when none is asked for."""
    if not num_final_states:
        return _absent(like)
    batch, dim, L, n = h.shape
    ct = _compute_dtype(like.dtype)
    final = torch.zeros(num_final_states, dim, n, dtype=ct, device=h.device)
    mask = state_slots[1] >= 0
    final[state_slots[1][mask].long()] = h.permute(0, 2, 1, 3)[mask].to(ct)
    return final


def _scan_fwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots=None,
                        initial_state=None, num_final_states=0):
    """The reference implementation of ``selective_scan_fwd`` (pure PyTorch, any float dtype)."""
    batch, dim, L = u.shape
    if state_slots is not None:
        state_slots = token_slots(state_slots, L)
    dstate = A.shape[1]
    ct, u_, _, _, _, _, Cx, _, _, _, h, _ = _scan_terms(u, delta, A, B, C, delta_bias, position_ids, delta_softplus,
                                                        state_slots, initial_state)
    y = (h * Cx).sum(-1)
    if D is not None:
        y = y + D.to(ct)[:, None] * u_
    if z is not None:
        y = y * F.silu(z.to(ct))
    nchunks = scan_chunks(L)
    saved = torch.zeros(batch, dim, nchunks, _lanes(dstate), dtype=torch.float32, device=u.device)
    if nchunks:
        ends = (torch.arange(1, nchunks + 1, device=u.device) * SCAN_CHUNK).clamp(max=L) - 1
        saved[..., :dstate] = h[:, :, ends].to(torch.float32)
    return _fresh(y, u.dtype, u), saved, _final_states(h, state_slots, num_final_states, u)


def _reduce_groups(X: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(batch, dim, L, n) summed over the channels that share a B/C group -> ``like``'s shape."""
    batch, dim, L, n = X.shape
    if like.dim() == 3:
        return X.sum(1).transpose(-1, -2)
    g = like.shape[1]
    return X.reshape(batch, g, dim // g, L, n).sum(2).transpose(-1, -2)


def _scan_bwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, saved, dout,
                        recompute_out=False, state_slots=None, initial_state=None, dfinal_state=None):
    """The reference implementation of ``selective_scan_bwd``: the forward recomputed, then the adjoint state
    scanned backwards in time, dropped (not multiplied by zero) where the forward dropped the state. A final
    state's gradient enters the adjoint at its sequence's last token; an initial state's gradient is the adjoint
    its sequence's first step hands back (``dA gh``)."""
    if state_slots is not None:
        state_slots = token_slots(state_slots, u.shape[2])
    ct, u_, dt_raw, dt, A_, Bx, Cx, dA, dtu, reset, h, h0_tok = _scan_terms(
        u, delta, A, B, C, delta_bias, position_ids, delta_softplus, state_slots, initial_state)
    y = (h * Cx).sum(-1)
    if D is not None:
        y = y + D.to(ct)[:, None] * u_
    g = dout.to(ct)
    dz = None
    out = y
    if z is not None:
        z_ = z.to(ct)
        sig = torch.sigmoid(z_)
        dz = g * y * sig * (1 + z_ * (1 - sig))
        g = g * z_ * sig
        out = y * F.silu(z_)   # as the forward computes it
    # adjoint of the state: gh[t] = g[t] C[t] + dA[t+1] gh[t+1], dropped where a sequence starts at t+1
    a_next = torch.cat([dA[:, :, 1:], torch.zeros_like(dA[:, :, :1])], dim=2)
    r_next = torch.cat([reset[:, :, 1:], torch.ones_like(reset[:, :, :1])], dim=2)
    gy = g.unsqueeze(-1) * Cx
    if dfinal_state is not None and dfinal_state.numel() and state_slots is not None:
        gy = gy + _token_states(dfinal_state, state_slots[1], ct)
    gh = linear_scan(a_next.flip(2), gy.flip(2), dim=2, reset=r_next.flip(2)).flip(2)
    h_prev = torch.cat([torch.zeros_like(h[:, :, :1]), h[:, :, :-1]], dim=2)
    dinit = _absent(u)
    if h0_tok is None:
        g_dA = torch.where(reset, 0.0, gh * h_prev)  # the decay is not used where the state was dropped
    else:
        init = (state_slots[0] >= 0)[:, None, :, None]
        h_prev = torch.where(init, h0_tok, h_prev)   # a continued sequence's first step decays its initial state
        g_dA = torch.where(reset & ~init, 0.0, gh * h_prev)
        dinit = torch.zeros(initial_state.shape, dtype=ct, device=u.device)
        mask = state_slots[0] >= 0
        dinit[state_slots[0][mask].long()] = (gh * dA).permute(0, 2, 1, 3)[mask]
        dinit = _fresh(dinit, initial_state.dtype)
    g_dtu = (gh * Bx).sum(-1)
    ddt = (g_dA * dA * A_[:, None, :]).sum(-1) + g_dtu * u_
    du = g_dtu * dt
    dD = None
    if D is not None:
        du = du + D.to(ct)[:, None] * g
        dD = (g * u_).sum((0, 2))
    dA_param = (g_dA * dA * dt.unsqueeze(-1)).sum((0, 2))
    dB = _reduce_groups(gh * dtu.unsqueeze(-1), B)
    dC = _reduce_groups(g.unsqueeze(-1) * h, C)
    ddelta = ddt * torch.sigmoid(dt_raw) if delta_softplus else ddt
    return (
        _fresh(du, u.dtype, u), _fresh(ddelta, delta.dtype, u), _fresh(dA_param, A.dtype), _fresh(dB, B.dtype),
        _fresh(dC, C.dtype),
        _fresh(dD, D.dtype) if D is not None else _absent(u),
        _fresh(dz, z.dtype, u) if z is not None else _absent(u),
        _fresh(ddelta.sum((0, 2)), delta_bias.dtype) if delta_bias is not None else _absent(u),
        _fresh(out, u.dtype, u) if recompute_out else _absent(u),
        dinit,
    )


# --- the CUDA implementation: prepares the kernel's inputs, allocates its outputs, launches ---------------------

def _f32(t):
    return None if t is None else t.float().contiguous()


def _bc(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """B/C to contiguous (batch, n_groups, dstate, seqlen) in u's dtype or float32."""
    if t.dim() == 3:
        t = t.unsqueeze(1)
    if t.dtype != torch.float32 and t.dtype != u.dtype:
        t = t.to(u.dtype)
    return t.contiguous()


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of the GPU the kernels run on (how many segments a small grid gets: ops/contract.py); the
    132 of an H100 / H200 for tensors elsewhere (the CPU tests of this glue)."""
    if device.type != "cuda":
        return 132
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _segments(plan, u: torch.Tensor, pos: torch.Tensor) -> int:
    """The segments a row is cut into (``plan``: ``scan_fwd_segments`` / ``scan_bwd_segments`` of ops/contract.py),
    1 where every row is known to be one sequence (nothing to cut at: a plan of K would leave K - 1 segments empty
    and give the one that runs the layout of a K-times larger grid)."""
    if single_sequence_rows(pos):
        return 1
    batch, dim, seqlen = u.shape
    return plan(batch, dim, seqlen, _sm_count(u.device))


def _time_split(which: str, u: torch.Tensor, pos: torch.Tensor, B: torch.Tensor, slots) -> Optional[Tuple[int, int]]:
    """``(pieces, piece)`` where a call cuts its rows along time (:mod:`ops.time_split`): no carried states, every
    row known to be one sequence, one B/C group, a grid the plan would cut (``which``: "fwd" / "bwd"), Triton."""
    if slots is not None or B.shape[1] != 1 or not time_split.HAS_TRITON or u.device.type != "cuda":
        return None
    if not single_sequence_rows(pos):
        return None
    batch, dim, seqlen = u.shape
    return time_split.split_plan(which, batch, dim, seqlen, _sm_count(u.device))


def _group_slices(dim: int, n_groups: int):
    """A kernel block owns SCAN_BLOCK_CHANNELS channels that must share a group; otherwise the kernel runs group
    by group."""
    per = dim // n_groups
    if n_groups == 1 or per % SCAN_BLOCK_CHANNELS == 0:
        return None
    return [(g * per, (g + 1) * per) for g in range(n_groups)]


def _channels(t: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    """Channels a..b of a state (slots, dim, dstate), contiguous (None stays None)."""
    return None if t is None else t[:, a:b].contiguous()


def _kernel_layout(u: torch.Tensor) -> torch.Tensor:
    """``u`` where the kernels take its layout (contiguous or channel-major), else a contiguous copy."""
    return u if u.is_contiguous() or is_channel_major(u) else u.contiguous()


def _scan_fwd_kernel(ext, u, delta, A, B, C, D, z, delta_bias, pos, softplus, slots=None, h0=None, num_final=0):
    """(out, saved, final_state or None) from the compiled kernel; B/C (batch, n_groups, dstate, seqlen), the rest
    prepared; slots / h0: the carried states (int32 (2, batch, seqlen) / float32 (slots, dim, dstate))."""
    slices = _group_slices(u.shape[1], B.shape[1])
    if slices is not None:
        parts = [_scan_fwd_kernel(ext, u[:, a:b], delta[:, a:b], A[a:b], B[:, g:g + 1].contiguous(),
                                  C[:, g:g + 1].contiguous(),
                                  None if D is None else D[a:b], None if z is None else z[:, a:b],
                                  None if delta_bias is None else delta_bias[a:b], pos, softplus, slots,
                                  _channels(h0, a, b), num_final)
                 for g, (a, b) in enumerate(slices)]
        final = torch.cat([p[2] for p in parts], 1) if num_final else None
        return _as_layout(torch.cat([p[0] for p in parts], 1), u), torch.cat([p[1] for p in parts], 1), final
    from ._cuda import kernel_outputs

    u = _kernel_layout(u)
    delta, z = _as_layout(delta, u), _as_layout(z, u)
    batch, dim, seqlen = u.shape
    with kernel_outputs():   # written in full by the kernel
        out = _new_like(u)
        saved = torch.empty(batch, dim, scan_chunks(seqlen), SCAN_LANES, device=u.device, dtype=torch.float32)
    # a final-state slot that no sequence ends in stays zero
    final = torch.zeros(num_final, dim, A.shape[1], device=u.device, dtype=torch.float32) if num_final else None
    if u.numel() > 0:
        cut = _time_split("fwd", u, pos, B, slots)
        if cut is not None:   # rows of one sequence on a small grid: cut along time (ops/time_split.py)
            pieces, piece = cut
            pos_c, slots_c, init = time_split.forward_states(u, delta, A, B, delta_bias, softplus, pieces, piece)
            lanes = time_split.fwd_lanes(batch * pieces, dim, _sm_count(u.device))
            ext.scan_fwd(u, delta, A, B, C, D, z, delta_bias, pos_c, bool(softplus), out, saved, pieces, lanes,
                         slots_c, init, None)
        else:
            segments = _segments(scan_fwd_segments, u, pos)
            ext.scan_fwd(u, delta, A, B, C, D, z, delta_bias, pos, bool(softplus), out, saved, segments, 0,
                         slots, h0, final)
    return out, saved, final


def _state_args(state_slots, z, seqlen: int):
    """The kernels' slots: None for the plain scan (no state read or written). Row-edge slots (2, batch) take the
    kernels' row-edge variant, compiled for the gated scan (``z`` given: the Mamba mixer's); without ``z`` they go
    per token."""
    if state_slots is None:
        return None
    if state_slots.dim() == 2 and z is None:
        state_slots = token_slots(state_slots, seqlen)
    return state_slots.to(torch.int32).contiguous()


def _scan_fwd_cuda(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots=None,
                   initial_state=None, num_final_states=0):
    if _backends.implementation("selective_scan", "cuda", u.dtype, dstate=A.shape[1]) == "reference":
        return _scan_fwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots,
                                   initial_state, num_final_states)
    ext = _backends.load_kernels()
    Bk, Ck = _bc(B, u), _bc(C, u)
    if Ck.dtype != Bk.dtype:
        Ck = Ck.to(Bk.dtype)
    pos = position_ids.to(torch.int32).contiguous()
    slots = _state_args(state_slots, z, u.shape[2])
    out, saved, final = _scan_fwd_kernel(ext, u, delta.to(u.dtype), _f32(A), Bk, Ck, _f32(D),
                                         None if z is None else z.to(u.dtype), _f32(delta_bias), pos, delta_softplus,
                                         slots, _f32(initial_state) if slots is not None else None,
                                         num_final_states if slots is not None else 0)
    return out, saved, final if final is not None else _absent(u)


def _scan_bwd_kernel(ext, u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved, dout, recompute_out,
                     slots=None, h0=None, dfinal=None):
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, out, dinitial_state) from the kernel: dB/dC (batch, n_groups,
    dstate, seqlen) float32, dA/dD/ddelta_bias float32, None for absent inputs (and for out unless
    ``recompute_out``; dinitial_state without h0)."""
    slices = _group_slices(u.shape[1], B.shape[1])
    if slices is not None:
        parts = []
        for g, (a, b) in enumerate(slices):
            sl = slice(a, b)
            parts.append(_scan_bwd_kernel(
                ext, u[:, sl], delta[:, sl], A[sl], B[:, g:g + 1].float().contiguous(),
                C[:, g:g + 1].float().contiguous(),
                None if D is None else D[sl], None if z is None else z[:, sl],
                None if delta_bias is None else delta_bias[sl], pos, softplus, saved[:, sl], dout[:, sl],
                recompute_out, slots, _channels(h0, a, b), _channels(dfinal, a, b)))
        cat = lambda i, d: None if parts[0][i] is None else torch.cat([p[i] for p in parts], d)  # noqa: E731
        act = lambda i: _as_layout(cat(i, 1), u)  # noqa: E731   (b, d, L): the outputs' layout
        return (act(0), act(1), cat(2, 0), cat(3, 1), cat(4, 1), cat(5, 0), act(6), cat(7, 0), act(8), cat(9, 1))
    from ._cuda import kernel_outputs

    u = _kernel_layout(u)
    delta, dout, z = _as_layout(delta, u), _as_layout(dout, u), _as_layout(z, u)
    with kernel_outputs():   # written in full by the kernel
        du = _new_like(u)
        ddelta = _new_like(u)
        dz = _new_like(u) if z is not None else None
        out = _new_like(u) if recompute_out else None
    batch, dim, seqlen = u.shape
    # an initial-state slot that no sequence starts from gets a zero gradient
    dinit = torch.zeros(h0.shape, device=u.device, dtype=torch.float32) if h0 is not None else None
    # rows of one sequence on a small grid: cut along time (ops/time_split.py), each piece from the forward's state
    # before it, with the gradient that enters its end from the pieces after it
    cut = _time_split("bwd", u, pos, B, slots) if u.numel() > 0 else None
    if cut is not None:
        segments, piece = cut
        pos, slots, h0, dfinal = time_split.backward_states(saved, dout, z, delta, A, C, delta_bias, softplus,
                                                            segments, piece)
        with kernel_outputs():   # written by the kernel, not used
            dinit_cut = torch.empty(h0.shape, device=u.device, dtype=torch.float32)
    else:
        segments = _segments(scan_bwd_segments, u, pos)
    # dA / dD / ddelta_bias come per (batch row, segment) and are summed here (no atomics: the same bits every run)
    rows = batch * segments
    dA = torch.zeros((rows,) + tuple(A.shape), device=u.device, dtype=torch.float32)
    dD = torch.zeros(rows, dim, device=u.device, dtype=torch.float32) if D is not None else None
    ddb = torch.zeros(rows, dim, device=u.device, dtype=torch.float32) if delta_bias is not None else None
    # dB / dC: added into zeros with float atomics (their last bits vary from run to run), or in deterministic mode
    # stored per channel block (the blocks of a B/C group are consecutive: _group_slices) and summed here over the
    # group's blocks in a fixed order. The slots cost 2 * dstate * seqlen floats per block of SCAN_BLOCK_CHANNELS
    # channels (for bf16 u and dstate 16: 4x the size of u), for the length of this call.
    deterministic = torch.are_deterministic_algorithms_enabled()
    det_part = None
    if deterministic:
        with kernel_outputs():
            det_part = torch.empty(batch, scan_blocks(dim), 2, B.shape[2], u.shape[2], device=u.device,
                                   dtype=torch.float32)
        dB, dC = (torch.empty(0, device=u.device, dtype=torch.float32) for _ in range(2))   # not written
    else:
        dB = torch.zeros(B.shape, device=u.device, dtype=torch.float32)
        dC = torch.zeros(C.shape, device=u.device, dtype=torch.float32)
    if u.numel() > 0:
        # the kernel recomputes the forward output (it needs it for dz) and writes it to out when asked
        ext.scan_bwd(u, delta, A, B, C, D, z, delta_bias, pos, bool(softplus), saved.contiguous(), dout, out,
                     du, ddelta, dz, dA, dB, dC, dD, ddb, det_part, segments, slots, h0, dfinal,
                     dinit if cut is None else dinit_cut)
    if deterministic:
        n_groups = B.shape[1]
        slots = det_part.view(batch, n_groups, det_part.shape[1] // n_groups, 2, *det_part.shape[3:])
        dB, dC = slots[:, :, :, 0].sum(2), slots[:, :, :, 1].sum(2)   # two tensors: a custom op's outputs never alias
    return (du, ddelta, dA.sum(0), dB, dC, None if dD is None else dD.sum(0), dz,
            None if ddb is None else ddb.sum(0), out, dinit)


def _scan_bwd_cuda(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, saved, dout,
                   recompute_out=False, state_slots=None, initial_state=None, dfinal_state=None):
    if _backends.implementation("selective_scan", "cuda", u.dtype, dstate=A.shape[1]) == "reference":
        return _scan_bwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, saved, dout,
                                   recompute_out, state_slots, initial_state, dfinal_state)
    ext = _backends.load_kernels()
    Bk, Ck = _bc(B, u), _bc(C, u)
    if Ck.dtype != Bk.dtype:
        Ck = Ck.to(Bk.dtype)
    pos = position_ids.to(torch.int32).contiguous()
    slots = _state_args(state_slots, z, u.shape[2])
    du, ddelta, dA, dB, dC, dD, dz, ddb, out, dinit = _scan_bwd_kernel(
        ext, u, delta.to(u.dtype), _f32(A), Bk, Ck, _f32(D), None if z is None else z.to(u.dtype),
        _f32(delta_bias), pos, delta_softplus, saved, dout.to(u.dtype), recompute_out, slots,
        _f32(initial_state) if slots is not None else None,
        _f32(dfinal_state) if slots is not None and dfinal_state is not None and dfinal_state.numel() else None)
    return (
        du, ddelta.to(delta.dtype), dA.to(A.dtype), dB.reshape(B.shape).to(B.dtype), dC.reshape(C.shape).to(C.dtype),
        dD.to(D.dtype) if D is not None else _absent(u),
        dz.to(z.dtype) if z is not None else _absent(u),
        ddb.to(delta_bias.dtype) if delta_bias is not None else _absent(u),
        out if out is not None else _absent(u),
        dinit.to(initial_state.dtype) if dinit is not None else _absent(u),
    )


# --- registration ------------------------------------------------------------------------------------------------

@torch.library.custom_op("packloader::selective_scan_fwd", mutates_args=(), device_types=None, tags=OP_TAGS)
def selective_scan_fwd(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    position_ids: torch.Tensor, delta_softplus: bool, state_slots: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None, num_final_states: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed selective scan forward -> (out, saved, final_state); see :mod:`ops.contract`. This body is the
    reference implementation, used on every device but CUDA."""
    return _scan_fwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots,
                               initial_state, num_final_states)


selective_scan_fwd.register_kernel("cuda")(_scan_fwd_cuda)


@selective_scan_fwd.register_fake
def _scan_fwd_fake(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots=None,
                   initial_state=None, num_final_states=0):
    batch, dim, seqlen = u.shape
    out = _new_like(u)
    saved = u.new_empty((batch, dim, scan_chunks(seqlen), _lanes(A.shape[1])), dtype=torch.float32)
    final = (u.new_empty((num_final_states, dim, A.shape[1]), dtype=_compute_dtype(u.dtype)) if num_final_states
             else _absent(u))
    return out, saved, final


@torch.library.custom_op("packloader::selective_scan_bwd", mutates_args=(), device_types=None, tags=OP_TAGS)
def selective_scan_bwd(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], delta_bias: Optional[torch.Tensor],
    position_ids: torch.Tensor, delta_softplus: bool, saved: torch.Tensor, dout: torch.Tensor,
    recompute_out: bool = False, state_slots: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None, dfinal_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed selective scan backward -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, out, dinitial_state); see
    :mod:`ops.contract`. This body is the reference implementation, used on every device but CUDA."""
    return _scan_bwd_reference(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, saved, dout,
                               recompute_out, state_slots, initial_state, dfinal_state)


selective_scan_bwd.register_kernel("cuda")(_scan_bwd_cuda)


@selective_scan_bwd.register_fake
def _scan_bwd_fake(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, saved, dout,
                   recompute_out=False, state_slots=None, initial_state=None, dfinal_state=None):
    like = lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)  # noqa: E731
    absent = lambda t: like(t) if t is not None else _absent(u)  # noqa: E731
    return (_new_like(u), _new_like(u, delta.dtype), like(A), like(B), like(C), absent(D),
            _new_like(u, z.dtype) if z is not None else _absent(u), absent(delta_bias),
            _new_like(u) if recompute_out else _absent(u), absent(initial_state))


def _scan_setup_context(ctx, inputs, output):
    (u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus, state_slots, initial_state,
     num_final_states) = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, position_ids, output[1], state_slots, initial_state)
    ctx.delta_softplus = delta_softplus
    ctx.mark_non_differentiable(output[1])


def _scan_backward(ctx, dout, _dsaved, dfinal_state):
    u, delta, A, B, C, D, z, delta_bias, position_ids, saved, state_slots, initial_state = ctx.saved_tensors
    if state_slots is None:
        dfinal_state = None
    du, ddelta, dA, dB, dC, dD, dz, ddb, _, dinit = selective_scan_bwd(
        u, delta, A, B, C, D, z, delta_bias, position_ids, ctx.delta_softplus, saved, dout, False, state_slots,
        initial_state, dfinal_state)
    return (du, ddelta, dA, dB, dC, dD if D is not None else None, dz if z is not None else None,
            ddb if delta_bias is not None else None, None, None, None,
            dinit if initial_state is not None else None, None)


selective_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# The functional entry

def _fp32(t):
    """Parameters the kernels take in float32 (float64 is left alone for the reference)."""
    if t is None or t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


def _last_dim_contiguous(t):
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


def packed_selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    *,
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    backend: Optional[str] = None,
    validate: bool = True,
    boundaries: Optional[PackedBoundaries] = None,
):
    """Selective scan over packed rows, resetting the state at every sequence start.

    Same shapes and semantics as mamba-ssm's ``selective_scan_fn``, plus the boundaries. Runs the
    ``packloader::selective_scan_fwd`` op (the compiled kernel on CUDA tensors, the reference elsewhere: see
    :mod:`ops.backends`); differentiable; traceable by ``torch.compile`` without graph breaks.

    Args:
        u: (batch, dim, seqlen) input.
        delta: (batch, dim, seqlen) time steps (before ``delta_bias`` / softplus).
        A: (dim, dstate) real state matrix (usually ``-exp(A_log)``); the kernel takes ``dstate <= 16``.
        B: (batch, dstate, seqlen), or grouped (batch, n_groups, dstate, seqlen) with
            ``dim % n_groups == 0`` (channel ``d`` uses group ``d // (dim // n_groups)``).
        C: same shapes as ``B``.
        D: (dim,) skip connection, added as ``D * u``; optional.
        z: (batch, dim, seqlen) gate: the output is multiplied by ``silu(z)``; optional.
        delta_bias: (dim,) added to ``delta`` before the softplus; optional.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        position_ids: (batch, seqlen) integer ids restarting at 0 at every sequence start (as the
            loader emits). The state is zeroed where ``position_ids == 0``.
        seq_idx: (batch, seqlen) segment numbers, the alternative to ``position_ids``. With neither,
            each row is one sequence (plain ``selective_scan_fn``).
        initial_state: (num_sequences, dim, dstate), float32 (float64 on the reference): the state ``h`` before
            each sequence's first token, sequences numbered in ``cu_seqlens`` order (row-major, every segment of
            every row; see :mod:`ops.states`). A sequence starts from it where ``has_initial_state`` is set, from
            zero elsewhere. Differentiable: its gradient is returned by the backward.
        has_initial_state: (num_sequences,) bool: which sequences continue from ``initial_state``; default all
            (when ``initial_state`` is given). Without ``initial_state`` it only gives the number of sequences (what
            ``output_final_state`` under ``torch.compile`` needs: counting them would sync).
        output_final_state: also return the state after each sequence's last token, (num_sequences, dim, dstate)
            float32 (float64 for float64 inputs), in the layout ``initial_state`` takes (a piece's final state is its continuation's initial
            state). Differentiable: a gradient flowing into it reaches every input.
        backend: None (by device) or ``"reference"``: this call's forward runs the reference (the backward
            follows :func:`ops.use_backend` when it runs; prefer ``with ops.use_backend("reference"):`` around
            forward and backward). Not under ``torch.compile``.
        validate: check the boundaries (one host sync; skipped under ``torch.compile``).
        boundaries: a :class:`ops.PackedBoundaries` resolved once for the batch, instead of ``position_ids`` /
            ``seq_idx``: no conversion and no check on this call (with ``count=True`` there, ``output_final_state``
            needs no count either).

    Returns:
        (batch, dim, seqlen) in ``u``'s dtype, contiguous: ``y (+ D*u) (* silu(z))``; with ``output_final_state``
        the pair ``(out, final_state)``.

    Raises:
        ValueError: shapes that do not fit together (a state of the wrong shape, dtype or device, or a number of
            states that is not the number of sequences). ops.backends.KernelUnsupportedError: a CUDA case the
            kernel cannot take (float64, dstate > 16), with how to run the reference instead.
    """
    if u.dim() != 3:
        raise ValueError(f"u must be (batch, dim, seqlen), got {tuple(u.shape)}")
    batch, dim, seqlen = u.shape
    if delta.shape != u.shape:
        raise ValueError(f"delta {tuple(delta.shape)} must have u's shape {tuple(u.shape)}")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must be (dim={dim}, dstate), got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, X in (("B", B), ("C", C)):
        ok = (X.dim() == 3 and X.shape == (batch, dstate, seqlen)) or (
            X.dim() == 4 and X.shape[0] == batch and X.shape[2:] == (dstate, seqlen) and dim % X.shape[1] == 0
        )
        if not ok:
            raise ValueError(
                f"{name} must be (batch, dstate, seqlen) = {(batch, dstate, seqlen)} or "
                f"(batch, n_groups, dstate, seqlen) with dim % n_groups == 0, got {tuple(X.shape)}"
            )
    if z is not None and z.shape != u.shape:
        raise ValueError(f"z {tuple(z.shape)} must have u's shape {tuple(u.shape)}")
    for name, v in (("D", D), ("delta_bias", delta_bias)):
        if v is not None and v.shape != (dim,):
            raise ValueError(f"{name} must be (dim={dim},), got {tuple(v.shape)}")
    pos, seq_idx, validate, boundaries = resolve_for_op("packed_selective_scan", position_ids, seq_idx, boundaries,
                                                        batch, seqlen, u.device, validate)
    args = (_last_dim_contiguous(u), _last_dim_contiguous(delta), _fp32(A), _last_dim_contiguous(B),
            _last_dim_contiguous(C), _fp32(D), _last_dim_contiguous(z), _fp32(delta_bias), pos, bool(delta_softplus))
    if initial_state is not None or output_final_state:
        num = _num_sequences(pos, initial_state, has_initial_state, validate, boundaries)
        if initial_state is not None:
            check_state("initial_state", initial_state, (num, dim, dstate),
                        (torch.float64,) if u.dtype == torch.float64 else (torch.float32,), u.device)
        flags = None
        if initial_state is not None:   # default: every sequence starts from its state
            flags = has_initial_state if has_initial_state is not None else torch.ones(num, dtype=torch.bool,
                                                                                        device=pos.device)
        if single_sequence_rows(pos):   # known without a sync: the states sit at row edges (the plain loops)
            slots = row_edge_slots(batch, flags, output_final_state, pos.device)
        else:
            slots = state_slots(pos, flags, output_final_state)
        args = args + (slots, initial_state, num if output_final_state else 0)
    if backend is None or backend == "auto":
        res = selective_scan_fwd(*args)
    else:
        with _backends.use_backend_for_call(backend):
            res = selective_scan_fwd(*args)
    return (res[0], res[2]) if output_final_state else res[0]


def _num_sequences(pos: torch.Tensor, initial_state: Optional[torch.Tensor],
                   has_initial_state: Optional[torch.Tensor], validate: bool, boundaries=None) -> int:
    """The number of sequences the states are indexed by: initial_state's first dim (or has_initial_state's), checked
    against the sequence starts in ``pos`` when validating (one host sync); else the count a
    :class:`ops.PackedBoundaries` holds; else counted (one host sync)."""
    given = [t.shape[0] for t in (initial_state, has_initial_state) if t is not None]
    if boundaries is not None and boundaries.num_sequences is not None:
        if given and given[0] != boundaries.num_sequences:
            raise ValueError(f"the states are indexed by sequence: {given[0]} given, but the boundaries hold "
                             f"{boundaries.num_sequences} sequences")
        if not given:
            return boundaries.num_sequences
    if has_initial_state is not None and has_initial_state.dim() != 1:
        raise ValueError(f"has_initial_state must be (num_sequences,), got {tuple(has_initial_state.shape)}")
    if given and len(set(given)) > 1:
        raise ValueError(f"initial_state has {given[0]} sequences but has_initial_state {given[1]}")
    if given and (not validate or torch.compiler.is_compiling()):
        return given[0]
    if torch.compiler.is_compiling():
        raise ValueError("output_final_state under torch.compile needs the number of sequences without a host sync: "
                         "pass has_initial_state (num_sequences,) (all False for none) or initial_state")
    count = int((pos == 0).sum())
    if given and given[0] != count:
        raise ValueError(f"the states are indexed by sequence: {given[0]} given, but the rows hold {count} sequences "
                         "(starts where position_ids == 0, padding tails included)")
    return count
