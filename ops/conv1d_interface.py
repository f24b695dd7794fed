"""Packing-safe depthwise causal conv1d: the custom ops, the functional entry, the reference.

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

The kernel ops ``torch.ops.packloader.causal_conv1d_fwd`` / ``causal_conv1d_bwd`` / ``conv_runmask`` (their
contract: see :mod:`ops.contract`) are registered here: the reference implementation (every device but CUDA), the
CUDA implementation (``ops._cuda``), the fake implementation and the autograd formula.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import backends as _backends
from .boundaries import PackedBoundaries, TensorMemo, resolve_for_op, resolve_position_ids
from .states import check_state, sequence_spans
from .contract import CONV_MASK_RUN, CONV_SLOT_STEPS, OP_TAGS, conv_mask_stride, is_channel_major

__all__ = ["packed_causal_conv1d", "causal_conv1d_ref", "conv_runmask", "causal_conv1d_fwd", "causal_conv1d_bwd",
           "conv_states_fwd", "conv_states_bwd"]


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
    return _zero_padding(_same_layout(out.to(x.dtype), x), seq_idx)


# ----------------------------------------------------------------------------------------------------------------
# The kernel ops (contract: ops/contract.py)

def _is_dense_channel_last(x: torch.Tensor) -> bool:
    batch, dim, seqlen = x.shape
    # (a batch of one may have any batch stride: a slice of a longer row is dense too)
    return dim > 1 and x.stride(1) == 1 and x.stride(2) == dim and (batch == 1 or x.stride(0) == dim * seqlen)


def kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when channel-first contiguous or dense channel-last (the layouts the op takes), else a
    channel-first contiguous copy."""
    if x.is_contiguous() or _is_dense_channel_last(x):
        return x
    return x.contiguous()


def _check_layout(x: torch.Tensor) -> None:
    if x.dim() != 3 or not (x.is_contiguous() or _is_dense_channel_last(x) or is_channel_major(x)):
        raise ValueError(
            f"packloader::causal_conv1d: x must be (batch, dim, seqlen), channel-first contiguous, dense "
            f"channel-last or channel-major, got shape {tuple(x.shape)} strides {x.stride()} "
            "(ops.packed_causal_conv1d copies other layouts)")


def _like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor with x's shape, dtype and strides."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _absent(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=like.device)


def _check_runmask(x: torch.Tensor, runmask: Optional[torch.Tensor]) -> None:
    """The same check on every implementation (reference, fake, CUDA): a given runmask has conv_runmask's shape."""
    if runmask is None:
        return
    batch, _, seqlen = x.shape
    if runmask.dtype != torch.int16 or tuple(runmask.shape) != (batch, conv_mask_stride(seqlen)):
        raise ValueError(f"packloader::causal_conv1d: runmask must be packloader::conv_runmask(position_ids), int16 "
                         f"({batch}, {conv_mask_stride(seqlen)}); got {runmask.dtype} {tuple(runmask.shape)}")


def _conv_fwd_reference(x, weight, bias, position_ids, silu):
    _check_layout(x)
    out = _like(x)
    out.copy_(causal_conv1d_ref(x, weight, bias, "silu" if silu else None, position_ids=position_ids,
                                validate=False))
    return out


