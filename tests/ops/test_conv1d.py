"""Packed causal depthwise conv1d on CPU in float64: the op (``ops.packed_causal_conv1d``: the custom ops
``packloader::causal_conv1d_fwd/bwd`` with their reference implementations, an analytic backward) and the
PyTorch oracle ``causal_conv1d_ref`` (torch autograd through it) against a per-timestep oracle written here and against running every sequence alone, for random
length mixes (length-1 sequences, sequences shorter than the conv width, a row that is one sequence,
a padding tail), both boundary forms, channel-first and channel-last inputs, with and without bias and
silu, conv widths 2-4; and ``torch.library.opcheck`` of both ops."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.conv1d_interface import causal_conv1d_ref

from ._helpers import channel_major, mixed_rows, positions, spans

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def conv_oracle(x, weight, bias, activation, rows):
    """out[t] = bias + sum_k weight[:, W-1-k] * x[t-k] over the taps k that stay inside t's sequence."""
    batch, dim, seqlen = x.shape
    w = weight.reshape(dim, -1)
    W = w.shape[1]
    cols = []
    for b, row in enumerate(rows):
        row_cols = []
        start = 0
        for length in row:
            for t in range(start, start + length):
                acc = torch.zeros(dim, dtype=F64) if bias is None else bias.clone()
                for k in range(W):
                    if t - k >= start:
                        acc = acc + w[:, W - 1 - k] * x[b, :, t - k]
                if activation in ("silu", "swish"):
                    acc = acc * torch.sigmoid(acc)
                row_cols.append(acc)
            start += length
        cols.append(torch.stack(row_cols, -1))
    return torch.stack(cols)


def make_x(batch, dim, seqlen, channel_last, dtype=F64):
    if channel_last:
        x = torch.randn(batch, seqlen, dim, dtype=dtype).transpose(1, 2)
        assert x.stride(1) == 1 and not x.is_contiguous()
        return x
    return torch.randn(batch, dim, seqlen, dtype=dtype)


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def grads(out, ins, dout):
    wrt = [t for t in ins if t is not None]
    g = iter(torch.autograd.grad(out, wrt, dout))
    return [None if t is None else next(g) for t in ins]


def conv(x, weight, bias=None, activation=None, *, path, **kw):
    """path "op": the custom op (what every caller runs); "reference": torch autograd through the oracle."""
    if path == "reference":
        return causal_conv1d_ref(x, weight, bias, activation, **kw)
    assert path == "op"
    return ops.packed_causal_conv1d(x, weight, bias, activation, **kw)


VARIANTS = {
    # name: (width, has_bias, activation, weight as nn.Conv1d's (dim, 1, width))
    "w4_bias_silu_3d": (4, True, "silu", True),
    "w2_plain": (2, False, None, False),
    "w3_bias_swish": (3, True, "swish", False),
    "w4_nobias_linear_3d": (4, False, None, True),
}


