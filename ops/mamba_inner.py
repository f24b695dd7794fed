"""The fused Mamba-1 mixer over packed rows, in one autograd Function (like mamba-ssm's
``mamba_inner_fn``, but starting from the hidden states and resetting at every sequence start).

Forward::

    hidden (b, l, d_model) --in_proj--> x, z (b, d_inner, l)
    x --packed causal conv1d + silu--> xc --x_proj--> [dt_low | B | C] (b, l, dt_rank + 2 d_state)
    dt_low --dt_proj (no bias)--> delta (b, d_inner, l)
    packed selective scan(xc, delta, A, B, C, D, z, delta_bias, softplus) --> y (b, d_inner, l)
    y --out_proj--> out (b, l, d_model)

The backward pass recomputes the conv output and ``delta`` (checkpoint_lvl=1, the default) instead
of keeping them, and takes the scan's gated output (which ``out_proj``'s weight gradient needs) from the scan's
backward, which recomputes it anyway: per layer the forward keeps ``hidden_states``, ``x``, ``z``, ``x_dbl``,
``B``, ``C`` and the scan's chunk states, less than mamba-ssm's ``mamba_inner_fn`` keeps. Every gradient is
written with batched GEMMs (no (b l) transposes of activations).
Boundaries reach both kernels as int32 ``position_ids``. The Function calls the kernel ops (``torch.ops.packloader.*``,
see :mod:`ops.contract`; in plain eager mode on CUDA their implementations directly, :mod:`ops.kernel_calls`), so it
runs on any device (the reference implementations off CUDA) and traces under ``torch.compile`` without graph breaks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import backends as _backends
from . import conv1d_interface as _conv_ops
from . import kernel_calls
from .boundaries import resolve_position_ids, shared_row_positions
from .conv1d_interface import packed_causal_conv1d
from .selective_scan_interface import packed_selective_scan

__all__ = ["packed_mamba_inner_fn", "packed_mamba_inner_ref", "PackedMambaInnerFn"]


def _bmm_w(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(m, k) @ (b, k, n) -> (b, m, n), contiguous output, the weight broadcast (batch stride 0)."""
    return torch.bmm(w.unsqueeze(0).expand(x.shape[0], *w.shape), x)


