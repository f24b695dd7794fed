"""Compiled CUDA kernels of ``ops``: packed selective scan and packed causal conv1d (forward and backward).

Nothing here builds at import time: ``load()`` returns the extension, installed ahead of time or built just in
time on first use (``ops._build`` says how).  The raw functions below take and return tensors; autograd lives in the ``*_interface.py`` modules.
"""
from __future__ import annotations

import torch

from . import _build
from .contract import CONV_SLOT_STEPS, MAX_DSTATE as _MAX_DSTATE, SCAN_CHUNK as _CHUNK, SCAN_LANES as _LANES


def is_available() -> bool:
    """A CUDA device is present and the extension is installed, built or buildable. Never raises."""
    return _build.can_load()


def load():
    """The extension module (``ops._C`` if installed, else built just in time; see ``ops._build``)."""
    return _build.load_extension()


# ----------------------------------------------------------------------------------------------------------------
# helpers

def _pos32(position_ids: torch.Tensor, batch: int, seqlen: int, device) -> torch.Tensor:
    if position_ids.shape != (batch, seqlen):
        raise ValueError(f"position_ids must be (batch, seqlen)=({batch}, {seqlen}), got {tuple(position_ids.shape)}")
    return position_ids.to(device=device, dtype=torch.int32).contiguous()


def _f32(t):
    return None if t is None else t.float().contiguous()


def _bc(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """B/C to contiguous (batch, n_groups, dstate, seqlen) in u's dtype or fp32."""
    if t.dim() == 3:
        t = t.unsqueeze(1)
    if t.dtype != torch.float32 and t.dtype != u.dtype:
        t = t.to(u.dtype)
    return t.contiguous()


def _group_slices(dim: int, n_groups: int):
    """Kernel blocks own 16 channels that must share a group; otherwise run group by group."""
    per = dim // n_groups
    if n_groups == 1 or per % 16 == 0:
        return None
    return [(g * per, (g + 1) * per) for g in range(n_groups)]


# ----------------------------------------------------------------------------------------------------------------
# selective scan

def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus):
    """Packed selective scan forward. Returns (out, saved, out_z); see module docstring of the contract."""
    ext = load()
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    if dstate > _MAX_DSTATE:
        raise ValueError(f"packloader ops: dstate {dstate} > {_MAX_DSTATE} is not supported by the CUDA scan")
    u = u.contiguous()
    delta = delta.to(u.dtype).contiguous()
    z = None if z is None else z.to(u.dtype).contiguous()
    A = _f32(A)
    D = _f32(D)
    delta_bias = _f32(delta_bias)
    B = _bc(B, u)
    C = _bc(C, u)
    if C.dtype != B.dtype:
        C = C.to(B.dtype)
    pos = _pos32(position_ids, batch, seqlen, u.device)
    slices = _group_slices(dim, B.shape[1])
    if slices is not None:
        return _fwd_by_group(u, delta, A, B, C, D, z, delta_bias, pos, delta_softplus, slices)
    nchunks = max(1, (seqlen + _CHUNK - 1) // _CHUNK)
    out = torch.empty_like(u)
    out_z = torch.empty_like(u) if z is not None else None
    saved = torch.empty(batch, dim, nchunks, _LANES, device=u.device, dtype=torch.float32)
    if u.numel() > 0:
        ext.scan_fwd(u, delta, A, B, C, D, z, delta_bias, pos, bool(delta_softplus), out, out_z, saved)
    return out, saved, out_z


def _fwd_by_group(u, delta, A, B, C, D, z, delta_bias, pos, softplus, slices):
    outs, saveds, ozs = [], [], []
    for g, (a, b) in enumerate(slices):
        o, s, oz = selective_scan_fwd(
            u[:, a:b], delta[:, a:b], A[a:b], B[:, g:g + 1], C[:, g:g + 1], None if D is None else D[a:b],
            None if z is None else z[:, a:b], None if delta_bias is None else delta_bias[a:b], pos, softplus)
        outs.append(o); saveds.append(s); ozs.append(oz)
    return torch.cat(outs, 1), torch.cat(saveds, 1), (None if z is None else torch.cat(ozs, 1))


def selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, out, position_ids, delta_softplus):
    """Returns (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)."""
    ext = load()
    batch, dim, seqlen = u.shape
    B_in, C_in, delta_dtype = B, C, delta.dtype
    u = u.contiguous()
    delta = delta.to(u.dtype).contiguous()
    z = None if z is None else z.to(u.dtype).contiguous()
    A32 = _f32(A)
    D32 = _f32(D)
    db32 = _f32(delta_bias)
    B = _bc(B, u)
    C = _bc(C, u)
    if C.dtype != B.dtype:
        C = C.to(B.dtype)
    pos = _pos32(position_ids, batch, seqlen, u.device)
    dout = dout.to(u.dtype).contiguous()
    out = None  # the kernel recomputes the forward output for dz; `out` is accepted for the common contract
    slices = _group_slices(dim, B.shape[1])
    if slices is not None:
        res = _bwd_by_group(u, delta, A32, B, C, D32, z, db32, dout, saved, out, pos, delta_softplus, slices)
    else:
        du = torch.empty_like(u)
        ddelta = torch.empty_like(u)
        dz = torch.empty_like(u) if z is not None else None
        # dA / dD / ddelta_bias come per batch row and are summed here (no atomics: the same bits every run)
        dA = torch.zeros((batch,) + tuple(A32.shape), device=u.device, dtype=torch.float32)
        dB = torch.zeros(B.shape, device=u.device, dtype=torch.float32)
        dC = torch.zeros(C.shape, device=u.device, dtype=torch.float32)
        dD = torch.zeros(batch, dim, device=u.device, dtype=torch.float32) if D32 is not None else None
        ddb = torch.zeros(batch, dim, device=u.device, dtype=torch.float32) if db32 is not None else None
        # deterministic mode: dB / dC added by the channel blocks in a fixed order (tickets), else with atomics
        det_sem = (torch.zeros(batch, saved.shape[2], device=u.device, dtype=torch.int32)
                   if torch.are_deterministic_algorithms_enabled() else None)
        if u.numel() > 0:
            ext.scan_bwd(u, delta, A32, B, C, D32, z, db32, pos, bool(delta_softplus), saved.contiguous(), dout, out,
                         du, ddelta, dz, dA, dB, dC, dD, ddb, det_sem)
        res = (du, ddelta, dA.sum(0), dB, dC, None if dD is None else dD.sum(0), dz, None if ddb is None else ddb.sum(0))
    du, ddelta, dA, dB, dC, dD, dz, ddb = res
    if B_in.dim() == 3:
        dB = dB.squeeze(1)
    if C_in.dim() == 3:
        dC = dC.squeeze(1)
    return (du, ddelta.to(delta_dtype), dA, dB.to(B_in.dtype), dC.to(C_in.dtype), dD, dz, ddb)