@pytest.mark.parametrize("backend", ["reference", "op"])
@pytest.mark.parametrize("form", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("channel_last", [False, True], ids=["channel_first", "channel_last"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_equals_oracle_and_each_sequence_alone(seed, backend, form, channel_last, variant):
    width, has_bias, activation, w3d = VARIANTS[variant]
    rng = random.Random(seed)
    batch, dim, seqlen = 4, 5, rng.choice([9, 26])
    rows = mixed_rows(rng, batch, seqlen, width=width)
    print("rows", rows)
    pos = positions(rows)
    bounds = {"position_ids": pos} if form == "position_ids" else {"seq_idx": ops.position_ids_to_seq_idx(pos)}
    x = leaf(make_x(batch, dim, seqlen, channel_last))
    w = leaf(torch.randn(dim, 1, width, dtype=F64) if w3d else torch.randn(dim, width, dtype=F64))
    bias = leaf(torch.randn(dim, dtype=F64)) if has_bias else None
    out = conv(x, w, bias, activation, path=backend, **bounds)
    assert out.shape == x.shape and out.dtype == F64
    assert out.stride() == x.stride(), "output in the input's layout"
    dout = torch.randn(out.shape, dtype=F64)
    g = grads(out, [x, w, bias], dout)
    assert g[1].shape == w.shape

    # the oracle
    ox, ow, ob = leaf(x), leaf(w), leaf(bias)
    o_out = conv_oracle(ox, ow, ob, activation, rows)
    torch.testing.assert_close(out, o_out, **TOL)
    for name, a, b in zip(["x", "weight", "bias"], g, grads(o_out, [ox, ow, ob], dout)):
        if a is not None:
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad of {name}: {m}")

    # each sequence alone, no boundaries
    dw, db = torch.zeros_like(w), (torch.zeros_like(bias) if has_bias else None)
    for b, s, n in spans(rows):
        xs = x.detach()[b:b + 1, :, s:s + n]
        xs = leaf(xs.transpose(1, 2).contiguous().transpose(1, 2) if channel_last else xs.contiguous())
        ws, bs = leaf(w), leaf(bias)
        o = conv(xs, ws, bs, activation, path=backend)
        torch.testing.assert_close(out[b:b + 1, :, s:s + n], o, **TOL)
        gx, gw, gb = grads(o, [xs, ws, bs], dout[b:b + 1, :, s:s + n])
        torch.testing.assert_close(g[0][b:b + 1, :, s:s + n], gx, **TOL)
        dw += gw
        if has_bias:
            db += gb
    torch.testing.assert_close(g[1], dw, **TOL)
    if has_bias:
        torch.testing.assert_close(g[2], db, **TOL)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("seqlen", [1, 2, 17])
def test_no_boundaries_equals_torch_conv1d(seed, width, seqlen):
    """Without boundaries: nn.Conv1d(groups=dim, padding=width-1) truncated to seqlen, as in Mamba."""
    dim = 3
    layer = torch.nn.Conv1d(dim, dim, width, groups=dim, padding=width - 1, dtype=F64)
    x = torch.randn(2, dim, seqlen, dtype=F64)
    want = F.silu(layer(x)[..., :seqlen])
    for backend in ("reference", "op"):
        got = conv(x, layer.weight, layer.bias, "silu", path=backend)
        torch.testing.assert_close(got, want, **TOL)
        # position_ids counting 0..L-1 (one sequence per row) is the same thing
        pos = torch.arange(seqlen).expand(2, seqlen)
        torch.testing.assert_close(conv(x, layer.weight, layer.bias, "silu", position_ids=pos, path=backend), want,
                                   **TOL)


@pytest.mark.parametrize("channel_last", [False, True], ids=["channel_first", "channel_last"])
def test_gradcheck_through_the_autograd_function(seed, channel_last):
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0]])
    x = leaf(make_x(2, 3, 8, channel_last))
    w, b = leaf(torch.randn(3, 4, dtype=F64)), leaf(torch.randn(3, dtype=F64))
    assert torch.autograd.gradcheck(
        lambda x_, w_, b_: conv(x_, w_, b_, "silu", position_ids=pos, path="op"),
        (x, w, b), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(
        lambda x_, w_: conv(x_, w_, None, None, position_ids=pos, path="op"),
        (x, w), eps=1e-6, atol=1e-7)


def test_no_tap_crosses_a_boundary_forward_or_backward(seed):
    x = torch.randn(1, 4, 12, dtype=F64)
    w, b = torch.randn(4, 4, dtype=F64), torch.randn(4, dtype=F64)
    pos = positions([[5, 7]])
    for backend in ("reference", "op"):
        xl = leaf(x)
        out = conv(xl, w, b, "silu", position_ids=pos, path=backend)
        x2 = x.clone()
        x2[..., :5] += 10.0  # change the first sequence
        out2 = conv(x2, w, b, "silu", position_ids=pos, path=backend)
        assert torch.equal(out[..., 5:], out2[..., 5:])
        assert (out[..., :5] - out2[..., :5]).abs().max() > 0
        out[..., 5:].sum().backward()
        assert xl.grad[..., :5].abs().max() == 0 and xl.grad[..., 5:].abs().max() > 0


@pytest.mark.parametrize("backend", ["reference", "op"])
def test_inf_does_not_cross_a_boundary(seed, backend):
    # an inf in the last step of the first sequence: the next sequence's outputs and input gradients stay finite
    # and equal to it run alone (a dropped tap is dropped, not multiplied by zero, which would give NaN)
    x = torch.randn(1, 4, 12, dtype=F64)
    x[..., 4] = float("inf")
    w, b = torch.randn(4, 4, dtype=F64), torch.randn(4, dtype=F64)
    xl = leaf(x)
    out = conv(xl, w, b, "silu", position_ids=positions([[5, 7]]), path=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    x1 = leaf(x[..., 5:])
    alone = conv(x1, w, b, "silu", path=backend)
    alone.backward(dout[..., 5:])
    assert torch.isfinite(out[..., 5:]).all() and torch.isfinite(xl.grad[..., 5:]).all()
    torch.testing.assert_close(out[..., 5:], alone, **TOL)
    torch.testing.assert_close(xl.grad[..., 5:], x1.grad, **TOL)


def test_channel_last_and_channel_first_agree(seed):
    x = torch.randn(2, 8, 11, dtype=F64)
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)
    w, b = torch.randn(8, 3, dtype=F64), torch.randn(8, dtype=F64)
    pos = positions([[3, 1, 7], [11]])
    for backend in ("reference", "op"):
        r = []
        for inp in (x, x_cl):
            xl = leaf(inp)
            out = conv(xl, w, b, "silu", position_ids=pos, path=backend)
            out.square().sum().backward()
            r.append((out, xl.grad))
        torch.testing.assert_close(r[0][0], r[1][0], **TOL)
        torch.testing.assert_close(r[0][1], r[1][1], **TOL)
        assert r[1][0].stride(1) == 1  # channel-last in, channel-last out


def test_strided_input_that_is_neither_layout(seed):
    """A slice of a wider tensor (Mamba's x half of xz): the functional entry copies to a layout the op takes."""
    xz = torch.randn(2, 6, 9, dtype=F64)
    x = xz[:, :3]
    w = torch.randn(3, 4, dtype=F64)
    pos = positions([[4, 5], [2, 7]])
    a = conv(x, w, None, "silu", position_ids=pos, path="op")
    b = conv(x.contiguous(), w, None, "silu", position_ids=pos, path="reference")
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_on_cpu(seed, dtype):
    rows = [[2, 1, 9], [12]]
    x = torch.randn(2, 4, 12).to(dtype)
    w, b = torch.randn(4, 4).to(dtype), torch.randn(4).to(dtype)
    want = conv_oracle(x.double(), w.double(), b.double(), "silu", rows)
    for backend in ("reference", "op"):
        out = conv(x, w, b, "silu", position_ids=positions(rows), path=backend)
        assert out.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert ((out.double() - want).norm() / want.norm()).item() <= tol


def test_reference_function_matches_the_op(seed):
    x, w = torch.randn(2, 3, 10, dtype=F64), torch.randn(3, 2, dtype=F64)
    pos = positions([[3, 7], [1, 9]])
    torch.testing.assert_close(causal_conv1d_ref(x, w, None, "silu", position_ids=pos),
                               ops.packed_causal_conv1d(x, w, None, "silu", position_ids=pos), rtol=0, atol=0)


def test_errors():
    x, w = torch.randn(2, 4, 10), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"activation must be None, 'silu' or 'swish', got 'relu'"):
        ops.packed_causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match=r"weight must be \(dim=4, width\) or \(dim, 1, width\), got \(3, 3\)"):
        ops.packed_causal_conv1d(x, w[:3])
    with pytest.raises(ValueError, match=r"weight must be .* got \(4, 2, 3\)"):
        ops.packed_causal_conv1d(x, torch.randn(4, 2, 3))
    with pytest.raises(ValueError, match=r"bias must be \(dim=4,\), got \(3,\)"):
        ops.packed_causal_conv1d(x, w, torch.randn(3))
    with pytest.raises(ValueError, match=r"x must be \(batch, dim, seqlen\), got \(4, 10\)"):
        ops.packed_causal_conv1d(x[0], w)
    with pytest.raises(ops.BoundaryError, match=r"seq_idx must have shape \(batch, seqlen\)"):
        ops.packed_causal_conv1d(x, w, seq_idx=torch.zeros(10, dtype=torch.long))