def _conv_bwd_reference(x, weight, bias, position_ids, silu, dout):
    """The reference implementation of ``causal_conv1d_bwd`` (analytic; dropped taps dropped, not zeroed)."""
    _check_layout(x)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc, w = x.to(ct), weight.to(ct)
    taps = []  # taps[k]: x shifted k steps, dropped where position_ids < k
    pre = torch.zeros(batch, dim, seqlen, dtype=ct, device=x.device)
    if bias is not None:
        pre = pre + bias.to(ct)[:, None]
    for k in range(min(width, seqlen)):
        shifted = F.pad(xc[..., : seqlen - k], (k, 0)) if k else xc
        if k:
            shifted = torch.where((position_ids >= k)[:, None, :], shifted, 0.0)
        taps.append(shifted)
        pre = pre + w[:, width - 1 - k, None] * shifted
    g = dout.to(ct)
    if silu:
        sig = torch.sigmoid(pre)
        g = g * sig * (1 + pre * (1 - sig))
    dx = torch.zeros_like(xc)
    dw = torch.zeros(dim, width, dtype=ct, device=x.device)
    for k, shifted in enumerate(taps):
        dw[:, width - 1 - k] = (g * shifted).sum((0, 2))
        gk = torch.where((position_ids >= k)[:, None, :], g, 0.0) if k else g
        dx = dx + w[:, width - 1 - k, None] * (F.pad(gk[..., k:], (0, k)) if k else gk)
    out_dx = _like(x)
    out_dx.copy_(dx)
    dweight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    dweight.copy_(dw)
    if bias is None:
        return out_dx, dweight, _absent(x)
    dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
    dbias.copy_(g.sum((0, 2)))
    return out_dx, dweight, dbias


