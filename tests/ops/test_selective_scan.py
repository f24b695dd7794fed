"""Packed selective scan on CPU in float64: the op (``ops.packed_selective_scan``: the custom ops
``packloader::selective_scan_fwd/bwd`` with their reference implementations, an analytic backward) and the
PyTorch oracle ``selective_scan_ref`` (torch autograd through it) against

- an independent oracle written here: a per-sequence, per-timestep loop, deliberately simple;
- running every sequence of the packed rows alone (outputs, and the gradients of u, delta, A, B, C,
  D, z, delta_bias: per-token gradients match slice by slice, parameter gradients sum);

for random length mixes (length-1 sequences, short ones, a row that is one sequence, a padding tail),
both boundary forms, grouped B/C, with and without z / D / delta_bias / softplus; and
``torch.library.opcheck`` of both ops (schema, fake implementation, autograd registration, AOT dispatch).
"""
from __future__ import annotations

import random

import pytest
import torch

import ops
from ops.selective_scan_interface import linear_scan, selective_scan_ref

from ._helpers import channel_major, mixed_rows, positions, spans

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------------
# the oracle


def softplus64(x):
    return torch.log1p(torch.exp(x))


def scan_oracle(u, delta, A, B, C, D, z, delta_bias, softplus, rows):
    """Sequence by sequence, timestep by timestep:
    h = exp(dt * A) * h + dt * B[t] * u[t]; y = <C[t], h> + D * u[t]; y *= silu(z[t]).
    Returns (out (batch, dim, seqlen), last_state (batch, dim, dstate) of each row's last sequence)."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    grouped = B.dim() == 4
    group_of = [d // (dim // B.shape[1]) for d in range(dim)] if grouped else None
    cols, lasts = [], []
    for b, row in enumerate(rows):
        row_cols = []
        t = 0
        for length in row:
            h = torch.zeros(dim, dstate, dtype=F64)
            for _ in range(length):
                dt = delta[b, :, t]
                if delta_bias is not None:
                    dt = dt + delta_bias
                if softplus:
                    dt = softplus64(dt)
                if grouped:
                    Bt, Ct = B[b, group_of, :, t], C[b, group_of, :, t]  # (dim, dstate)
                else:
                    Bt, Ct = B[b, :, t].expand(dim, dstate), C[b, :, t].expand(dim, dstate)
                h = torch.exp(dt[:, None] * A) * h + (dt * u[b, :, t])[:, None] * Bt
                y = (h * Ct).sum(-1)
                if D is not None:
                    y = y + D * u[b, :, t]
                if z is not None:
                    y = y * z[b, :, t] * torch.sigmoid(z[b, :, t])
                row_cols.append(y)
                t += 1
        cols.append(torch.stack(row_cols, -1))
        lasts.append(h)
    return torch.stack(cols), torch.stack(lasts)


# ---------------------------------------------------------------------------------------------
# inputs

VARIANTS = {
    # name: (has_z, has_D, has_delta_bias, softplus, groups)
    "full": (True, True, True, True, 0),
    "bare": (False, False, False, False, 0),
    "grouped": (True, True, False, True, 2),
    "grouped_nogate": (False, True, True, False, 3),
}


def make_inputs(batch, dim, dstate, seqlen, variant, dtype=F64):
    has_z, has_D, has_db, softplus, groups = VARIANTS[variant]
    u = torch.randn(batch, dim, seqlen, dtype=dtype)
    # without softplus the time steps must be positive to keep the state bounded
    delta = 0.5 * torch.randn(batch, dim, seqlen, dtype=dtype) if softplus else torch.rand(batch, dim, seqlen, dtype=dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate, dtype=dtype))
    shape = (batch, dstate, seqlen) if groups == 0 else (batch, groups, dstate, seqlen)
    B = torch.randn(*shape, dtype=dtype)
    C = torch.randn(*shape, dtype=dtype)
    D = torch.randn(dim, dtype=dtype) if has_D else None
    z = torch.randn(batch, dim, seqlen, dtype=dtype) if has_z else None
    db = 0.3 * torch.randn(dim, dtype=dtype) if has_db else None
    return [u, delta, A, B, C, D, z, db], softplus


NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
PER_TOKEN = {"u", "delta", "B", "C", "z"}


def leaves(inputs):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]


def grads_of(out, ins, dout):
    wrt = [t for t in ins if t is not None]
    g = iter(torch.autograd.grad(out, wrt, dout))
    return [None if t is None else next(g) for t in ins]


def run_op(ins, softplus, path, **bounds):
    """path "op": the custom op (what every caller runs); "reference": torch autograd through the oracle."""
    if path == "reference":
        return selective_scan_ref(*ins, delta_softplus=softplus, **bounds)
    assert path == "op"
    return ops.packed_selective_scan(*ins, delta_softplus=softplus, **bounds)


def bounds_for(form, pos):
    if form == "position_ids":
        return {"position_ids": pos}
    return {"seq_idx": ops.position_ids_to_seq_idx(pos)}


def slice_seq(t, name, b, s, e):
    if t is None:
        return None
    if name in ("A", "D", "delta_bias"):
        return t
    return t[b:b + 1, ..., s:e]


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("backend", ["reference", "op"])
@pytest.mark.parametrize("form", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_equals_oracle_and_each_sequence_alone(seed, backend, form, variant):
    rng = random.Random(seed)
    batch, dim, dstate, seqlen = 4, 6, 3, rng.choice([23, 37])  # 37 > 32: the parallel reference scan
    rows = mixed_rows(rng, batch, seqlen)
    print("rows", rows)
    pos = positions(rows)
    inputs, softplus = make_inputs(batch, dim, dstate, seqlen, variant)
    ins = leaves(inputs)
    out = run_op(ins, softplus, backend, **bounds_for(form, pos))
    assert out.shape == (batch, dim, seqlen) and out.dtype == F64
    dout = torch.randn_like(out)
    grads = grads_of(out, ins, dout)

    # 1. the oracle, its gradients by autograd through the loop
    o_ins = leaves(inputs)
    o_out, _ = scan_oracle(*o_ins, softplus, rows)
    torch.testing.assert_close(out, o_out, **TOL)
    for name, g, og in zip(NAMES, grads, grads_of(o_out, o_ins, dout)):
        if g is None:
            assert og is None
            continue
        torch.testing.assert_close(g, og, **TOL, msg=lambda m: f"grad of {name}: {m}")

    # 2. every sequence alone, without boundaries
    acc = {n: torch.zeros_like(t) for n, t in zip(NAMES, inputs) if t is not None and n not in PER_TOKEN}
    for b, s, n in spans(rows):
        e = s + n
        s_ins = leaves([slice_seq(t, name, b, s, e) for name, t in zip(NAMES, inputs)])
        s_out = run_op(s_ins, softplus, backend)
        torch.testing.assert_close(out[b:b + 1, :, s:e], s_out, **TOL)
        for name, g, sg in zip(NAMES, grads, grads_of(s_out, s_ins, dout[b:b + 1, :, s:e].contiguous())):
            if sg is None:
                continue
            if name in PER_TOKEN:
                torch.testing.assert_close(g[b:b + 1, ..., s:e], sg, **TOL, msg=lambda m: f"grad of {name} [{b}, {s}:{e}]: {m}")
            else:
                acc[name] += sg
    for name, total in acc.items():
        torch.testing.assert_close(grads[NAMES.index(name)], total, **TOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("grouped", [False, True])
def test_gradcheck_through_the_autograd_function(seed, grouped):
    """torch.autograd.gradcheck of the op (its analytic reference backward) at tiny sizes, float64."""
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0]])
    inputs, softplus = make_inputs(2, 4, 2, 7, "grouped" if grouped else "full")
    if grouped:
        inputs[7] = 0.3 * torch.randn(4, dtype=F64)  # also delta_bias
    ins = tuple(leaves(inputs))
    assert torch.autograd.gradcheck(
        lambda *a: ops.packed_selective_scan(*a, delta_softplus=softplus, position_ids=pos),
        ins, eps=1e-6, atol=1e-7)


def test_reference_gradcheck_with_parallel_scan(seed):
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    inputs, softplus = make_inputs(1, 2, 2, 9, "full")
    assert torch.autograd.gradcheck(
        lambda *a: selective_scan_ref(*a, delta_softplus=softplus, position_ids=pos, method="parallel"),
        tuple(leaves(inputs)), eps=1e-6, atol=1e-7)


def test_sequential_and_parallel_reference_agree_and_last_state(seed):
    rng = random.Random(seed)
    rows = mixed_rows(rng, 3, 45)
    pos = positions(rows)
    inputs, softplus = make_inputs(3, 5, 4, 45, "full")
    outs = {}
    for method in ("sequential", "parallel", "auto"):
        outs[method] = selective_scan_ref(*inputs, delta_softplus=softplus, position_ids=pos,
                                          return_last_state=True, method=method)
    o_out, o_last = scan_oracle(*inputs, softplus, rows)
    for method, (out, last) in outs.items():
        torch.testing.assert_close(out, o_out, **TOL)
        # the state after each row's last token: that of the row's last sequence only
        torch.testing.assert_close(last, o_last, **TOL)
    with pytest.raises(ValueError, match="unknown method"):
        linear_scan(torch.ones(1, 3), torch.ones(1, 3), dim=1, method="fast")


def test_linear_scan_both_methods(seed):
    a, b = torch.rand(3, 4, 50, dtype=F64), torch.randn(3, 4, 50, dtype=F64)
    want = torch.zeros_like(b)
    h = torch.zeros(3, 4, dtype=F64)
    for t in range(50):
        h = a[..., t] * h + b[..., t]
        want[..., t] = h
    for method in ("sequential", "parallel"):
        torch.testing.assert_close(linear_scan(a, b, dim=2, method=method), want, **TOL)
        # another axis
        torch.testing.assert_close(linear_scan(a.movedim(2, 0), b.movedim(2, 0), dim=0, method=method),
                                   want.movedim(2, 0), **TOL)


def test_linear_scan_reset_both_methods(seed):
    # reset[t]: h[t] = b[t], whatever came before (a pure-Python loop as the oracle), for random reset patterns
    # (resets at 0, adjacent resets, none at all in a row)
    rng = random.Random(seed)
    L = 50
    a, b = torch.rand(3, 4, L, dtype=F64), torch.randn(3, 4, L, dtype=F64)
    reset = torch.tensor([[rng.random() < p for _ in range(L)] for p in (0.0, 0.1, 0.6)])[:, None, :]
    want = torch.zeros_like(b)
    h = torch.zeros(3, 4, dtype=F64)
    for t in range(L):
        h = torch.where(reset[:, :, t], b[..., t], a[..., t] * h + b[..., t])
        want[..., t] = h
    for method in ("sequential", "parallel"):
        got = linear_scan(a, b, dim=2, method=method, reset=reset)
        torch.testing.assert_close(got, want, **TOL)
        # on finite inputs, the same as the multiply-by-zero formulation
        torch.testing.assert_close(got, linear_scan(a * ~reset, b, dim=2, method=method), **TOL)


@pytest.mark.parametrize("method", ["sequential", "parallel"])
def test_inf_state_does_not_cross_a_reset(seed, method):
    # an inf in the last step of the first sequence of a row: the next sequences' outputs and every gradient of
    # their inputs stay finite and equal to each sequence run alone (a reset drops the state, it does not
    # multiply it by zero); with a multiply-by-zero reset they would be NaN
    rows = [[7, 1, 2, 10], [20]]
    inputs, softplus = make_inputs(2, 3, 4, 20, "full")
    u = inputs[0].clone()
    u[0, :, 6] = float("inf")
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (u,) + tuple(inputs[1:])]
    out = selective_scan_ref(*leaves, delta_softplus=softplus, position_ids=positions(rows), method=method)
    dout = torch.randn_like(out)
    dout[0, :, :7] = 0.0   # the loss of the other sequences only
    out.backward(dout)
    for b, s, n in spans(rows):
        if b == 0 and s == 0:
            continue
        assert torch.isfinite(out[b, :, s:s + n]).all(), (b, s)
        alone = [None if t is None else (t[b:b + 1, ..., s:s + n] if t.dim() >= 3 and t.shape[-1] == 20 else t)
                 for t in (u,) + tuple(inputs[1:])]
        o1 = selective_scan_ref(*alone, delta_softplus=softplus, method=method)
        torch.testing.assert_close(out[b:b + 1, :, s:s + n], o1, **TOL)
        for name, leaf in zip(("u", "delta"), leaves[:2]):
            assert torch.isfinite(leaf.grad[b, :, s:s + n]).all(), (name, b, s)


def test_no_boundaries_is_one_sequence_per_row_and_boundaries_matter(seed):
    inputs, softplus = make_inputs(2, 4, 3, 12, "full")
    pos_one = torch.arange(12).expand(2, 12)
    pos_two = positions([[6, 6], [5, 7]])
    for backend in ("reference", "op"):
        plain = run_op(inputs, softplus, backend)
        torch.testing.assert_close(plain, run_op(inputs, softplus, backend, position_ids=pos_one), rtol=0, atol=0)
        two = run_op(inputs, softplus, backend, position_ids=pos_two)
        # the first sequence of each row is unaffected by the reset, the second one is not
        torch.testing.assert_close(two[0, :, :6], plain[0, :, :6], rtol=0, atol=0)
        assert (two[0, :, 6:] - plain[0, :, 6:]).abs().max() > 1e-3


def test_reset_blocks_gradients_across_the_boundary(seed):
    """A loss on the second sequence only gives exactly zero gradient to the first one's inputs."""
    inputs, softplus = make_inputs(1, 4, 3, 16, "full")
    pos = positions([[9, 7]])
    for backend in ("reference", "op"):
        ins = leaves(inputs)
        out = run_op(ins, softplus, backend, position_ids=pos)
        out[..., 9:].sum().backward()
        for name, t in zip(NAMES, ins):
            if name in PER_TOKEN:
                assert t.grad[..., :9].abs().max() == 0, name
                assert t.grad[..., 9:].abs().max() > 0, name


