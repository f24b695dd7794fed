"""Packing-safe depthwise causal conv1d: autograd Function, functional entry, reference.

Each output is a weighted sum of the current and the ``width - 1`` previous inputs of its channel.
In a packed row, tap ``k`` (the input ``k`` steps back) is used at time ``t`` only where
``position_ids[t] >= k``: no tap reaches into the previous sequence::

    x            [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 ]       width = 4
    position_ids [  0  1  2  3  4 |  0  1  2 |  0 ]
    out at b1 = w[3]*b1 + w[2]*b0            (taps 2, 3 would read a4, a3: masked)

Example::

    >>> import torch, ops
    >>> x = torch.randn(2, 8, 12)                       # (batch, dim, seqlen), channel-first
    >>> w = torch.randn(8, 4)                           # (dim, width)
    >>> pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 0]] * 2)
    >>> y = ops.packed_causal_conv1d(x, w, activation="silu", position_ids=pos)
    >>> y_cl = ops.packed_causal_conv1d(x.transpose(1, 2).contiguous().transpose(1, 2), w,
    ...                                 activation="silu", position_ids=pos)  # channel-last
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import backends as _backends
from .boundaries import resolve_position_ids

__all__ = ["packed_causal_conv1d", "causal_conv1d_ref", "PackedCausalConv1dFn"]


def _norm_activation(activation):
    if activation in (None, "silu"):
        return activation
    if activation == "swish":
        return "silu"
    raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _norm_weight(weight: torch.Tensor, dim: int) -> torch.Tensor:
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d depthwise weight (dim, 1, width)
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be (dim={dim}, width) or (dim, 1, width), got {tuple(weight.shape)}")
    return weight


def is_channel_last(x: torch.Tensor) -> bool:
    """(batch, dim, seqlen) stored as (batch, seqlen, dim): ``x.stride(1) == 1``."""
    return x.stride(1) == 1 and not x.is_contiguous()


def _same_layout(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if is_channel_last(like) and not is_channel_last(out):
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    return out


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Pure-PyTorch packed causal conv1d: the oracle, and the CPU / float64 path.

    Same arguments and shapes as :func:`packed_causal_conv1d`. Computes in float32 (float64 for
    float64 inputs), returns ``x``'s dtype and layout. ``validate=False`` skips the boundary check.
    """
    activation = _norm_activation(activation)
    batch, dim, seqlen = x.shape
    weight = _norm_weight(weight, dim)
    width = weight.shape[1]
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=x.device, validate=validate)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(ct)
    w = weight.to(ct)
    out = torch.zeros(batch, dim, seqlen, dtype=ct, device=x.device)
    if bias is not None:
        out = out + bias.to(ct)[:, None]
    for k in range(min(width, seqlen)):
        shifted = F.pad(xc[..., : seqlen - k], (k, 0)) if k else xc
        if pos is not None and k:   # a dropped tap is dropped, not multiplied by zero (inf * 0 would leak)
            shifted = torch.where((pos >= k)[:, None, :], shifted, 0.0)
        out = out + w[:, width - 1 - k, None] * shifted
    if activation == "silu":
        out = F.silu(out)
    return _same_layout(out.to(x.dtype), x)


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """Channel-first contiguous or plain channel-last, as the kernels take."""
    if x.is_contiguous():
        return x
    batch, dim, seqlen = x.shape
    if x.stride(1) == 1 and x.stride(2) == dim and x.stride(0) == dim * seqlen:
        return x
    return x.contiguous()


class PackedCausalConv1dFn(torch.autograd.Function):
    """Autograd Function over the raw-kernel contract (``causal_conv1d_fwd`` / ``_bwd``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, position_ids, activation, kernels):
        x = _kernel_layout(x)
        weight = weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = kernels.causal_conv1d_fwd(x, weight, bias, position_ids, activation)
        ctx.save_for_backward(x, weight, bias, position_ids)
        ctx.activation = activation
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, position_ids = ctx.saved_tensors
        # dout in x's layout
        if is_channel_last(x):
            if not (dout.stride(1) == 1 and dout.stride(2) == dout.shape[1]):
                dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            dout = dout.contiguous()
        dx, dweight, dbias = ctx.kernels.causal_conv1d_bwd(x, weight, bias, dout, position_ids, ctx.activation)
        return dx, dweight, dbias if bias is not None else None, None, None, None


def packed_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv1d over packed rows; no tap crosses a sequence start.

    Args:
        x: (batch, dim, seqlen), channel-first (contiguous) or channel-last (``x.stride(1) == 1``,
            i.e. a transposed (batch, seqlen, dim) tensor). The output has the same layout.
        weight: (dim, width), or nn.Conv1d's depthwise (dim, 1, width). Tap ``k`` (input ``k``
            steps back) is ``weight[:, width - 1 - k]``, as in ``F.conv1d(..., padding=width-1)``.
        bias: (dim,), optional.
        activation: None, ``"silu"`` or ``"swish"`` (= silu), applied after the bias.
        position_ids: (batch, seqlen) integer ids restarting at 0 at every sequence start. Tap ``k``
            at time ``t`` is used only where ``position_ids[t] >= k``.
        seq_idx: (batch, seqlen) segment numbers, the alternative to ``position_ids``. With neither,
            each row is one sequence (plain causal conv).
        backend: ``"cuda" | "upstream" | "reference" | "ref_kernel" | "auto"`` (see ops.backends).
        validate: check the boundaries (one host sync per new boundary tensor).

    Returns:
        (batch, dim, seqlen) in ``x``'s dtype and layout.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, dim, seqlen), got {tuple(x.shape)}")
    activation = _norm_activation(activation)
    batch, dim, seqlen = x.shape
    weight = _norm_weight(weight, dim)
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be (dim={dim},), got {tuple(bias.shape)}")
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=x.device, validate=validate)
    name = _backends.resolve_backend("causal_conv1d", x, backend)
    if name == "reference":
        return causal_conv1d_ref(x, weight, bias, activation, position_ids=pos, validate=False)
    if name == "upstream":
        from . import _upstream

        return _upstream.causal_conv1d(x, weight, bias, activation, pos)
    kernels = _backends.kernels_for("causal_conv1d", name)
    if pos is None:
        from .selective_scan_interface import _no_boundaries

        pos = _no_boundaries(batch, seqlen, x.device)
    return PackedCausalConv1dFn.apply(x, weight, bias, pos, activation, kernels)
