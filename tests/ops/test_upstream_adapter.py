"""ops._upstream (the conv ``upstream`` backend: Dao-AILab causal-conv1d with ``seq_idx``) on CPU, against a
stand-in written here that enforces the checks of causal-conv1d's C++ entry points (csrc/causal_conv1d.cpp:
``seq_idx`` only in the channel-last layout, int32 and contiguous, channel-last strides multiples of 8) and
computes with our float64 reference. This tests the adapter's plumbing (layouts, seq_idx conversion, the
raw fwd/bwd call signatures used by the fused Mamba path); the real kernels are tested in test_gpu_modules.py."""
from __future__ import annotations

import random

import pytest
import torch

from ops import _ref_kernels, _upstream
from ops.boundaries import seq_idx_to_position_ids
from ops.conv1d_interface import causal_conv1d_ref
from ops.mamba_inner import PackedMambaInnerFn, packed_mamba_inner_ref

from ._helpers import mixed_rows, positions

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


class FakeCausalConv1d:
    """causal_conv1d_fn / causal_conv1d_fwd_function / causal_conv1d_bwd_function, CPU, float64-capable."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def check(x, weight, bias, seq_idx):
        assert weight.dim() == 2 and 2 <= weight.shape[1] <= 4, weight.shape
        assert x.stride(2) == 1 or x.stride(1) == 1, x.stride()
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:
            assert x.shape[1] % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, x.stride()
        if bias is not None:
            assert bias.dtype == weight.dtype and bias.stride(-1) == 1
        if seq_idx is not None:
            assert channel_last, "seq_idx is only supported for channel last layout"
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
            assert seq_idx.shape == (x.shape[0], x.shape[2])
        return channel_last

    @staticmethod
    def compute(x, weight, bias, seq_idx, silu):
        pos = None if seq_idx is None else seq_idx_to_position_ids(seq_idx)
        return causal_conv1d_ref(x, weight, bias, "silu" if silu else None, position_ids=pos)

    def fwd(self, x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
        assert initial_states is None and final_states_out is None
        self.check(x, weight, bias, seq_idx)
        self.calls.append(("fwd", seq_idx is not None))
        out = torch.empty_like(x)  # the kernel writes in x's layout
        out.copy_(self.compute(x, weight, bias, seq_idx, silu_activation))
        return out

    def bwd(self, x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
            silu_activation):
        assert initial_states is None and dfinal_states is None and dx is None and return_dinitial_states is False
        self.check(x, weight, bias, seq_idx)
        self.calls.append(("bwd", seq_idx is not None))
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
        with torch.enable_grad():
            y = self.compute(*leaves, seq_idx, silu_activation)
            g = torch.autograd.grad(y, [t for t in leaves if t is not None], dout)
        dx = torch.empty_like(x)
        dx.copy_(g[0])
        return dx, g[1], (g[2] if bias is not None else None), None

    def fn(self, x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
           final_states_out=None, activation=None):
        fake = self

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x_, w_, b_):
                if x_.stride(2) != 1 and x_.stride(1) != 1:
                    x_ = x_.contiguous()
                ctx.save_for_backward(x_, w_, b_)
                return fake.fwd(x_, w_, b_, seq_idx, None, None, activation in ("silu", "swish"))

            @staticmethod
            def backward(ctx, dout):
                x_, w_, b_ = ctx.saved_tensors
                if dout.stride(2) != 1 and dout.stride(1) != 1:
                    dout = dout.contiguous()
                dx, dw, db, _ = fake.bwd(x_, w_, b_, dout, seq_idx, None, None, None, False,
                                         activation in ("silu", "swish"))
                return dx, dw, db

        return Fn.apply(x, weight, bias)


@pytest.fixture
def fake(monkeypatch):
    f = FakeCausalConv1d()
    monkeypatch.setitem(_upstream._state, "checked", True)
    monkeypatch.setitem(_upstream._state, "fn", f.fn)
    monkeypatch.setitem(_upstream._state, "fwd", f.fwd)
    monkeypatch.setitem(_upstream._state, "bwd", f.bwd)
    return f


def make(batch, dim, L, width, channel_last):
    x = torch.randn(batch, L, dim, dtype=F64).transpose(1, 2) if channel_last else torch.randn(batch, dim, L, dtype=F64)
    return x, torch.randn(dim, width, dtype=F64), torch.randn(dim, dtype=F64)


@pytest.mark.parametrize("channel_last", [False, True], ids=["channel_first", "channel_last"])
@pytest.mark.parametrize("width", [2, 4])
def test_autograd_entry_matches_the_reference(seed, fake, channel_last, width):
    rows = mixed_rows(random.Random(seed), 3, 21, width=width)
    pos = positions(rows).int()
    x, w, b = make(3, 16, 21, width, channel_last)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    out = _upstream.causal_conv1d(*leaves, "silu", pos)
    assert out.stride() == x.stride(), "output in the input's layout"
    dout = torch.randn(out.shape, dtype=F64)
    g = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref = causal_conv1d_ref(*ref_leaves, "silu", position_ids=pos)
    for a, r in zip((out,) + g, (ref,) + torch.autograd.grad(ref, ref_leaves, dout)):
        torch.testing.assert_close(a, r, **TOL)
    assert ("fwd", True) in fake.calls and ("bwd", True) in fake.calls
    # without boundaries: the plain call (any layout), no seq_idx
    fake.calls.clear()
    torch.testing.assert_close(_upstream.causal_conv1d(x, w, b, None, None), causal_conv1d_ref(x, w, b), **TOL)
    assert fake.calls == [("fwd", False)]


@pytest.mark.parametrize("channel_last", [False, True], ids=["channel_first", "channel_last"])
def test_raw_contract_matches_the_reference(seed, fake, channel_last):
    rows = mixed_rows(random.Random(seed), 2, 17)
    pos = positions(rows).int()
    x, w, b = make(2, 24, 17, 4, channel_last)
    out = _upstream.causal_conv1d_fwd(x, w, b, pos, "silu")
    assert out.stride() == x.stride()
    torch.testing.assert_close(out, _ref_kernels.causal_conv1d_fwd(x, w, b, pos, "silu"), **TOL)
    dout = torch.randn(out.shape, dtype=F64)
    for a, r in zip(_upstream.causal_conv1d_bwd(x, w, b, dout, pos, "silu"),
                    _ref_kernels.causal_conv1d_bwd(x, w, b, dout, pos, "silu")):
        torch.testing.assert_close(a, r, **TOL)
    dx, dw, db = _upstream.causal_conv1d_bwd(x, w, None, dout, pos, None)
    assert db is None and dx.shape == x.shape


def test_fused_mamba_function_with_the_upstream_conv(seed, fake):
    """PackedMambaInnerFn with conv kernels = ops._upstream (scan: the reference kernels) == the reference."""
    torch.manual_seed(seed)
    d_model, d_inner, d_state, r = 6, 16, 3, 2
    ws = [torch.randn(2 * d_inner, d_model, dtype=F64) / 3, None, 0.5 * torch.randn(d_inner, 1, 4, dtype=F64),
          0.1 * torch.randn(d_inner, dtype=F64), torch.randn(r + 2 * d_state, d_inner, dtype=F64) / 4,
          torch.randn(d_inner, r, dtype=F64), torch.randn(d_model, d_inner, dtype=F64) / 4, None,
          -torch.rand(d_inner, d_state, dtype=F64) - 0.2, torch.randn(d_inner, dtype=F64),
          torch.randn(d_inner, dtype=F64) - 1]
    ws = [None if t is None else t.requires_grad_(True) for t in ws]
    rows = [[5, 1, 8], [14]]
    pos = positions(rows).int()
    h = torch.randn(2, 14, d_model, dtype=F64, requires_grad=True)
    out = PackedMambaInnerFn.apply(h, *ws, pos, True, 1, _ref_kernels, _upstream)
    ref = packed_mamba_inner_ref(h, *ws, True, position_ids=pos)
    torch.testing.assert_close(out, ref, **TOL)
    dout = torch.randn(out.shape, dtype=F64)
    wrt = [h] + [t for t in ws if t is not None]
    for a, r_ in zip(torch.autograd.grad(out, wrt, dout), torch.autograd.grad(ref, wrt, dout)):
        torch.testing.assert_close(a, r_, **TOL)
    assert ("fwd", True) in fake.calls and ("bwd", True) in fake.calls