@pytest.mark.parametrize("backend", ["reference", "op"])
def test_validate_false_skips_the_boundary_check(backend):
    """validate=False: the caller vouches for the ids; neither the op nor its reference re-checks."""
    x, w = torch.randn(1, 2, 4), torch.randn(2, 3)
    bad = torch.tensor([[0, 1, 0, 3]])
    with pytest.raises(ops.BoundaryError):
        conv(x, w, position_ids=bad, path=backend)
    conv(x, w, position_ids=bad, path=backend, validate=False)


# ---------------------------------------------------------------------------------------------
# the custom ops: opcheck, and the layouts they take

@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("channel_last", [False, True], ids=["channel_first", "channel_last"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("silu", [True, False])
def test_opcheck(seed, width, channel_last, bias, silu):
    rows = [[1, 2, 6], [9]]  # a length-1 sequence and one shorter than the width
    x = make_x(2, 5, 9, channel_last).requires_grad_(True)
    w = torch.randn(5, width, dtype=F64, requires_grad=True)
    b = torch.randn(5, dtype=F64, requires_grad=True) if bias else None
    pos = positions(rows).to(torch.int32)
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd, (x, w, b, pos, silu))
    dout = torch.randn(2, 5, 9, dtype=F64)
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_bwd,
                          (x.detach(), w.detach(), None if b is None else b.detach(), pos, silu, dout))
    runmask = torch.ops.packloader.conv_runmask(pos)
    torch.library.opcheck(torch.ops.packloader.conv_runmask, (pos,))
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd, (x, w, b, pos, silu, runmask))
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_bwd,
                          (x.detach(), w.detach(), None if b is None else b.detach(), pos, silu, dout, runmask))