def test_function_handles_non_contiguous_inputs_and_keeps_shapes(seed):
    """B and C as transposed views (what Mamba's x_proj produces), u and z as slices of one tensor."""
    batch, dim, dstate, L = 2, 4, 3, 10
    pos = positions([[4, 6], [1, 9]])
    xz = torch.randn(batch, 2 * dim, L, dtype=F64)
    BC = torch.randn(batch, L, 2 * dstate, dtype=F64)
    delta, A = 0.5 * torch.randn(batch, dim, L, dtype=F64), -torch.rand(dim, dstate, dtype=F64)
    D, db = torch.randn(dim, dtype=F64), torch.randn(dim, dtype=F64)
    results = []
    for make_contiguous in (False, True):
        xz_l, BC_l = xz.clone().requires_grad_(True), BC.clone().requires_grad_(True)
        u, z = xz_l[:, :dim], xz_l[:, dim:]
        B, C = BC_l[..., :dstate].transpose(1, 2), BC_l[..., dstate:].transpose(1, 2)
        if make_contiguous:
            u, z, B, C = (t.contiguous() for t in (u, z, B, C))
        else:
            assert not B.is_contiguous()
        out = ops.packed_selective_scan(u, delta, A, B, C, D, z, db, True, position_ids=pos)
        out.square().sum().backward()
        results.append((out.detach(), xz_l.grad, BC_l.grad))
    for a, b in zip(*results):  # the reference's reductions may round differently over strided memory
        torch.testing.assert_close(a, b, **TOL)