def _like_layout(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t with x's memory layout (channel-first contiguous, channel-last or channel-major)."""
    if x.is_contiguous():
        return t.contiguous()
    if is_channel_major(x):
        if is_channel_major(t):
            return t
        out = torch.empty_strided(x.shape, x.stride(), dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out
    if _is_dense_channel_last(t):
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _conv_fwd_cuda(x, weight, bias, position_ids, silu, runmask=None):
    _check_layout(x)
    _check_runmask(x, runmask)
    if _backends.implementation("causal_conv1d", "cuda", x.dtype, width=weight.shape[1]) == "reference":
        return _conv_fwd_reference(x, weight, bias, position_ids, silu)
    ext = _backends.load_kernels()
    from ._cuda import kernel_outputs

    with kernel_outputs():   # written in full by the kernel
        out = _like(x)
    if x.numel() > 0:
        ext.conv_fwd(x, weight.float().contiguous(), None if bias is None else bias.float().contiguous(),
                     position_ids.to(torch.int32).contiguous(), bool(silu), out, runmask)
    return out


def _conv_bwd_cuda(x, weight, bias, position_ids, silu, dout, runmask=None):
    _check_layout(x)
    _check_runmask(x, runmask)
    if _backends.implementation("causal_conv1d", "cuda", x.dtype, width=weight.shape[1]) == "reference":
        return _conv_bwd_reference(x, weight, bias, position_ids, silu, dout)
    ext = _backends.load_kernels()
    dim, width = weight.shape
    dout = _like_layout(dout.to(x.dtype), x)
    batch, _, seqlen = x.shape
    f32 = dict(device=x.device, dtype=torch.float32)
    if x.numel() == 0:
        dx, dweight = _like(x), torch.zeros(dim, width, **f32)
        dbias = None if bias is None else torch.zeros(dim, **f32)
    else:
        # per-block partials of [dweight | dbias]; the extension adds the slots it wrote in slot order into dweight /
        # dbias (no atomics: the same bits every run)
        slots = batch * max(1, -(-seqlen // CONV_SLOT_STEPS))
        from ._cuda import kernel_outputs

        with kernel_outputs():   # dx, dweight, dbias written in full; of dw_part only the slots written are read
            dx = _like(x)
            dw_part = torch.empty(slots, dim, width + 1, **f32)
            dweight = torch.empty(dim, width, **f32)
            dbias = None if bias is None else torch.empty(dim, **f32)
        used = ext.conv_bwd(x, weight.float().contiguous(), None if bias is None else bias.float().contiguous(),
                            position_ids.to(torch.int32).contiguous(), bool(silu), dout, dx, dw_part, dweight, dbias,
                            runmask)
        if not 1 <= used <= slots:
            raise RuntimeError(f"packloader ops: the conv backward wrote {used} dweight slots, the buffer holds {slots}")
    # float32 parameters need no copy
    if bias is None:
        return dx, dweight.to(weight.dtype), _absent(x)
    return dx, dweight.to(weight.dtype), dbias.to(bias.dtype)


def _runmask_reference(position_ids: torch.Tensor) -> torch.Tensor:
    """The boundary words of ``conv_runmask`` in plain PyTorch (any device)."""
    batch, seqlen = position_ids.shape
    nruns = -(-seqlen // CONV_MASK_RUN)
    dev = position_ids.device
    t = (torch.arange(nruns, device=dev)[:, None] * CONV_MASK_RUN - 4 + torch.arange(16, device=dev)[None, :])
    inside = (t > 0) & (t < seqlen)   # outside the row (or its first token): a start
    starts = ~inside.expand(batch, -1, -1)
    if seqlen:
        starts = starts | (position_ids[:, t.clamp(0, seqlen - 1)] == 0)
    bits = (starts.to(torch.int32) << torch.arange(16, device=dev, dtype=torch.int32)).sum(-1)
    out = torch.zeros(batch, conv_mask_stride(seqlen), dtype=torch.int16, device=dev)
    out[:, :nruns] = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return out


@torch.library.custom_op("packloader::conv_runmask", mutates_args=(), device_types=None, tags=OP_TAGS)
def conv_runmask(position_ids: torch.Tensor) -> torch.Tensor:
    """The channel-first conv kernels' boundary words for these ``position_ids`` -> (batch, conv_mask_stride(seqlen))
    int16 (format: :mod:`ops.contract`). Hand the result to ``causal_conv1d_fwd`` and ``causal_conv1d_bwd`` of the same
    rows, and the mask is made once instead of once per op. This body is the reference implementation."""
    return _runmask_reference(position_ids)


@conv_runmask.register_kernel("cuda")
def _conv_runmask_cuda(position_ids):
    if position_ids.numel() == 0 or _backends.implementation("causal_conv1d", "cuda", torch.float32) == "reference":
        return _runmask_reference(position_ids)
    return _backends.load_kernels().conv_runmask(position_ids.to(torch.int32).contiguous())


@conv_runmask.register_fake
def _conv_runmask_fake(position_ids):
    return position_ids.new_empty(position_ids.shape[0], conv_mask_stride(position_ids.shape[1]), dtype=torch.int16)


@torch.library.custom_op("packloader::causal_conv1d_fwd", mutates_args=(), device_types=None, tags=OP_TAGS)
def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      position_ids: torch.Tensor, silu: bool, runmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed causal conv1d forward -> out (x's strides); see :mod:`ops.contract`. This body is the reference
    implementation, used on every device but CUDA (it needs no ``runmask``)."""
    _check_runmask(x, runmask)
    return _conv_fwd_reference(x, weight, bias, position_ids, silu)


causal_conv1d_fwd.register_kernel("cuda")(_conv_fwd_cuda)


@causal_conv1d_fwd.register_fake
def _conv_fwd_fake(x, weight, bias, position_ids, silu, runmask=None):
    _check_layout(x)
    _check_runmask(x, runmask)
    return _like(x)


@torch.library.custom_op("packloader::causal_conv1d_bwd", mutates_args=(), device_types=None, tags=OP_TAGS)
def causal_conv1d_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      position_ids: torch.Tensor, silu: bool, dout: torch.Tensor,
                      runmask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed causal conv1d backward -> (dx, dweight, dbias); see :mod:`ops.contract`. This body is the
    reference implementation, used on every device but CUDA (it needs no ``runmask``)."""
    _check_runmask(x, runmask)
    return _conv_bwd_reference(x, weight, bias, position_ids, silu, dout)


causal_conv1d_bwd.register_kernel("cuda")(_conv_bwd_cuda)


@causal_conv1d_bwd.register_fake
def _conv_bwd_fake(x, weight, bias, position_ids, silu, dout, runmask=None):
    _check_layout(x)
    _check_runmask(x, runmask)
    dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if bias is not None else _absent(x)
    return _like(x), torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), dbias


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, position_ids, silu, runmask = inputs
    ctx.save_for_backward(x, weight, bias, position_ids, runmask)
    ctx.silu = silu


def _conv_backward(ctx, dout):
    x, weight, bias, position_ids, runmask = ctx.saved_tensors
    dx, dweight, dbias = causal_conv1d_bwd(x, weight, bias, position_ids, ctx.silu, dout, runmask)
    return dx, dweight, (dbias if bias is not None else None), None, None, None


causal_conv1d_fwd.register_autograd(_conv_backward, setup_context=_conv_setup_context)


class _ConvEagerFn(torch.autograd.Function):
    """``causal_conv1d_fwd`` and its autograd formula calling the CUDA implementations directly: the same kernels and
    bits, without the custom op's dispatch layers (Python in front of and behind each call), which cost the functional
    entry more host time than its kernels take at training shapes. Eager mode only (:func:`_conv_with_autograd`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, position_ids, silu, runmask):
        ctx.save_for_backward(x, weight, bias, position_ids, runmask)
        ctx.silu = silu
        return _conv_fwd_cuda(x, weight, bias, position_ids, silu, runmask)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, position_ids, runmask = ctx.saved_tensors
        dx, dweight, dbias = _conv_bwd_cuda(x, weight, bias, position_ids, ctx.silu, dout, runmask)
        return dx, dweight, (dbias if bias is not None else None), None, None, None


def _conv_with_autograd(x, weight, bias, position_ids, silu, runmask):
    """The functional entry's conv: the custom op (``torch.compile``, every device but CUDA, fake tensors, dispatch
    modes), or in plain eager mode on the CUDA kernels :class:`_ConvEagerFn` (``ops.backends.calls_directly``)."""
    if (not _backends.calls_directly(x)
            or _backends.implementation("causal_conv1d", x.device.type, x.dtype, width=weight.shape[1]) != "cuda"):
        return causal_conv1d_fwd(x, weight, bias, position_ids, silu, runmask)
    return _ConvEagerFn.apply(x, weight, bias, position_ids, silu, runmask)


# ----------------------------------------------------------------------------------------------------------------
# The conv's carried states: a fix-up of the packed conv's output (the kernels run as if every sequence started from
# zero), for the fused mixers that carry states (ops.carry, ops.context_parallel)

def _state_windows(x, weight, bias, initial_state, start, length, has_initial_state):
    """What both references of the conv's states compute: (flat (S, k) token of each sequence's first k outputs,
    valid (S, k): it has a state and the token is inside, windows (S, dim, k, w) of ``[state, x]`` ending at each of
    them, the pre-activations (S, dim, k)), in float32 (float64 for float64 inputs); k = w - 1."""
    k = weight.shape[1] - 1
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    j = torch.arange(k, device=x.device)
    valid = has_initial_state[:, None] & (j < length[:, None])
    flat = torch.where(valid, start[:, None] + j, start[:, None])   # the rest: the sequence's first token (unused)
    ext = torch.cat([initial_state.to(ct), _tokens(x, flat).to(ct).permute(0, 2, 1)], -1)   # (S, dim, 2k)
    win = ext.unfold(-1, k + 1, 1)
    pre = (win * weight.to(ct)[None, :, None, :]).sum(-1)
    if bias is not None:
        pre = pre + bias.to(ct)[None, :, None]
    return flat, valid, win, pre


def _conv_states_fwd_reference(out, x, weight, bias, silu, initial_state, start, length, has_initial_state):
    k = weight.shape[1] - 1
    if k > 0 and start.numel():
        flat, valid, _, pre = _state_windows(x, weight, bias, initial_state, start, length, has_initial_state)
        if silu:
            pre = F.silu(pre)
        tok = flat[valid]
        L = out.shape[2]
        out[tok // L, :, tok % L] = pre.permute(0, 2, 1)[valid].to(out.dtype)
    return _conv_final_states(x, k + 1, start, length, initial_state, has_initial_state)


def _conv_states_bwd_reference(dout, x, weight, bias, silu, initial_state, start, length, has_initial_state,
                               initial_grad):
    k = weight.shape[1] - 1
    dim = x.shape[1]
    flat, valid, win, pre = _state_windows(x, weight, bias, initial_state, start, length, has_initial_state)
    L = x.shape[2]
    g = torch.where(valid[:, None, :], _tokens(dout, flat).to(pre.dtype).permute(0, 2, 1), 0.0)     # (S, dim, k)
    tok = flat[valid]
    dout[tok // L, :, tok % L] = 0
    dpre = torch.ops.aten.silu_backward(g, pre) if silu else g
    dw = (win * dpre[..., None]).sum((0, 2))                                                       # (dim, w)
    # d ext_m = sum_j dpre_j w_{m - j}
    w = weight.to(pre.dtype)
    dext = (F.pad(dpre, (k, k)).unfold(-1, k + 1, 1)[:, :, :2 * k] * w.flip(-1)[None, :, None, :]).sum(-1)
    dbias = dpre.sum((0, 2)) if bias is not None else _absent(x)
    # (custom ops return no aliases: each output in its own memory, whatever the sizes)
    dinit = dext[..., :k].clone(memory_format=torch.contiguous_format) if initial_grad else _absent(x)
    dx_head = dext[..., k:].permute(0, 2, 1).clone(memory_format=torch.contiguous_format)
    return dx_head, dw.reshape(dim, k + 1), dbias, dinit


def _conv_states_check(x, weight, initial_state, start, length, has_initial_state):
    S = start.shape[0]
    if (tuple(initial_state.shape) != (S, x.shape[1], weight.shape[1] - 1) or initial_state.dtype != x.dtype
            or length.shape != start.shape or has_initial_state.shape != start.shape):
        raise ValueError(f"packloader::conv_states: initial_state must be (S={S}, dim={x.shape[1]}, width - 1="
                         f"{weight.shape[1] - 1}) in x's dtype {x.dtype}, start / length / has_initial_state (S,); got "
                         f"{tuple(initial_state.shape)} {initial_state.dtype}, {tuple(length.shape)}, "
                         f"{tuple(has_initial_state.shape)}")


@torch.library.custom_op("packloader::conv_states_fwd", mutates_args=("out",), device_types=None, tags=OP_TAGS)
def conv_states_fwd(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], silu: bool,
                    initial_state: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                    has_initial_state: torch.Tensor) -> torch.Tensor:
    """The conv's carried states, forward (see :mod:`ops.contract`): ``out`` (the packed conv of ``x``) in place with
    the first ``width - 1`` outputs of every sequence that has an initial state recomputed from it; returns every
    sequence's final state. This body is the reference implementation, used on every device but CUDA."""
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    return _conv_states_fwd_reference(out, x, weight, bias, silu, initial_state, start, length, has_initial_state)


@conv_states_fwd.register_kernel("cuda")
def _conv_states_fwd_cuda(out, x, weight, bias, silu, initial_state, start, length, has_initial_state):
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    if _backends.implementation("causal_conv1d", "cuda", x.dtype, width=weight.shape[1]) == "reference":
        return _conv_states_fwd_reference(out, x, weight, bias, silu, initial_state, start, length,
                                          has_initial_state)
    from ._cuda import kernel_outputs

    with kernel_outputs():   # written in full by the kernel
        final = torch.empty(initial_state.shape, dtype=x.dtype, device=x.device)
    _backends.load_kernels().conv_states_fwd(
        out, x, weight.float().contiguous(), None if bias is None else bias.float().contiguous(), bool(silu),
        initial_state.contiguous(), start.long().contiguous(), length.long().contiguous(),
        has_initial_state.bool().contiguous(), final)
    return final


@conv_states_fwd.register_fake
def _conv_states_fwd_fake(out, x, weight, bias, silu, initial_state, start, length, has_initial_state):
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    return torch.empty(initial_state.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("packloader::conv_states_bwd", mutates_args=("dout",), device_types=None, tags=OP_TAGS)
def conv_states_bwd(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    silu: bool, initial_state: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                    has_initial_state: torch.Tensor, initial_grad: bool
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's carried states, backward (see :mod:`ops.contract`) -> (dx_head, dweight, dbias, dinitial_state);
    ``dout`` zeroed in place where the forward wrote. This body is the reference implementation, used on every
    device but CUDA."""
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    return _conv_states_bwd_reference(dout, x, weight, bias, silu, initial_state, start, length, has_initial_state,
                                      initial_grad)


@conv_states_bwd.register_kernel("cuda")
def _conv_states_bwd_cuda(dout, x, weight, bias, silu, initial_state, start, length, has_initial_state, initial_grad):
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    if _backends.implementation("causal_conv1d", "cuda", x.dtype, width=weight.shape[1]) == "reference":
        return _conv_states_bwd_reference(dout, x, weight, bias, silu, initial_state, start, length,
                                          has_initial_state, initial_grad)
    from ._cuda import kernel_outputs

    S, dim, width = start.shape[0], x.shape[1], weight.shape[1]
    f32 = dict(dtype=torch.float32, device=x.device)
    with kernel_outputs():   # written in full by the kernel
        dx_head = torch.empty(S, width - 1, dim, **f32)
        dw_part = torch.empty(S, dim, width + 1, **f32)
        dinit = torch.empty(initial_state.shape, **f32) if initial_grad else _absent(x)
    _backends.load_kernels().conv_states_bwd(
        dout, x, weight.float().contiguous(), None if bias is None else bias.float().contiguous(), bool(silu),
        initial_state.contiguous(), start.long().contiguous(), length.long().contiguous(),
        has_initial_state.bool().contiguous(), dx_head, dw_part, dinit if initial_grad else None)
    dwb = dw_part.sum(0)   # over the sequences, in order; then dweight and dbias in their own memory (no aliases)
    dbias = dwb[:, width].clone(memory_format=torch.contiguous_format) if bias is not None else _absent(x)
    return dx_head, dwb[:, :width].clone(memory_format=torch.contiguous_format), dbias, dinit


@conv_states_bwd.register_fake
def _conv_states_bwd_fake(dout, x, weight, bias, silu, initial_state, start, length, has_initial_state, initial_grad):
    _conv_states_check(x, weight, initial_state, start, length, has_initial_state)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    S, dim, width = start.shape[0], x.shape[1], weight.shape[1]
    new = dict(dtype=ct, device=x.device)
    return (torch.empty(S, width - 1, dim, **new), torch.empty(dim, width, **new),
            torch.empty(dim, **new) if bias is not None else _absent(x),
            torch.empty(initial_state.shape, **new) if initial_grad else _absent(x))


def _reads_runmask(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the conv kernels that read a run mask take these inputs (channel-first rows on CUDA)."""
    # channel-last by the kernels' own rule (binding.cpp: stride(1) == 1 with more than one channel) reads no mask
    if not x.is_cuda or not (x.is_contiguous() or is_channel_major(x)) or (x.stride(1) == 1 and x.shape[1] > 1):
        return False
    width = weight.shape[-1]
    return (_backends.unsupported_reason("causal_conv1d", x.dtype, width=width) is None
            and _backends.implementation("causal_conv1d", "cuda", x.dtype, width=width) == "cuda")


_runmasks = TensorMemo()   # position_ids -> conv_runmask(position_ids)


def runmask_for(x: torch.Tensor, weight: torch.Tensor, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """``conv_runmask(position_ids)`` where the kernels that read it may run (channel-first rows the CUDA kernels
    take), else None: what a caller computes once and hands to a conv forward and its backward. The mask depends on
    the ids alone: made once for a ``position_ids`` tensor while it is alive and unchanged (:class:`TensorMemo`), so
    the mixers of a model's layers, handed the same ids, share it."""
    if not _reads_runmask(x, weight):
        return None
    mask = _runmasks.get(position_ids)
    return mask if mask is not None else _runmasks.put(position_ids, conv_runmask(position_ids))


# ----------------------------------------------------------------------------------------------------------------
# The functional entry

def packed_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
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
    """Depthwise causal conv1d over packed rows; no tap crosses a sequence start.

    Runs the ``packloader::causal_conv1d_fwd`` op (the compiled kernel on CUDA tensors, the reference
    elsewhere: see :mod:`ops.backends`); differentiable; traceable by ``torch.compile`` without graph breaks. In eager
    mode on CUDA the op's CUDA implementation and its backward run through a plain autograd Function: the same kernels
    without the custom op's Python dispatch layers, whose host time exceeded the kernels' at training shapes (now
    1.02-1.09x the kernels' time at the benchmark's shape; ``benchmarks/results/RESULTS.md``, "Kernels").

    Args:
        x: (batch, dim, seqlen), channel-first (contiguous) or channel-last (``x.stride(1) == 1``,
            i.e. a transposed (batch, seqlen, dim) tensor). Other layouts are copied to channel-first.
            The output has the same layout.
        weight: (dim, width), or nn.Conv1d's depthwise (dim, 1, width). Tap ``k`` (input ``k``
            steps back) is ``weight[:, width - 1 - k]``, as in ``F.conv1d(..., padding=width-1)``. The kernel
            takes widths 2..4.
        bias: (dim,), optional.
        activation: None, ``"silu"`` or ``"swish"`` (= silu), applied after the bias.
        position_ids: (batch, seqlen) integer ids restarting at 0 at every sequence start. Tap ``k``
            at time ``t`` is used only where ``position_ids[t] >= k``.
        seq_idx: (batch, seqlen) segment numbers, the alternative to ``position_ids``: a new sequence starts
            wherever the number changes. As in causal-conv1d, a negative ``seq_idx`` marks padding, whose output
            is 0 (and its gradient too)::

                seq_idx  [ 0  0  0  1  1 -1 -1 ]
                out      [ o0 o1 o2 o3 o4  0  0 ]

            With neither, each row is one sequence (plain causal conv).
        initial_state: (num_sequences, dim, width - 1) in ``x``'s dtype: the ``width - 1`` inputs that precede each
            sequence (oldest first, causal-conv1d's ``conv_state`` layout), sequences numbered in ``cu_seqlens``
            order (see :mod:`ops.states`). Where ``has_initial_state`` is set, the taps before the sequence's first
            token read them instead of being dropped::

                initial_state[i] = [p0 p1 p2]        (the last inputs of the piece before, width 4)
                x                  [ s0 s1 s2 s3 ... ]   sequence i
                out at s1 = w[3]*s1 + w[2]*s0 + w[1]*p2 + w[0]*p1

            Differentiable. The kernels run as without states; the first ``width - 1`` outputs of each continued
            sequence are then recomputed with the states (a few tokens a sequence, no host sync).
        has_initial_state: (num_sequences,) bool; default all (when ``initial_state`` is given).
        output_final_state: also return each sequence's last ``width - 1`` inputs, (num_sequences, dim, width - 1)
            in ``x``'s dtype, the layout ``initial_state`` takes (from the initial state where the sequence is
            shorter; zeros before a sequence without one). Differentiable.
        backend: None (by device) or ``"reference"`` for this call's forward (see
            :func:`ops.packed_selective_scan`; prefer ``with ops.use_backend("reference"):``).
        validate: check the boundaries (one host sync; skipped under ``torch.compile``).
        boundaries: a :class:`ops.PackedBoundaries` resolved once for the batch, instead of ``position_ids`` /
            ``seq_idx``: no conversion, no check and the conv's boundary mask made once for all calls.

    Returns:
        (batch, dim, seqlen) in ``x``'s dtype and layout; with ``output_final_state`` the pair ``(out,
        final_state)``.

    Raises:
        ValueError: shapes that do not fit. ops.backends.KernelUnsupportedError: a CUDA case the kernel cannot
            take (float64, width outside 2..4), with how to run the reference instead.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, dim, seqlen), got {tuple(x.shape)}")
    activation = _norm_activation(activation)
    batch, dim, seqlen = x.shape
    weight = _norm_weight(weight, dim)
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be (dim={dim},), got {tuple(bias.shape)}")
    pos, seq_idx, validate, boundaries = resolve_for_op("packed_causal_conv1d", position_ids, seq_idx, boundaries,
                                                        batch, seqlen, x.device, validate)
    xk = kernel_layout(x)
    args = (xk, weight, bias, pos, activation == "silu")
    mask = runmask_for(xk, weight, pos) if boundaries is None else _cached_runmask(boundaries, xk, weight)
    if backend is None or backend == "auto":
        out = _conv_with_autograd(*args, mask)
    else:
        with _backends.use_backend_for_call(backend):
            out = causal_conv1d_fwd(*args, mask)
    if initial_state is None and not output_final_state:
        return _zero_padding(out, seq_idx)
    from .selective_scan_interface import _num_sequences   # one rule for the number of states
    num = _num_sequences(pos, initial_state, has_initial_state, validate, boundaries)
    width = weight.shape[1]
    if initial_state is not None:
        check_state("initial_state", initial_state, (num, dim, width - 1), (x.dtype,), x.device)
        if has_initial_state is None:
            has_initial_state = torch.ones(num, dtype=torch.bool, device=x.device)
        has_initial_state = has_initial_state.to(device=x.device, dtype=torch.bool)
    start, length = (sequence_spans(pos, num) if boundaries is None else
                     boundaries.derived(("spans", num), lambda: sequence_spans(pos, num)))
    if initial_state is not None and width > 1:
        out = _continue_from_states(out, xk, weight, bias, activation == "silu", start, length, initial_state,
                                    has_initial_state)
    out = _zero_padding(out, seq_idx)
    if not output_final_state:
        return out
    return out, _conv_final_states(xk, width, start, length, initial_state, has_initial_state)


def _cached_runmask(boundaries: PackedBoundaries, x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``runmask_for`` with the mask itself (which depends on the ids alone) made once per ``boundaries``."""
    if not _reads_runmask(x, weight):
        return None
    return boundaries.derived("conv_runmask", lambda: conv_runmask(boundaries.position_ids))


def _tokens(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """x (batch, dim, L) at the flattened token indices ``flat`` (any shape) -> flat.shape + (dim,)."""
    L = x.shape[2]
    return x[flat // L, :, flat % L]


def _continue_from_states(out, x, weight, bias, silu, start, length, initial_state, has_initial_state):
    """``out`` with the first ``width - 1`` outputs of every sequence that has an initial state recomputed with its
    taps reading the state. Every position is written by one differentiable value (elsewhere a sequence's own first
    output, or that value detached), so no gradient is counted twice or lost."""
    flat, valid, _, pre = _state_windows(x, weight, bias, initial_state, start, length, has_initial_state)
    if silu:
        pre = F.silu(pre)
    pre = pre.to(out.dtype)
    first = torch.where(valid[:, None, :1], pre[..., :1], _tokens(out, start[:, None]).permute(0, 2, 1))
    vals = torch.cat([first, torch.where(valid[:, None, 1:], pre[..., 1:], first.detach())], -1)   # (S, dim, k)
    out = out.clone()
    L = out.shape[2]
    out[flat // L, :, flat % L] = vals.permute(0, 2, 1)
    return out


def _conv_final_states(x, width, start, length, initial_state, has_initial_state):
    """Each sequence's last ``width - 1`` inputs (S, dim, width - 1), oldest first; before a short sequence's first
    token, its initial state's (or zeros)."""
    k = width - 1
    i = torch.arange(k, device=x.device)
    flat = start[:, None] + length[:, None] - k + i                         # (S, k)
    inside = flat >= start[:, None]
    got = _tokens(x, torch.where(inside, flat, start[:, None])).permute(0, 2, 1)   # (S, dim, k)
    before = torch.zeros_like(got)
    if initial_state is not None:
        idx = (length[:, None] + i).clamp(max=k - 1)[:, None, :].expand_as(got)
        before = torch.where(has_initial_state[:, None, None], initial_state.gather(2, idx), before)
    return torch.where(inside[:, None, :], got, before)


def _zero_padding(out: torch.Tensor, seq_idx: Optional[torch.Tensor]) -> torch.Tensor:
    """causal-conv1d's rule: tokens whose ``seq_idx`` is negative are padding; their output is 0 (and so is the
    gradient that reaches x through them). No host sync; out's layout is kept."""
    if seq_idx is None:
        return out
    return torch.where((seq_idx < 0).to(out.device).unsqueeze(1), 0.0, out)   # (where keeps out's layout)