def test_channel_major_layout(seed):
    """x laid out as (d, b, L) (the fused mixer's layout): opcheck, out and dx in that layout, the values of the
    contiguous call."""
    from ops.contract import is_channel_major

    pos = positions([[1, 2, 6], [9]]).to(torch.int32)
    x = torch.randn(2, 5, 9, dtype=F64)
    xm = channel_major(x)
    assert is_channel_major(xm) and not xm.is_contiguous()
    w, b = torch.randn(5, 4, dtype=F64), torch.randn(5, dtype=F64)
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd, (xm.clone().requires_grad_(True), w, b, pos, True))
    out = torch.ops.packloader.causal_conv1d_fwd(xm, w, b, pos, True)
    assert out.stride() == xm.stride() and torch.equal(out, torch.ops.packloader.causal_conv1d_fwd(x, w, b, pos, True))
    dout = torch.randn(2, 5, 9, dtype=F64)
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_bwd, (xm, w, b, pos, True, dout))
    got = torch.ops.packloader.causal_conv1d_bwd(xm, w, b, pos, True, dout)
    want = torch.ops.packloader.causal_conv1d_bwd(x, w, b, pos, True, dout)
    assert got[0].stride() == xm.stride()
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_low_precision_and_length_1(seed, dtype):
    x = torch.randn(3, 4, 1).to(dtype).requires_grad_(True)
    w = torch.randn(4, 4, requires_grad=True)  # float32 weights with bf16 activations, as under autocast
    pos = torch.zeros(3, 1, dtype=torch.int32)
    torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd, (x, w, None, pos, True))


def test_the_op_refuses_layouts_outside_its_contract():
    x = torch.randn(2, 6, 9)[:, :3]  # neither channel-first contiguous, dense channel-last nor channel-major
    with pytest.raises(ValueError, match="channel-first contiguous, dense channel-last or channel-major"):
        torch.ops.packloader.causal_conv1d_fwd(x, torch.randn(3, 4), None, torch.zeros(2, 9, dtype=torch.int32), True)