def test_function_backward_twice_with_retain_graph(seed):
    inputs, softplus = make_inputs(2, 4, 3, 9, "grouped")
    pos = positions([[3, 6], [9]])
    ins = leaves(inputs)
    out = run_op(ins, softplus, "op", position_ids=pos)
    out.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in ins if t is not None]
    out.sum().backward()
    for g1, t in zip(first, [t for t in ins if t is not None]):
        torch.testing.assert_close(t.grad, 2 * g1, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_on_cpu(seed, dtype):
    """float32 / bf16 activations (A, D, delta_bias float32, as Mamba passes them): the output has the
    input dtype and is close to the float64 oracle."""
    rows = [[5, 1, 10], [16]]
    pos = positions(rows)
    inputs, softplus = make_inputs(2, 4, 3, 16, "full")
    low = [t if t is None else (t.float() if name in ("A", "D", "delta_bias") else t.to(dtype))
           for name, t in zip(NAMES, inputs)]
    want, _ = scan_oracle(*[None if t is None else t.double() for t in low], softplus, rows)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for backend in ("reference", "op"):
        out = run_op(low, softplus, backend, position_ids=pos)
        assert out.dtype == dtype
        assert ((out.double() - want).norm() / want.norm()).item() <= tol


def test_any_dstate_on_the_cpu(seed):
    """dstate beyond the CUDA kernel's limit runs on the CPU (the reference) and matches the oracle."""
    from ops.contract import MAX_DSTATE

    rows = [[3, 5], [8]]
    inputs, softplus = make_inputs(2, 3, MAX_DSTATE + 4, 8, "full")
    ins = leaves(inputs)
    out = run_op(ins, softplus, "op", position_ids=positions(rows))
    o_ins = leaves(inputs)
    o_out, _ = scan_oracle(*o_ins, softplus, rows)
    torch.testing.assert_close(out, o_out, **TOL)
    dout = torch.randn_like(out)
    for name, g, og in zip(NAMES, grads_of(out, ins, dout), grads_of(o_out, o_ins, dout)):
        torch.testing.assert_close(g, og, **TOL, msg=lambda m: f"grad of {name}: {m}")


# ---------------------------------------------------------------------------------------------
# the custom ops: opcheck, and the contract of `saved`

OPCHECK_CASES = {
    # name: (batch, dim, dstate, seqlen, variant, dtype)
    "full": (2, 6, 3, 11, "full", F64),
    "bare": (2, 6, 3, 11, "bare", F64),
    "grouped": (2, 6, 3, 70, "grouped", F64),          # > one SCAN_CHUNK: two chunk states
    "grouped_nogate": (1, 6, 2, 9, "grouped_nogate", F64),
    "length_1": (2, 4, 3, 1, "full", F64),
    "float32": (2, 4, 3, 9, "full", torch.float32),
    "bfloat16": (2, 4, 3, 9, "bare", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(seed, case):
    batch, dim, dstate, seqlen, variant, dtype = OPCHECK_CASES[case]
    inputs, softplus = make_inputs(batch, dim, dstate, seqlen, variant, dtype=dtype)
    if dtype != F64:  # A, D, delta_bias in float32, as the functional entry hands them to the op
        inputs = [t if t is None or name not in ("A", "D", "delta_bias") else t.float()
                  for name, t in zip(NAMES, inputs)]
    rows = [[1] * min(seqlen, 2) + ([seqlen - 2] if seqlen > 2 else [])] + [[seqlen]] * (batch - 1)
    pos = positions(rows).to(torch.int32)
    fwd_args = (*inputs, pos, softplus)
    ins = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    torch.library.opcheck(torch.ops.packloader.selective_scan_fwd, (*ins, pos, softplus))
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*fwd_args)
    torch.library.opcheck(torch.ops.packloader.selective_scan_bwd, (*fwd_args, saved, torch.randn_like(out)))


@pytest.mark.parametrize("case", ["full", "bare", "grouped"])
def test_channel_major_inputs_give_channel_major_outputs(seed, case):
    """u, delta, z (and dout) laid out as (d, b, L): opcheck (the fake's strides are the reference's), every (b, d, L)
    output in that layout, and the values of the contiguous call."""
    from ops.contract import is_channel_major

    batch, dim, dstate, seqlen, variant, dtype = OPCHECK_CASES[case]
    inputs, softplus = make_inputs(batch, dim, dstate, seqlen, variant, dtype=dtype)
    pos = positions([[1, 2, seqlen - 3]] + [[seqlen]] * (batch - 1)).to(torch.int32)
    cm = [channel_major(t) if name in ("u", "delta", "z") and t is not None else t for name, t in zip(NAMES, inputs)]
    assert is_channel_major(cm[0]) and not cm[0].is_contiguous()
    torch.library.opcheck(torch.ops.packloader.selective_scan_fwd,
                          (*[None if t is None else t.detach().clone().requires_grad_(True) for t in cm], pos, softplus))
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*cm, pos, softplus)
    want_out, want_saved, _ = torch.ops.packloader.selective_scan_fwd(*inputs, pos, softplus)
    assert out.stride() == cm[0].stride() and torch.equal(out, want_out) and torch.equal(saved, want_saved)
    dout = torch.randn_like(want_out)
    torch.library.opcheck(torch.ops.packloader.selective_scan_bwd, (*cm, pos, softplus, saved, channel_major(dout), True))
    got = torch.ops.packloader.selective_scan_bwd(*cm, pos, softplus, saved, channel_major(dout), True)
    want = torch.ops.packloader.selective_scan_bwd(*inputs, pos, softplus, saved, dout, True)
    for i, (g, w) in enumerate(zip(got, want)):
        elementwise = i in (0, 1, 6, 8)   # du, ddelta, dz, out: u's layout, the same values; the rest sums over
        tol = 0 if elementwise else 1e-12  # rows and time, in another order
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=f"output {i}")
        if elementwise and g.numel():
            assert g.stride() == cm[0].stride(), i