def _wgrad(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """sum over the batch of a[i] @ b[i]: (b, m, k) x (b, k, n) -> (m, n) in ``out_dtype`` (into ``out`` if given).

    16-bit CUDA inputs: one GEMM per batch row, each adding into one float32 sum in its epilogue (``out_dtype``
    GEMMs): no (b, m, n) product, no reduction kernel, no cast when the weight is float32 (autocast with float32
    master weights), and no rounding to 16 bits in between. Elsewhere, and under ``torch.compile`` (torch 2.11's
    fake-tensor rule for ``addmm`` with ``out_dtype`` raises a TypeError in Dynamo): a batched product summed in
    float32."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and not torch.compiler.is_compiling():
        f32 = out_dtype == torch.float32
        acc = out if (out is not None and f32) else torch.empty(a.shape[1], b.shape[2], dtype=torch.float32,
                                                                device=a.device)
        torch.mm(a[0], b[0], out_dtype=torch.float32, out=acc)
        for i in range(1, a.shape[0]):
            torch.addmm(acc, a[i], b[i], out_dtype=torch.float32, out=acc)
    elif a.shape[0] == 1:
        acc = a[0] @ b[0]
    else:
        acc = torch.bmm(a, b).sum(0, dtype=torch.float32 if a.dtype != torch.float64 else None)
    if out is None:
        return acc.to(out_dtype)
    if acc is not out:
        out.copy_(acc)
    return out


def _wgrad_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """a @ b, (m, k) x (k, n) -> (m, n) in ``out_dtype`` (into ``out`` if given): a weight gradient as one GEMM over
    the batch's tokens (``k = b * L``). 16-bit CUDA inputs: the GEMM's float32 result itself (``out_dtype`` GEMM), no
    rounding to 16 bits and no cast for float32 weights. Elsewhere, and under ``torch.compile`` (see
    :func:`_wgrad`): a plain product, cast."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and not torch.compiler.is_compiling():
        if out is not None and out_dtype == torch.float32:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        acc = torch.mm(a, b, out_dtype=torch.float32)
    else:
        acc = a @ b
    if out is None:
        return acc.to(out_dtype)
    out.copy_(acc)
    return out


def _channel_major(m: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """A ``(d, batch * seqlen)`` matrix seen as the ``(batch, d, seqlen)`` activation it holds (a view; channel-major,
    :func:`ops.contract.is_channel_major`)."""
    return m.view(m.shape[0], batch, seqlen).transpose(0, 1)


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """A ``(batch, d, seqlen)`` activation as the ``(d, batch * seqlen)`` matrix of its channels (a view when it is
    channel-major, else a copy)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _autocast_weights(dev, hidden_states, in_proj_weight, in_proj_bias, x_proj_weight, delta_proj_weight,
                      out_proj_weight, out_proj_bias):
    """Under autocast (CUDA in training, CPU alike) the activations and the projection weights in its one dtype."""
    if not torch.is_autocast_enabled(dev):
        return hidden_states, in_proj_weight, in_proj_bias, x_proj_weight, delta_proj_weight, out_proj_weight, \
            out_proj_bias
    dt_ = torch.get_autocast_dtype(dev)
    cast = lambda t: None if t is None else t.to(dt_)  # noqa: E731
    return tuple(cast(t) for t in (hidden_states, in_proj_weight, in_proj_bias, x_proj_weight, delta_proj_weight,
                                   out_proj_weight, out_proj_bias))


def _in_proj(hidden_states, in_proj_weight, in_proj_bias, d_inner):
    """x, z (b, d_inner, l) contiguous, from (b, l, d_model) hidden states."""
    hT = hidden_states.transpose(1, 2)  # (b, d_model, l) view
    x = _bmm_w(in_proj_weight[:d_inner], hT)
    z = _bmm_w(in_proj_weight[d_inner:], hT)
    if in_proj_bias is not None:
        x = x + in_proj_bias[:d_inner, None].to(x.dtype)
        z = z + in_proj_bias[d_inner:, None].to(z.dtype)
    return x, z


def _x_proj_backward(dB, dC, ddelta, dxc, x_dbl, xc, x_proj_weight, delta_proj_weight, w_dtype_xp, w_dtype_dt):
    """(dx_proj_weight, ddelta_proj_weight, dxc): x_proj's and dt_proj's gradients from the scan's dB, dC, ddelta;
    x_proj's input gradient added into the scan's dxc."""
    batch, seqlen = x_dbl.shape[:2]
    dt_rank = delta_proj_weight.shape[1]
    d_state = (x_dbl.shape[2] - dt_rank) // 2
    dx_dbl = torch.empty_like(x_dbl)  # (b, l, r + 2n)
    dx_dbl[..., dt_rank:dt_rank + d_state] = dB.reshape(batch, d_state, seqlen).transpose(1, 2)
    dx_dbl[..., dt_rank + d_state:] = dC.reshape(batch, d_state, seqlen).transpose(1, 2)
    ddelta = ddelta.to(x_dbl.dtype)
    ddelta_proj_weight = _wgrad(ddelta, x_dbl[..., :dt_rank], w_dtype_dt)  # (d_inner, r)
    dx_dbl[..., :dt_rank] = torch.bmm(ddelta.transpose(1, 2), delta_proj_weight.unsqueeze(0).expand(batch, -1, -1))
    dx_proj_weight = _wgrad(dx_dbl.transpose(1, 2), xc.transpose(1, 2), w_dtype_xp)  # (r+2n, d_inner)
    # in place (the out-of-place form copies its input first): dxc is the backward's own tensor
    dxc = dxc.to(xc.dtype)
    dxc.baddbmm_(x_proj_weight.t().unsqueeze(0).expand(batch, -1, -1), dx_dbl.transpose(1, 2))
    return dx_proj_weight, ddelta_proj_weight, dxc


def _in_proj_backward(dx, dz, hidden_states, in_proj_weight, w_dtype_in, has_in_bias):
    """(dhidden, din_proj_weight, din_proj_bias) from the gradients of x and z."""
    batch = hidden_states.shape[0]
    d_inner = dx.shape[1]
    din_proj_weight = torch.empty(in_proj_weight.shape, dtype=w_dtype_in, device=dx.device)
    _wgrad(dx, hidden_states, w_dtype_in, out=din_proj_weight[:d_inner])
    _wgrad(dz, hidden_states, w_dtype_in, out=din_proj_weight[d_inner:])
    dhidden = torch.bmm(dx.transpose(1, 2), in_proj_weight[:d_inner].unsqueeze(0).expand(batch, -1, -1))
    dhidden.baddbmm_(dz.transpose(1, 2), in_proj_weight[d_inner:].unsqueeze(0).expand(batch, -1, -1))
    din_proj_bias = torch.cat([dx.sum(dim=(0, 2)), dz.sum(dim=(0, 2))]).to(w_dtype_in) if has_in_bias else None
    return dhidden, din_proj_weight, din_proj_bias


class PackedMambaInnerFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden_states,
        in_proj_weight,
        in_proj_bias,
        conv1d_weight,
        conv1d_bias,
        x_proj_weight,
        delta_proj_weight,
        out_proj_weight,
        out_proj_bias,
        A,
        D,
        delta_bias,
        position_ids,
        delta_softplus,
        checkpoint_lvl,
    ):
        dev = hidden_states.device.type
        # the gradients' dtypes: the parameters' own (float32 master weights under autocast), not the compute dtype
        ctx.dtypes = (in_proj_weight.dtype, conv1d_weight.dtype, x_proj_weight.dtype, delta_proj_weight.dtype,
                      out_proj_weight.dtype, hidden_states.dtype)
        (hidden_states, in_proj_weight, in_proj_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
         out_proj_bias) = _autocast_weights(dev, hidden_states, in_proj_weight, in_proj_bias, x_proj_weight,
                                            delta_proj_weight, out_proj_weight, out_proj_bias)
        batch, seqlen, d_model = hidden_states.shape
        d_inner = in_proj_weight.shape[0] // 2
        dt_rank = delta_proj_weight.shape[1]
        d_state = A.shape[1]
        width = conv1d_weight.shape[-1]
        # channel-major activations (ops/contract.py): x, z, the conv's and the scan's outputs each one (d_inner,
        # batch * seqlen) matrix, so that every projection and weight gradient is one GEMM over all tokens
        hidden_states = hidden_states.contiguous()
        h2 = hidden_states.view(batch * seqlen, d_model)
        xz = torch.mm(in_proj_weight, h2.t())  # (2 d_inner, b l)
        if in_proj_bias is not None:
            xz = xz + in_proj_bias[:, None].to(xz.dtype)
        x = _channel_major(xz[:d_inner], batch, seqlen)  # (b, d_inner, l) views
        z = _channel_major(xz[d_inner:], batch, seqlen)
        cw = conv1d_weight.reshape(d_inner, width).contiguous()
        cb = conv1d_bias.contiguous() if conv1d_bias is not None else None
        # the conv's boundary words, made once for its forward, its recomputation and its backward
        runmask = _conv_ops.runmask_for(x, cw, position_ids)
        xc = kernel_calls.causal_conv1d_fwd(x, cw, cb, position_ids, True, runmask)  # x's layout
        x_dbl = torch.mm(_matrix(xc).t(), x_proj_weight.t())  # (b l, r + 2n)
        delta = _channel_major(torch.mm(delta_proj_weight, x_dbl[:, :dt_rank].t()), batch, seqlen)
        Bm = x_dbl[:, dt_rank:dt_rank + d_state].view(batch, seqlen, d_state).transpose(1, 2).contiguous()  # (b, n, l)
        Cm = x_dbl[:, dt_rank + d_state:].view(batch, seqlen, d_state).transpose(1, 2).contiguous()
        out_z, saved, _ = kernel_calls.selective_scan_fwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, position_ids, bool(delta_softplus)
        )
        y = torch.mm(_matrix(out_z).t(), out_proj_weight.t())  # (b l, d_model)
        if out_proj_bias is not None:
            y = y + out_proj_bias.to(y.dtype)
        y = y.view(batch, seqlen, d_model)
        ctx.delta_softplus = bool(delta_softplus)
        ctx.checkpoint_lvl = checkpoint_lvl
        ctx.has_in_bias, ctx.has_out_bias, ctx.has_conv_bias = (
            in_proj_bias is not None, out_proj_bias is not None, conv1d_bias is not None)
        ctx.has_D, ctx.has_db = D is not None, delta_bias is not None
        ctx.conv_shape = conv1d_weight.shape
        if checkpoint_lvl >= 1:
            xc_saved, delta_saved = None, None
        else:
            xc_saved, delta_saved = xc, delta
        ctx.save_for_backward(
            hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight,
            out_proj_weight, A, Bm, Cm, D, delta_bias, position_ids, saved, xc_saved, delta_saved, runmask,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        (hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight,
         out_proj_weight, A, Bm, Cm, D, delta_bias, position_ids, saved, xc, delta, runmask) = ctx.saved_tensors
        dt_rank = delta_proj_weight.shape[1]
        w_dtype_in, w_dtype_conv, w_dtype_xp, w_dtype_dt, w_dtype_out, h_dtype = ctx.dtypes
        batch, seqlen, d_model = hidden_states.shape
        d_inner, d_state = x.shape[1], A.shape[1]
        dy = dy.contiguous().to(x.dtype)
        dy2 = dy.view(batch * seqlen, d_model)
        h2 = hidden_states.view(batch * seqlen, d_model)
        if xc is None:
            xc = kernel_calls.causal_conv1d_fwd(x, cw, cb, position_ids, True, runmask)
            delta = _channel_major(torch.mm(delta_proj_weight, x_dbl[:, :dt_rank].t()), batch, seqlen)
        # out_proj
        dout_y = _channel_major(torch.mm(out_proj_weight.t(), dy2.t()), batch, seqlen)  # (b, d_inner, l)
        dout_proj_bias = dy2.sum(0) if ctx.has_out_bias else None
        # scan; it recomputes the forward's out_z (not kept from the forward: one (b, d_inner, l) less per layer)
        dxc, ddelta, dA, dB, dC, dD, dz, ddelta_bias, out_z, _ = kernel_calls.selective_scan_bwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, position_ids, ctx.delta_softplus, saved, dout_y, True
        )
        dout_proj_weight = _wgrad_mm(dy2.t(), _matrix(out_z).t(), w_dtype_out)  # (d_model, d_inner)
        del out_z
        # x_proj / dt_proj
        dx_dbl = torch.empty_like(x_dbl)  # (b l, r + 2n)
        rows = dx_dbl.view(batch, seqlen, -1)
        rows[..., dt_rank:dt_rank + d_state] = dB.reshape(batch, d_state, seqlen).transpose(1, 2)
        rows[..., dt_rank + d_state:] = dC.reshape(batch, d_state, seqlen).transpose(1, 2)
        ddelta2 = _matrix(ddelta.to(x_dbl.dtype))  # (d_inner, b l)
        ddelta_proj_weight = _wgrad_mm(ddelta2, x_dbl[:, :dt_rank], w_dtype_dt)  # (d_inner, r)
        dx_dbl[:, :dt_rank] = torch.mm(ddelta2.t(), delta_proj_weight)
        xc2 = _matrix(xc)
        dx_proj_weight = _wgrad_mm(dx_dbl.t(), xc2.t(), w_dtype_xp)  # (r + 2n, d_inner)
        # x_proj's input gradient added in place into the scan's (channel-major: its matrix is a view)
        dxc = dxc.to(xc.dtype)
        dxc2 = _matrix(dxc)
        dxc2.addmm_(x_proj_weight.t(), dx_dbl.t())
        dxc = _channel_major(dxc2, batch, seqlen)
        # conv
        dx, dcw, dcb = kernel_calls.causal_conv1d_bwd(x, cw, cb, position_ids, True, dxc, runmask)
        # in_proj
        dx2, dz2 = _matrix(dx), _matrix(dz.to(z.dtype))
        din_proj_weight = torch.empty(in_proj_weight.shape, dtype=w_dtype_in, device=dx.device)
        _wgrad_mm(dx2, h2, w_dtype_in, out=din_proj_weight[:d_inner])
        _wgrad_mm(dz2, h2, w_dtype_in, out=din_proj_weight[d_inner:])
        dhidden = torch.mm(dx2.t(), in_proj_weight[:d_inner])  # (b l, d_model)
        dhidden.addmm_(dz2.t(), in_proj_weight[d_inner:])
        dhidden = dhidden.view(batch, seqlen, d_model)
        din_proj_bias = torch.cat([dx2.sum(1), dz2.sum(1)]).to(w_dtype_in) if ctx.has_in_bias else None
        return (
            dhidden.to(h_dtype),
            din_proj_weight,
            din_proj_bias,
            dcw.reshape(ctx.conv_shape).to(w_dtype_conv),
            (dcb.to(cb.dtype) if ctx.has_conv_bias else None),
            dx_proj_weight,
            ddelta_proj_weight,
            dout_proj_weight,
            dout_proj_bias,
            dA,
            dD if ctx.has_D else None,
            ddelta_bias if ctx.has_db else None,
            None, None, None,
        )


def _fp32(t):
    if t is None or t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


def packed_mamba_inner_ref(
    hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight,
    delta_proj_weight, out_proj_weight, out_proj_bias, A, D=None, delta_bias=None,
    delta_softplus=True, *, position_ids=None, seq_idx=None, backend=None, validate=True,
):
    """The same computation composed from the functional ops (``F.linear``, :func:`ops.packed_causal_conv1d`,
    :func:`ops.packed_selective_scan`; torch autograd between them): the non-fused path of
    :class:`ops.PackedMamba`, and a check of the fused Function."""
    batch, seqlen, _ = hidden_states.shape
    d_inner = in_proj_weight.shape[0] // 2
    dt_rank = delta_proj_weight.shape[1]
    d_state = A.shape[1]
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=hidden_states.device, validate=validate)
    xz = F.linear(hidden_states, in_proj_weight, in_proj_bias).transpose(1, 2)  # (b, 2 d_inner, l)
    x, z = xz[:, :d_inner], xz[:, d_inner:]
    xc = packed_causal_conv1d(x, conv1d_weight, conv1d_bias, "silu", position_ids=pos, backend=backend,
                              validate=False)
    x_dbl = F.linear(xc.transpose(1, 2), x_proj_weight)  # (b, l, r + 2n)
    dt_low, Bm, Cm = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    delta = F.linear(dt_low, delta_proj_weight).transpose(1, 2)  # (b, d_inner, l)
    y = packed_selective_scan(
        xc, delta, A, Bm.transpose(1, 2), Cm.transpose(1, 2), D, z, delta_bias, delta_softplus,
        position_ids=pos, backend=backend, validate=False,
    )
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def packed_mamba_inner_fn(
    hidden_states: torch.Tensor,
    in_proj_weight: torch.Tensor,
    in_proj_bias: Optional[torch.Tensor],
    conv1d_weight: torch.Tensor,
    conv1d_bias: Optional[torch.Tensor],
    x_proj_weight: torch.Tensor,
    delta_proj_weight: torch.Tensor,
    out_proj_weight: torch.Tensor,
    out_proj_bias: Optional[torch.Tensor],
    A: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = True,
    *,
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    checkpoint_lvl: int = 1,
    backend: Optional[str] = None,
    validate: bool = True,
) -> torch.Tensor:
    """The whole Mamba-1 mixer on packed rows in one autograd Function (the kernel ops inside: the compiled
    kernels on CUDA tensors, the reference elsewhere).

    Args:
        hidden_states: (batch, seqlen, d_model).
        in_proj_weight: (2 * d_inner, d_model); rows ``[:d_inner]`` make x, ``[d_inner:]`` make z.
        in_proj_bias: (2 * d_inner,) or None.
        conv1d_weight: (d_inner, 1, d_conv) (nn.Conv1d depthwise) or (d_inner, d_conv).
        conv1d_bias: (d_inner,) or None.
        x_proj_weight: (dt_rank + 2 * d_state, d_inner).
        delta_proj_weight: (d_inner, dt_rank) (``dt_proj.weight``; its bias is ``delta_bias``).
        out_proj_weight: (d_model, d_inner); out_proj_bias: (d_model,) or None.
        A: (d_inner, d_state) float32 (``-exp(A_log)``); D: (d_inner,) float32 or None.
        delta_bias: (d_inner,) float32 or None; delta_softplus: softplus on delta + delta_bias.
        position_ids / seq_idx: (batch, seqlen) boundaries (see :mod:`ops.boundaries`).
        checkpoint_lvl: 1 recomputes the conv output and delta in the backward pass; 0 keeps them.
        backend: None (by device) or ``"reference"`` for this call's forward (prefer
            ``with ops.use_backend("reference"):`` around forward and backward).
        validate: check the boundaries (one host sync; skipped under ``torch.compile``).

    Returns:
        (batch, seqlen, d_model).
    """
    batch, seqlen, _ = hidden_states.shape
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=hidden_states.device, validate=validate)
    if pos is None:   # each row one sequence: the shared ids (no kernels to make them; the scan runs rows whole)
        pos = shared_row_positions(batch, seqlen, hidden_states.device)
    args = (hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight,
            delta_proj_weight, out_proj_weight, out_proj_bias, _fp32(A), _fp32(D), _fp32(delta_bias),
            pos, delta_softplus, checkpoint_lvl)
    if backend is None or backend == "auto":
        return PackedMambaInnerFn.apply(*args)
    with _backends.use_backend_for_call(backend):
        return PackedMambaInnerFn.apply(*args)
