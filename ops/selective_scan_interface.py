"""Packing-safe selective scan (Mamba-1's SSM): autograd Function, functional entry, reference.

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
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import backends as _backends
from .boundaries import resolve_position_ids

__all__ = ["packed_selective_scan", "selective_scan_ref", "PackedSelectiveScanFn", "linear_scan"]


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


def _last_dim_contiguous(t):
    if t is None:
        return None
    return t if t.stride(-1) == 1 and t.is_contiguous() else t.contiguous()


class PackedSelectiveScanFn(torch.autograd.Function):
    """Autograd Function over the raw-kernel contract (``selective_scan_fwd`` / ``_bwd``).

    ``kernels`` is a module implementing that contract (``ops._cuda``, or ``ops._ref_kernels``).
    """

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, position_ids, kernels):
        u, delta, B, C, z = (_last_dim_contiguous(t) for t in (u, delta, B, C, z))
        A = A.contiguous()
        D = D.contiguous() if D is not None else None
        delta_bias = delta_bias.contiguous() if delta_bias is not None else None
        out, saved, out_z = kernels.selective_scan_fwd(
            u, delta, A, B, C, D, z, delta_bias, position_ids, bool(delta_softplus)
        )
        saved_tensors = ()
        ctx.saved_kind = "none"
        if isinstance(saved, torch.Tensor):
            saved_tensors, ctx.saved_kind = (saved,), "tensor"
        elif isinstance(saved, (tuple, list)) and all(isinstance(s, torch.Tensor) for s in saved):
            saved_tensors, ctx.saved_kind = tuple(saved), "tuple"
        else:
            ctx.saved_obj = saved
        ctx.n_saved = len(saved_tensors)
        ctx.delta_softplus = bool(delta_softplus)
        ctx.kernels = kernels
        ctx.has_z = z is not None
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, position_ids, out, *saved_tensors)
        return out_z if z is not None else out

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, position_ids, out, *saved_tensors = ctx.saved_tensors
        if ctx.saved_kind == "tensor":
            saved = saved_tensors[0]
        elif ctx.saved_kind == "tuple":
            saved = tuple(saved_tensors)
        else:
            saved = ctx.saved_obj
        dout = dout.contiguous()
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = ctx.kernels.selective_scan_bwd(
            u, delta, A, B, C, D, z, delta_bias, dout, saved, out, position_ids, ctx.delta_softplus
        )
        return (
            du,
            ddelta,
            dA,
            dB.reshape(B.shape) if dB is not None else None,
            dC.reshape(C.shape) if dC is not None else None,
            dD if D is not None else None,
            dz if z is not None else None,
            ddelta_bias if delta_bias is not None else None,
            None,
            None,
            None,
        )


def _fp32(t):
    """Parameters the kernels take in float32 (float64 is left alone for the reference kernels)."""
    if t is None or t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


_NO_BOUNDARY_CACHE: dict = {}


def _no_boundaries(batch: int, seqlen: int, device) -> torch.Tensor:
    """position_ids of rows that are each one sequence: 0, 1, ..., seqlen-1 (cached)."""
    key = (seqlen, str(device))
    ar = _NO_BOUNDARY_CACHE.get(key)
    if ar is None:
        if len(_NO_BOUNDARY_CACHE) > 16:
            _NO_BOUNDARY_CACHE.clear()
        ar = torch.arange(seqlen, dtype=torch.int32, device=device)
        _NO_BOUNDARY_CACHE[key] = ar
    return ar.unsqueeze(0).expand(batch, seqlen).contiguous()


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
    backend: Optional[str] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Selective scan over packed rows, resetting the state at every sequence start.

    Same shapes and semantics as mamba-ssm's ``selective_scan_fn``, plus the boundaries.

    Args:
        u: (batch, dim, seqlen) input.
        delta: (batch, dim, seqlen) time steps (before ``delta_bias`` / softplus).
        A: (dim, dstate) real state matrix (float32 on the kernel path; usually ``-exp(A_log)``).
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
        backend: ``"cuda" | "reference" | "ref_kernel" | "auto"``; default from
            :func:`ops.set_backend` / ``PACKLOADER_OPS_BACKEND`` / auto.
        validate: check the boundaries (one host sync per new boundary tensor).

    Returns:
        (batch, dim, seqlen) in ``u``'s dtype: ``y (+ D*u) (* silu(z))``.
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
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=u.device, validate=validate)
    name = _backends.resolve_backend("selective_scan", u, backend)
    if name == "reference":
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, position_ids=pos,
                                  validate=False)
    kernels = _backends.kernels_for("selective_scan", name)
    if dstate > getattr(kernels, "_MAX_DSTATE", 1 << 30):
        if (backend or _backends.get_backend("selective_scan")) != "auto":
            raise ValueError(f"backend {name!r}: dstate {dstate} > {kernels._MAX_DSTATE} is not supported")
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, position_ids=pos,
                                  validate=False)
    if pos is None:
        pos = _no_boundaries(batch, seqlen, u.device)
    return PackedSelectiveScanFn.apply(
        u, delta, _fp32(A), B, C, _fp32(D), z, _fp32(delta_bias), delta_softplus, pos, kernels,
    )