def test_saved_holds_the_state_at_every_chunk_end(seed):
    """The contract of `saved`: the state after the last timestep of every SCAN_CHUNK-long chunk (lanes beyond
    dstate zero), float32; the same in every implementation, so a forward on one and a backward on the other
    agree."""
    from ops.contract import SCAN_CHUNK, SCAN_LANES

    rows = [[50, 100], [150]]
    L = 150
    inputs, softplus = make_inputs(2, 3, 4, L, "full")
    pos = positions(rows).to(torch.int32)
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*inputs, pos, softplus)
    assert saved.shape == (2, 3, 3, SCAN_LANES) and saved.dtype == torch.float32
    _, h = selective_scan_ref(*inputs, delta_softplus=softplus, position_ids=pos, return_last_state=True)
    torch.testing.assert_close(saved[:, :, -1, :4], h.float(), rtol=1e-6, atol=1e-6)  # chunk 2 ends at L - 1
    for c, end in enumerate((SCAN_CHUNK, 2 * SCAN_CHUNK)):
        cut = [t if t is None or t.dim() < 3 else t[..., :end] for t in inputs]
        _, h = selective_scan_ref(*cut, delta_softplus=softplus, position_ids=pos[:, :end], return_last_state=True)
        torch.testing.assert_close(saved[:, :, c, :4], h.float(), rtol=1e-6, atol=1e-6)
    assert saved[..., 4:].abs().max() == 0


