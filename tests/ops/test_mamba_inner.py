"""The fused packed Mamba-1 mixer (packed_mamba_inner_fn / PackedMambaInnerFn, the kernel ops inside: their
reference implementations on the CPU) in float64: packing-unpacking invariance (outputs and the gradients of
every weight), fused == composed from the functional ops == composed from the PyTorch oracles with torch autograd,
gradcheck of the fused Function, an independent float64 forward."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.conv1d_interface import causal_conv1d_ref
from ops.mamba_inner import packed_mamba_inner_fn, packed_mamba_inner_ref
from ops.selective_scan_interface import selective_scan_ref

from ._helpers import assert_packing_invariant, mixed_rows, out_and_grads, positions

F64 = torch.float64
NAMES = ["in_proj_weight", "in_proj_bias", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight",
         "out_proj_weight", "out_proj_bias", "A", "D", "delta_bias"]


def make_weights(d_model=6, d_inner=8, d_state=3, dt_rank=2, d_conv=4, bias=True, conv_bias=True, dtype=F64):
    def lin(o, i):
        return torch.randn(o, i, dtype=dtype) / math.sqrt(i)

    w = {
        "in_proj_weight": lin(2 * d_inner, d_model),
        "in_proj_bias": 0.1 * torch.randn(2 * d_inner, dtype=dtype) if bias else None,
        "conv1d_weight": 0.5 * torch.randn(d_inner, 1, d_conv, dtype=dtype),
        "conv1d_bias": 0.1 * torch.randn(d_inner, dtype=dtype) if conv_bias else None,
        "x_proj_weight": lin(dt_rank + 2 * d_state, d_inner),
        "delta_proj_weight": lin(d_inner, dt_rank),
        "out_proj_weight": lin(d_model, d_inner),
        "out_proj_bias": 0.1 * torch.randn(d_model, dtype=dtype) if bias else None,
        "A": -torch.exp(0.5 * torch.randn(d_inner, d_state, dtype=dtype)),
        "D": torch.randn(d_inner, dtype=dtype),
        "delta_bias": torch.randn(d_inner, dtype=dtype) - 1.0,
    }
    return {k: (None if v is None else v.requires_grad_(True)) for k, v in w.items()}


def oracle_mixer(h, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                 out_proj_weight, out_proj_bias, A, D, delta_bias, *, position_ids=None, seq_idx=None):
    """The mixer composed from the PyTorch oracles, differentiated by torch autograd (no custom op)."""
    d_inner, dt_rank, d_state = in_proj_weight.shape[0] // 2, delta_proj_weight.shape[1], A.shape[1]
    xz = F.linear(h, in_proj_weight, in_proj_bias).transpose(1, 2)
    x, z = xz[:, :d_inner], xz[:, d_inner:]
    xc = causal_conv1d_ref(x, conv1d_weight, conv1d_bias, "silu", position_ids=position_ids, seq_idx=seq_idx)
    dt, Bm, Cm = torch.split(F.linear(xc.transpose(1, 2), x_proj_weight), [dt_rank, d_state, d_state], dim=-1)
    y = selective_scan_ref(xc, F.linear(dt, delta_proj_weight).transpose(1, 2), A, Bm.transpose(1, 2),
                           Cm.transpose(1, 2), D, z, delta_bias, True, position_ids=position_ids, seq_idx=seq_idx)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def fn_for(w, path, **kw):
    """path "fused": packed_mamba_inner_fn; "composed": packed_mamba_inner_ref (the functional ops);
    "oracle": oracle_mixer."""
    args = [w[n] for n in NAMES]

    def fn(h, **bounds):
        if path == "oracle":
            return oracle_mixer(h, *args, **bounds)
        f = {"fused": packed_mamba_inner_fn, "composed": packed_mamba_inner_ref}[path]
        return f(h, *args, delta_softplus=True, **kw, **bounds)

    params = [w[n] for n in NAMES if w[n] is not None]
    names = [n for n in NAMES if w[n] is not None]
    return fn, params, names


def mixer_oracle(h, w, rows):
    """An independent float64 forward: per sequence, a per-timestep conv and scan."""
    d_inner = w["in_proj_weight"].shape[0] // 2
    dt_rank = w["delta_proj_weight"].shape[1]
    d_state = w["A"].shape[1]
    W = w["conv1d_weight"].shape[-1]
    cw = w["conv1d_weight"].reshape(d_inner, W)
    outs = []
    for b, row in enumerate(rows):
        start, row_out = 0, []
        for n in row:
            xz = h[b, start:start + n] @ w["in_proj_weight"].t()
            if w["in_proj_bias"] is not None:
                xz = xz + w["in_proj_bias"]
            x, z = xz[:, :d_inner], xz[:, d_inner:]
            state = torch.zeros(d_inner, d_state, dtype=F64)
            for t in range(n):
                c = w["conv1d_bias"].clone() if w["conv1d_bias"] is not None else torch.zeros(d_inner, dtype=F64)
                for k in range(min(W, t + 1)):
                    c = c + cw[:, W - 1 - k] * x[t - k]
                xc = c * torch.sigmoid(c)
                dbl = w["x_proj_weight"] @ xc
                dt = F.softplus(w["delta_proj_weight"] @ dbl[:dt_rank] + w["delta_bias"])
                Bt, Ct = dbl[dt_rank:dt_rank + d_state], dbl[dt_rank + d_state:]
                state = torch.exp(dt[:, None] * w["A"]) * state + (dt * xc)[:, None] * Bt[None, :]
                y = (state * Ct[None, :]).sum(-1) + w["D"] * xc
                y = y * z[t] * torch.sigmoid(z[t])
                o = w["out_proj_weight"] @ y
                if w["out_proj_bias"] is not None:
                    o = o + w["out_proj_bias"]
                row_out.append(o)
            start += n
        outs.append(torch.stack(row_out))
    return torch.stack(outs)


@pytest.mark.parametrize("backend", ["fused", "composed"])
@pytest.mark.parametrize("form", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_packing_invariance(seed, backend, form, bias):
    rng = random.Random(seed)
    rows = mixed_rows(rng, 4, rng.choice([11, 19]))
    print("rows", rows)
    w = make_weights(bias=bias, conv_bias=bias)
    h = torch.randn(4, sum(rows[0]), 6, dtype=F64)
    fn, params, names = fn_for(w, backend)
    out, _, _ = assert_packing_invariant(fn, h, params, rows, form, names=names)
    torch.testing.assert_close(out, mixer_oracle(h, w, rows), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
def test_fused_equals_composed_reference(seed, checkpoint_lvl):
    rng = random.Random(seed)
    rows = mixed_rows(rng, 3, 14)
    pos = positions(rows)
    w = make_weights(bias=rng.random() < 0.5, conv_bias=rng.random() < 0.5)
    h = torch.randn(3, 14, 6, dtype=F64)
    fused, params, names = fn_for(w, "fused", checkpoint_lvl=checkpoint_lvl)
    o1, gh1, gp1, dout = out_and_grads(fused, h, params, position_ids=pos)
    for other in ("composed", "oracle"):
        o2, gh2, gp2, _ = out_and_grads(fn_for(w, other)[0], h, params, dout, position_ids=pos)
        torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gh1, gh2, rtol=1e-10, atol=1e-12)
        for n, a, b in zip(names, gp1, gp2):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{other}: grad of {n}: {m}")
    o2 = fn_for(w, "composed")[0](h, position_ids=pos)
    # the explicit reference entry point is the composed path
    torch.testing.assert_close(
        packed_mamba_inner_ref(h, *[w[n] for n in NAMES], True, position_ids=pos), o2, rtol=0, atol=0)


def test_gradcheck_of_the_fused_function(seed):
    w = make_weights(d_model=3, d_inner=4, d_state=2, dt_rank=1, d_conv=3)
    h = torch.randn(2, 6, 3, dtype=F64, requires_grad=True)
    pos = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4]])
    args = [w[n] for n in NAMES]
    assert torch.autograd.gradcheck(
        lambda h_, *a: packed_mamba_inner_fn(h_, *a, delta_softplus=True, position_ids=pos),
        (h, *args), eps=1e-6, atol=1e-7)


def test_no_boundaries_is_one_sequence_per_row(seed):
    w = make_weights()
    h = torch.randn(2, 9, 6, dtype=F64)
    for backend in ("fused", "composed"):
        fn, _, _ = fn_for(w, backend)
        plain = fn(h)
        torch.testing.assert_close(plain, fn(h, position_ids=torch.arange(9).expand(2, 9)), rtol=0, atol=0)
        torch.testing.assert_close(plain, mixer_oracle(h, w, [[9], [9]]), rtol=1e-9, atol=1e-11)
        split = fn(h, position_ids=positions([[4, 5], [9]]))
        assert (split[0, 4:] - plain[0, 4:]).abs().max() > 1e-6  # the boundary matters
        torch.testing.assert_close(split[0, :4], plain[0, :4], rtol=0, atol=1e-14)


def test_float32_fused_and_composed_agree(seed):
    w = make_weights(dtype=torch.float32)
    h = torch.randn(2, 10, 6)
    pos = positions([[3, 7], [1, 1, 8]])
    fused, params, _ = fn_for(w, "fused")
    composed, _, _ = fn_for(w, "composed")
    o1, gh1, _, dout = out_and_grads(fused, h, params, position_ids=pos)
    o2, gh2, _, _ = out_and_grads(composed, h, params, dout, position_ids=pos)
    assert o1.dtype == torch.float32
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh1, gh2, rtol=1e-5, atol=1e-6)


def test_bad_boundaries_are_rejected():
    w = make_weights()
    fn, _, _ = fn_for(w, "fused")
    h = torch.randn(2, 5, 6, dtype=F64)
    with pytest.raises(ops.BoundaryError, match=r"position_ids\[0, 2\] = 4 after 1"):
        fn(h, position_ids=torch.tensor([[0, 1, 4, 0, 1], [0, 1, 2, 3, 4]]))
    with pytest.raises(ops.BoundaryError, match=r"boundaries have shape \(2, 4\)"):
        fn(h, position_ids=torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
def test_the_forward_keeps_no_copy_of_the_scan_output(seed, checkpoint_lvl):
    """Memory: the fused Function keeps x and z (and with checkpoint_lvl=0 the conv output and delta) but not the
    scan's gated output: the scan's backward recomputes it for out_proj's weight gradient. Counted with autograd's
    saved-tensor hooks, which see what a Function saves; the gradients still match the composed reference."""
    batch, L, d_model, d_inner = 2, 12, 6, 8
    w = make_weights(d_model=d_model, d_inner=d_inner, dtype=torch.float32)
    h = torch.randn(batch, L, d_model, requires_grad=True)
    pos = positions([[5, 7], [12]])
    big = []

    def pack(t):
        if tuple(t.shape) == (batch, d_inner, L):
            big.append(t)
        return t

    fn, params, _ = fn_for(w, "fused", checkpoint_lvl=checkpoint_lvl)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(h, position_ids=pos)
    assert len(big) == (2 if checkpoint_lvl == 1 else 4), [tuple(t.shape) for t in big]
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [h, *params], g)
    ref_fn, ref_params, _ = fn_for(w, "composed")
    ref = torch.autograd.grad(ref_fn(h, position_ids=pos), [h, *ref_params], g)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_sum_over_rows_on_cuda(seed, batch, dtype, out_dtype):
    """_wgrad on CUDA (16-bit inputs: one GEMM per batch row into a float32 sum) against float64, returned and
    written into a slice of a larger tensor (the in_proj gradient's halves)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ops.mamba_inner import _wgrad

    m, k, n = 96, 200, 72
    a = torch.randn(batch, m, k, device="cuda").to(dtype)
    b = torch.randn(batch, k, n, device="cuda").to(dtype)
    ref = torch.einsum("imk,ikn->mn", a.double(), b.double())
    got = _wgrad(a, b, out_dtype)
    big = torch.full((2 * m, n), float("nan"), dtype=out_dtype, device="cuda")
    _wgrad(a, b, out_dtype, out=big[m:])
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert torch.isnan(big[:m]).all(), "wrote outside its slice"
    # the float32 sum of exact products (16-bit inputs), rounded once to out_dtype
    tol = (1e-5 if out_dtype == torch.float32 else 8e-3) * ref.abs().max().item()
    for res in (got, big[m:]):
        err = (res.double() - ref).abs().max().item()
        assert err <= tol, (err, tol)