@pytest.mark.parametrize("channel_last", [False, True])
def test_negative_seq_idx_is_padding_with_zero_output_and_gradient(channel_last):
    # causal-conv1d's rule (its test_causal_conv1d_varlen_padding): seq_idx == -1 marks padding, output 0 there,
    # the real sequences exactly as each alone, and no gradient through the padding
    import ops

    torch.manual_seed(torch.seed() % 2**31)
    dim, width = 6, 4
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1, -1], [-1, -1, 2, 2, 2, 2, 3, 3, -1]])
    L = seq_idx.shape[1]
    x = (torch.randn(2, L, dim).transpose(1, 2) if channel_last else torch.randn(2, dim, L)).double()
    x.requires_grad_()
    w = torch.randn(dim, width, dtype=torch.float64, requires_grad=True)
    b = torch.randn(dim, dtype=torch.float64, requires_grad=True)
    for fn in (ops.packed_causal_conv1d, ops.causal_conv1d_ref):
        out = fn(x, w, b, "silu", seq_idx=seq_idx)
        assert (out[seq_idx[:, None, :].expand_as(out) < 0] == 0).all()
        assert out.stride() == x.stride() or not channel_last
        for row, s, e in ((0, 0, 3), (0, 3, 7), (1, 2, 6), (1, 6, 8)):
            alone = ops.causal_conv1d_ref(x[row:row + 1, :, s:e], w, b, "silu")
            torch.testing.assert_close(out[row:row + 1, :, s:e], alone, rtol=1e-12, atol=1e-12)
        (gx,) = torch.autograd.grad(out.sum(), x)
        pad = seq_idx < 0
        assert (gx.permute(0, 2, 1)[pad] == 0).all(), "gradient reached x through padding"


def test_a_runmask_of_the_wrong_shape_is_refused_on_every_implementation():
    """The ops check a given runmask the same way on the reference (here), the fake and the CUDA implementation, so a
    caller's mistake shows on the CPU too, not only on a GPU."""
    x, w = torch.randn(2, 3, 20), torch.randn(3, 4)
    pos = torch.arange(20, dtype=torch.int32).repeat(2, 1)
    good = torch.ops.packloader.conv_runmask(pos)
    assert good.shape == (2, 8) and good.dtype == torch.int16
    torch.ops.packloader.causal_conv1d_fwd(x, w, None, pos, True, good)
    for bad in (good[:1], good.int(), torch.ops.packloader.conv_runmask(torch.zeros(2, 100, dtype=torch.int32))):
        with pytest.raises(ValueError, match="runmask must be packloader::conv_runmask"):
            torch.ops.packloader.causal_conv1d_fwd(x, w, None, pos, True, bad)
        with pytest.raises(ValueError, match="runmask must be packloader::conv_runmask"):
            torch.ops.packloader.causal_conv1d_bwd(x, w, None, pos, True, torch.randn(2, 3, 20), bad)


def test_runmask_is_made_once_per_position_ids_tensor(monkeypatch):
    """The mixers of a model's layers, handed the same position_ids, share one run mask (made at the first layer);
    a change in place or another tensor makes a new one; none where the kernels read no mask."""
    import importlib
    mod = importlib.import_module("ops.conv1d_interface")
    made = []
    real = mod.conv_runmask
    monkeypatch.setattr(mod, "conv_runmask", lambda pos: made.append(1) or real(pos))
    monkeypatch.setattr(mod, "_reads_runmask", lambda x, w: True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]], dtype=torch.int32)
    x, w = torch.randn(1, 4, 8), torch.randn(4, 4)
    first = mod.runmask_for(x, w, pos)
    assert all(mod.runmask_for(x, w, pos) is first for _ in range(3)) and len(made) == 1
    torch.testing.assert_close(first, real(pos), rtol=0, atol=0)
    pos[0, 4] = 0                                   # changed in place: a new mask, for the new ids
    again = mod.runmask_for(x, w, pos)
    assert len(made) == 2 and again is not first
    torch.testing.assert_close(again, real(pos), rtol=0, atol=0)
    mod.runmask_for(x, w, pos.clone())              # another tensor (equal ids): its own mask
    assert len(made) == 3
    monkeypatch.setattr(mod, "_reads_runmask", lambda x, w: False)
    assert mod.runmask_for(x, w, pos) is None