def test_shape_errors():
    inputs, _ = make_inputs(2, 4, 3, 8, "full")
    u, delta, A, B, C, D, z, db = inputs

    def call(**over):
        kw = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=db)
        kw.update(over)
        return ops.packed_selective_scan(**kw)

    with pytest.raises(ValueError, match=r"u must be \(batch, dim, seqlen\), got \(4, 8\)"):
        call(u=u[0])
    with pytest.raises(ValueError, match=r"delta \(2, 4, 7\) must have u's shape \(2, 4, 8\)"):
        call(delta=delta[..., :7])
    with pytest.raises(ValueError, match=r"A must be \(dim=4, dstate\), got \(3, 3\)"):
        call(A=A[:3])
    with pytest.raises(ValueError, match=r"B must be \(batch, dstate, seqlen\) = \(2, 3, 8\)"):
        call(B=B[..., :7])
    with pytest.raises(ValueError, match=r"C must be .* with dim % n_groups == 0, got \(2, 3, 3, 8\)"):
        call(C=torch.randn(2, 3, 3, 8, dtype=F64))
    with pytest.raises(ValueError, match=r"z \(2, 4, 5\) must have u's shape"):
        call(z=z[..., :5])
    with pytest.raises(ops.BoundaryError, match=r"boundaries have shape \(2, 7\) but the activations are \(batch=2, seqlen=8\)"):
        call(position_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ops.BoundaryError, match=r"position_ids\[1, 4\] = 2 after 3"):
        call(position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 2, 0, 1, 2]]))