def _bwd_by_group(u, delta, A, B, C, D, z, delta_bias, dout, saved, out, pos, softplus, slices):
    parts = []
    for g, (a, b) in enumerate(slices):
        sl = slice(a, b)
        parts.append(selective_scan_bwd(
            u[:, sl], delta[:, sl], A[sl], B[:, g:g + 1].float(), C[:, g:g + 1].float(),
            None if D is None else D[sl], None if z is None else z[:, sl],
            None if delta_bias is None else delta_bias[sl], dout[:, sl], saved[:, sl],
            None if out is None else out[:, sl], pos, softplus))
    cat = lambda i, d: None if parts[0][i] is None else torch.cat([p[i] for p in parts], d)  # noqa: E731
    return (cat(0, 1), cat(1, 1), cat(2, 0), cat(3, 1), cat(4, 1), cat(5, 0), cat(6, 1), cat(7, 0))


# ----------------------------------------------------------------------------------------------------------------
# causal conv1d

def _conv_layout(x: torch.Tensor) -> torch.Tensor:
    b, d, l = x.shape
    if x.stride(1) == 1 and x.stride(2) == d and x.stride(0) == d * l and d > 1:
        return x   # dense channel-last, i.e. (batch, seqlen, dim) memory
    return x.contiguous()


def _like_layout(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t with x's memory layout (channel-first contiguous or channel-last)."""
    if x.is_contiguous():
        return t.contiguous()
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def causal_conv1d_fwd(x, weight, bias, position_ids, activation):
    ext = load()
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    if not 2 <= width <= 4:
        raise ValueError(f"conv width must be 2..4, got {width}")
    x = _conv_layout(x)
    w = weight.reshape(dim, width).float().contiguous()
    b = _f32(bias)
    pos = _pos32(position_ids, batch, seqlen, x.device)
    out = torch.empty_like(x)   # preserves x's layout
    if out.stride() != x.stride():
        out = _like_layout(torch.empty(x.shape, device=x.device, dtype=x.dtype), x)
    if x.numel() > 0:
        ext.conv_fwd(x, w, b, pos, activation is not None, out)
    return out


def causal_conv1d_bwd(x, weight, bias, dout, position_ids, activation):
    ext = load()
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    x = _conv_layout(x)
    w = weight.reshape(dim, width).float().contiguous()
    b = _f32(bias)
    pos = _pos32(position_ids, batch, seqlen, x.device)
    dout = _like_layout(dout.to(x.dtype), x)
    dx = torch.empty_like(x)
    if dx.stride() != x.stride():
        dx = _like_layout(torch.empty(x.shape, device=x.device, dtype=x.dtype), x)
    # per-block partials of [dweight | dbias], summed here in a fixed order (no atomics: the same bits every run)
    slots = batch * max(1, -(-seqlen // CONV_SLOT_STEPS))
    dw_part = torch.zeros(slots, dim, width + 1, device=x.device, dtype=torch.float32)
    if x.numel() > 0:
        ext.conv_bwd(x, w, b, pos, activation is not None, dout, dx, dw_part)
    dw = dw_part.sum(0)
    dbias = dw[:, width].contiguous() if bias is not None else None
    return dx, dw[:, :width].reshape(weight.shape), dbias