@pytest.mark.parametrize("backend", ["reference", "op"])
def test_validate_false_skips_the_boundary_check(backend):
    """validate=False: the caller vouches for the ids; neither the op nor its reference re-checks."""
    inputs, softplus = make_inputs(1, 2, 2, 4, "full")
    bad = torch.tensor([[0, 1, 0, 3]])
    with pytest.raises(ops.BoundaryError):
        run_op(inputs, softplus, backend, position_ids=bad)
    run_op(inputs, softplus, backend, position_ids=bad, validate=False)


@pytest.mark.parametrize("variant", ["full", "bare", "grouped_nogate"])
def test_backward_recomputes_the_forward_output(seed, variant):
    """``recompute_out=True``: the backward also returns the forward's out (what the fused mixer uses instead of
    keeping it); without it, an empty tensor in that place."""
    rows = [[1, 3, 40, 20], [64]]
    inputs, softplus = make_inputs(2, 6, 4, 64, variant)
    pos = positions(rows).to(torch.int32)
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*inputs, pos, softplus)
    dout = torch.randn_like(out)
    with_out = torch.ops.packloader.selective_scan_bwd(*inputs, pos, softplus, saved, dout, True)
    without = torch.ops.packloader.selective_scan_bwd(*inputs, pos, softplus, saved, dout)
    assert torch.equal(with_out[8], out)
    assert without[8].shape == (0,)
    for a, b in zip(with_out[:8], without[:8]):
        assert torch.equal(a, b)
