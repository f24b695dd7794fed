"""GPU tests of the compiled kernels (the CUDA implementations of the torch.ops.packloader ops) against a float64 reference and against running every
sequence of a packed row alone.  Marked `gpu`: skipped cleanly on a machine without CUDA.

Relative error is ||got - round(ref)|| / ||ref|| over the whole tensor, ref the float64 result and round() to the
result's dtype (see kernel_err; the unrounded error is printed too); limits: 1e-5 (fp32), 2e-3 (bf16).
Inputs are fresh random ones each run; the seed is printed so a failure can be replayed (PACKLOADER_TEST_SEED).
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

import ops
from ._helpers import channel_major as cm, misaligned_copy

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}
# about one rounding of the dtype, element by element: two computations of the same values by different paths
ULP_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture(autouse=True)
def _seed():
    seed = int(os.environ.get("PACKLOADER_TEST_SEED", random.randrange(2**31)))
    print(f"seed={seed}")
    torch.manual_seed(seed)
    random.seed(seed)
    yield


class KernelOps:
    """The kernel ops (torch.ops.packloader.*, CUDA implementation) in the call form these tests use:
    scan fwd -> (out, saved, out_z) with out ungated; bwd -> grads with None for absent inputs."""

    @staticmethod
    def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, pos, softplus):
        out, saved, _ = torch.ops.packloader.selective_scan_fwd(u, delta, A, B, C, D, None, delta_bias, pos, softplus)
        out_z = None
        if z is not None:
            out_z, saved_z, _ = torch.ops.packloader.selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, pos, softplus)
            assert torch.equal(saved_z, saved)
        return out, saved, out_z

    @staticmethod
    def selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, out, pos, softplus):
        grads = torch.ops.packloader.selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved, dout)
        given = (u, delta, A, B, C, D, z, delta_bias)
        return tuple(g if t is not None else None for g, t in zip(grads, given))

    @staticmethod
    def causal_conv1d_fwd(x, weight, bias, pos, activation):
        return torch.ops.packloader.causal_conv1d_fwd(x, weight, bias, pos, activation is not None)

    @staticmethod
    def causal_conv1d_bwd(x, weight, bias, dout, pos, activation):
        dx, dw, db = torch.ops.packloader.causal_conv1d_bwd(x, weight, bias, pos, activation is not None, dout)
        return dx, dw, (db if bias is not None else None)


@pytest.fixture(scope="module")
def cuda_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import ops
    from ops import _cuda
    if not _cuda.is_available():
        pytest.skip("CUDA kernels not buildable here (no nvcc)")
    _cuda.load()
    assert "cuda" in ops.available_backends()
    return KernelOps


# ---------------------------------------------------------------------------------------------------------------
# packed rows

def lengths_mix(seqlen: int, kind: str) -> list[int]:
    if kind == "one":
        return [seqlen]
    if kind == "tiny":   # many length-1 / shorter-than-conv-width sequences
        out, left = [], seqlen
        while left > 0:
            n = min(left, random.choice([1, 1, 2, 3, 1, 2]))
            out.append(n)
            left -= n
        return out
    if kind == "padded":   # some sequences, then padding, which counts up as its own segment
        pad = random.randint(1, max(1, seqlen // 5))
        return lengths_mix(seqlen - pad, "mixed") + [pad]
    # mixed: ~10-20 sequences per row, including 1s and short ones
    n_cuts = min(seqlen - 1, random.randint(8, 18))
    cuts = sorted(random.sample(range(1, seqlen), n_cuts))
    if seqlen > 4:
        cuts = sorted(set(cuts + [1, 2, 4]))   # length 1, 1, 2 at the start
    bounds = [0] + cuts + [seqlen]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def position_ids_for(rows: list[list[int]], device) -> torch.Tensor:
    pos = [torch.cat([torch.arange(n) for n in lens]) for lens in rows]
    return torch.stack(pos).to(device)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    return num / den if den > 0 else num


def kernel_err(got: torch.Tensor, ref64: torch.Tensor) -> float:
    """Error of a kernel result against the exact (float64) result *as the result's dtype can hold it*:
    ||got - round(ref)|| / ||ref||. A bf16 tensor cannot be closer to the exact values than their own
    rounding (about 1.6e-3 relative RMS, so 2e-3 on small tensors is a coin toss); this measures what the
    kernel adds to that. For fp32 results the rounding is ~1e-8 and this equals rel_err."""
    return rel_err(got, ref64.to(got.dtype))


def report(errs_kernel: dict, errs_raw: dict) -> None:
    print("vs float64 rounded to the result dtype:", {k: f"{v:.2e}" for k, v in errs_kernel.items()},
          "| vs float64 unrounded:", {k: f"{v:.2e}" for k, v in errs_raw.items()})


def segments(lens):
    s = 0
    for n in lens:
        yield s, s + n
        s += n


# ---------------------------------------------------------------------------------------------------------------
# float64 references (sequential, written for clarity)

def scan_ref64(u, delta, A, B, C, D, z, delta_bias, pos, softplus):
    u, delta, A = u.double(), delta.double(), A.double()
    batch, dim, L = u.shape
    B, C = B.double(), C.double()
    if B.dim() == 3:
        B = B.unsqueeze(1)
    if C.dim() == 3:
        C = C.unsqueeze(1)
    G = B.shape[1]
    B = B.repeat_interleave(dim // G, dim=1)   # (batch, dim, N, L)
    C = C.repeat_interleave(dim // G, dim=1)
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if softplus:
        delta = F.softplus(delta)
    keep = (pos != 0).double()   # (batch, L)
    h = torch.zeros(batch, dim, A.shape[1], dtype=torch.float64, device=u.device)
    ys = []
    for t in range(L):
        a = torch.exp(delta[:, :, t, None] * A) * keep[:, t, None, None]
        h = a * h + delta[:, :, t, None] * B[:, :, :, t] * u[:, :, t, None]
        ys.append((h * C[:, :, :, t]).sum(-1))
    out = torch.stack(ys, -1)
    if D is not None:
        out = out + D.double()[:, None] * u
    out_z = out * F.silu(z.double()) if z is not None else None
    return out, out_z


def conv_ref64(x, weight, bias, pos, activation):
    x = x.double()
    W = weight.shape[-1]
    w = weight.double().reshape(x.shape[1], W)
    out = torch.zeros_like(x)
    if bias is not None:
        out = out + bias.double()[:, None]
    L = x.shape[2]
    for k in range(W):
        shifted = F.pad(x, (k, 0))[..., :L]
        out = out + w[:, W - 1 - k, None] * shifted * (pos >= k)[:, None, :].double()
    return F.silu(out) if activation == "silu" else out


# ---------------------------------------------------------------------------------------------------------------
# selective scan

def make_scan_inputs(batch, dim, dstate, L, dtype, *, groups=0, bc_fp32=False, has_z=True, has_D=True,
                     has_bias=True, device="cuda"):
    u = torch.randn(batch, dim, L, device=device).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L, device=device) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate, device=device))
    bc_dtype = torch.float32 if bc_fp32 else dtype
    shape = (batch, dstate, L) if groups == 0 else (batch, groups, dstate, L)
    Bm = torch.randn(*shape, device=device).to(bc_dtype)
    Cm = torch.randn(*shape, device=device).to(bc_dtype)
    D = torch.randn(dim, device=device) if has_D else None
    z = torch.randn(batch, dim, L, device=device).to(dtype) if has_z else None
    db = 0.5 * torch.randn(dim, device=device) if has_bias else None
    return u, delta, A, Bm, Cm, D, z, db


def scan_ref_grads(inputs, pos, softplus, dout):
    u, delta, A, Bm, Cm, D, z, db = inputs
    leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in inputs]
    out, out_z = scan_ref64(*leaves, pos, softplus)
    final = out_z if out_z is not None else out
    final.backward(dout.double())
    grads = [None if t is None else t.grad for t in leaves]
    # order of the kernel's return: du, ddelta, dA, dB, dC, dD, dz, ddelta_bias
    return out.detach(), (None if out_z is None else out_z.detach()), (
        grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grads[6], grads[7])


GRAD_NAMES = ["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"]


def check_scan(cuda_ops, batch, dim, dstate, L, dtype, kinds, **kw):
    softplus = kw.pop("softplus", True)
    inputs = make_scan_inputs(batch, dim, dstate, L, dtype, **kw)
    if not softplus:  # the kernel then takes delta as given: keep it positive, as Mamba's dt is
        inputs = (inputs[0], F.softplus(inputs[1].float()).to(dtype)) + tuple(inputs[2:])
    u, delta, A, Bm, Cm, D, z, db = inputs
    rows = [lengths_mix(L, kinds[i % len(kinds)]) for i in range(batch)]
    pos = position_ids_for(rows, "cuda")
    tol = TOL[dtype]
    out, saved, out_z = cuda_ops.selective_scan_fwd(u, delta, A, Bm, Cm, D, z, db, pos.int(), softplus)
    assert out.dtype == dtype and out.shape == u.shape
    final = out_z if z is not None else out
    dout = torch.randn_like(final)
    grads = cuda_ops.selective_scan_bwd(u, delta, A, Bm, Cm, D, z, db, dout, saved, out, pos.int(), softplus)
    ref_out, ref_out_z, ref_grads = scan_ref_grads(inputs, pos, softplus, dout)
    errs = {"out": kernel_err(out, ref_out)}
    raw = {"out": rel_err(out, ref_out)}
    if z is not None:
        errs["out_z"] = kernel_err(out_z, ref_out_z)
        raw["out_z"] = rel_err(out_z, ref_out_z)
    for name, g, rg, inp in zip(GRAD_NAMES, grads, ref_grads, [u, delta, A, Bm, Cm, D, z, db]):
        if inp is None:
            assert g is None, name
            continue
        assert g.shape == inp.shape, (name, g.shape, inp.shape)
        want = torch.float32 if name in ("dA", "dD", "ddelta_bias") else inp.dtype
        assert g.dtype == want, (name, g.dtype, want)
        errs[name] = kernel_err(g, rg)
        raw[name] = rel_err(g, rg)
    report(errs, raw)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative error above {tol}: {bad}"
    return inputs, pos, rows, softplus, out, out_z, dout, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kinds", [("mixed", "padded"), ("tiny",), ("one",)])
def test_scan_vs_float64(cuda_ops, dtype, kinds):
    check_scan(cuda_ops, 3, 48, 16, 200, dtype, kinds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_variants(cuda_ops, dtype):
    # dstate 8 (padded lanes), dim not a multiple of 16, no z / D / bias / softplus, short rows
    check_scan(cuda_ops, 2, 40, 8, 70, dtype, ("mixed",), has_z=False, has_D=False, has_bias=False, softplus=False)
    check_scan(cuda_ops, 2, 24, 4, 1, dtype, ("one",))
    check_scan(cuda_ops, 2, 32, 16, 64, dtype, ("tiny", "padded"), has_z=False)
    check_scan(cuda_ops, 2, 48, 16, 333, dtype, ("mixed", "tiny"))   # odd seqlen: staged without cp.async


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_groups_and_fp32_bc(cuda_ops, dtype):
    check_scan(cuda_ops, 2, 64, 16, 150, dtype, ("mixed",), groups=2)           # 32 channels per group
    check_scan(cuda_ops, 2, 40, 16, 90, dtype, ("padded",), groups=2)           # 20 per group: group-by-group path
    # 16 per group: the forward's warps of 32 channels span two groups (16-byte loads; then scalar, odd L)
    check_scan(cuda_ops, 2, 96, 16, 160, dtype, ("mixed",), groups=6)
    check_scan(cuda_ops, 2, 80, 16, 151, dtype, ("tiny", "one"), groups=5)     # and a last warp half empty
    check_scan(cuda_ops, 2, 32, 16, 130, dtype, ("mixed",), bc_fp32=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_matches_each_sequence_alone(cuda_ops, dtype):
    inputs, pos, rows, softplus, out, out_z, dout, grads = check_scan(
        cuda_ops, 2, 32, 16, 160, dtype, ("mixed", "tiny"))
    u, delta, A, Bm, Cm, D, z, db = inputs
    tol = TOL[dtype]
    acc = {"dA": torch.zeros_like(A), "dD": torch.zeros_like(D), "ddelta_bias": torch.zeros_like(db)}
    for b, lens in enumerate(rows):
        for s, e in segments(lens):
            sl = (slice(b, b + 1), slice(None), slice(s, e))
            p1 = torch.arange(e - s, device="cuda", dtype=torch.int32)[None]
            o1, sv1, oz1 = cuda_ops.selective_scan_fwd(u[sl], delta[sl], A, Bm[sl], Cm[sl], D, z[sl], db, p1, softplus)
            assert rel_err(out[sl], o1) <= tol and rel_err(out_z[sl], oz1) <= tol
            g1 = cuda_ops.selective_scan_bwd(u[sl], delta[sl], A, Bm[sl], Cm[sl], D, z[sl], db, dout[sl].contiguous(),
                                             sv1, o1, p1, softplus)
            for name, g, gp in zip(GRAD_NAMES, g1, grads):
                if name in acc:
                    acc[name] += g
                else:
                    assert rel_err(gp[sl], g) <= max(tol, 1e-5) * 4, name
    for name in acc:
        got = grads[GRAD_NAMES.index(name)]
        assert rel_err(got, acc[name]) <= tol, name


def test_scan_reset_blocks_gradient(cuda_ops):
    # the output of sequence 2 must not depend on any input of sequence 1
    u, delta, A, Bm, Cm, D, z, db = make_scan_inputs(1, 16, 16, 96, torch.float32)
    pos = position_ids_for([[40, 56]], "cuda").int()
    out, saved, out_z = cuda_ops.selective_scan_fwd(u, delta, A, Bm, Cm, D, z, db, pos, True)
    dout = torch.zeros_like(out_z)
    dout[..., 40:] = torch.randn_like(dout[..., 40:])
    du, ddelta, dA, dB, dC, dD, dz, ddb = cuda_ops.selective_scan_bwd(u, delta, A, Bm, Cm, D, z, db, dout, saved, out,
                                                                      pos, True)
    for g in (du, ddelta, dB, dC, dz):
        assert g[..., :40].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("has_z,has_D", [(True, True), (True, False), (False, True)], ids=["zD", "z", "D"])
@pytest.mark.parametrize("L", [300, 256])   # the forward's scalar and 16-byte loads
def test_scan_backward_recomputes_the_forward_output_bit_for_bit(cuda_ops, dtype, has_z, has_D, L):
    """The fused mixer keeps no copy of the scan's output: it takes it from the backward (recompute_out=True),
    which must give the forward's bits exactly (the same states, reduction and rounding), so out_proj's weight
    gradient is what it would be from a kept copy. Gradients are unchanged by asking for it."""
    rows = [lengths_mix(L, kind) for kind in ("mixed", "tiny", "padded")]
    pos = position_ids_for(rows, "cuda").int()
    inputs = make_scan_inputs(len(rows), 48, 16, L, dtype, has_z=has_z, has_D=has_D)
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*inputs, pos, True)
    dout = torch.randn_like(out)
    torch.use_deterministic_algorithms(True, warn_only=True)   # dB / dC in a fixed order, so the two backward runs compare exactly
    try:
        g1 = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, saved, dout, True)
        g0 = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, saved, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(g1[8], out)
    assert g0[8].shape == (0,)
    for a, b in zip(g1[:8], g0[:8]):
        assert torch.equal(a, b)


def test_scan_misaligned_contiguous_inputs(cuda_ops):
    """Contiguous bf16 inputs whose data starts 2 bytes past a 4-byte boundary (views at an odd element offset), even
    L: the kernels stage them with plain loads, not cp.async (which faults: misaligned address), and give the
    aligned copies' results. (Found by tests/ops/test_kernel_emulation.py on the CPU.)"""
    L = 96
    rows = [lengths_mix(L, kind) for kind in ("mixed", "tiny")]
    pos = position_ids_for(rows, "cuda").int()
    inputs = make_scan_inputs(len(rows), 32, 16, L, torch.bfloat16)
    dout = torch.randn_like(inputs[0])

    def misaligned(t):
        return t if t is None or t.dtype != torch.bfloat16 else misaligned_copy(t)

    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*inputs, pos, True)
    grads = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, saved, dout, True)
    m = [misaligned(t) for t in inputs]
    out_m, saved_m, _ = torch.ops.packloader.selective_scan_fwd(*m, pos, True)
    grads_m = torch.ops.packloader.selective_scan_bwd(*m, pos, True, saved_m, misaligned(dout), True)
    torch.cuda.synchronize()
    assert torch.equal(out_m, out) and torch.equal(saved_m, saved)
    for name, a, b in zip(GRAD_NAMES + ["out"], grads_m, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)   # dB / dC: float atomics


def test_scan_bf16_accuracy_no_worse_than_upstream_one_by_one(cuda_ops, seed):
    """Issue 13, part 5: on a random packed bf16 row pair, the packed scan's output and gradients are at least as
    close to a float64 computation as mamba-ssm's own bf16 selective_scan_fn run on each sequence alone. Both errors
    are printed side by side (pytest -s)."""
    up = pytest.importorskip("mamba_ssm.ops.selective_scan_interface", reason="needs mamba-ssm (the baseline)")
    from ops.selective_scan_interface import selective_scan_ref

    dim, dstate, L = 256, 16, 2048
    rows = [lengths_mix(L, "mixed"), lengths_mix(L, "padded")]
    pos = position_ids_for(rows, "cuda").int()
    u, delta, A, Bm, Cm, D, z, db = make_scan_inputs(len(rows), dim, dstate, L, torch.bfloat16)
    dout = torch.randn_like(u)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]

    def leaves(dtype=None):
        return [t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, D, z, db)]

    ref = leaves(torch.float64)
    out64 = selective_scan_ref(*ref[:7], delta_bias=ref[7], delta_softplus=True, position_ids=pos)
    g64 = torch.autograd.grad(out64, ref, dout.double())

    ours = leaves()
    out_ours = ops.packed_selective_scan(*ours[:7], ours[7], True, position_ids=pos)
    g_ours = torch.autograd.grad(out_ours, ours, dout)

    theirs = leaves()
    outs = torch.empty_like(out_ours)
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            sl = (slice(r, r + 1), slice(None), slice(s, s + n))
            tu, tdt, tA, tB, tC, tD, tz, tdb = theirs
            # copies: mamba-ssm's kernels load a sequence whose length is a multiple of their block's items with
            # vector loads, which fault (misaligned address) on a view starting at an unaligned offset of the row
            # (seen on an H200: length 128 at offset 326); ours take such views (test_scan_misaligned_contiguous_inputs)
            o = up.selective_scan_fn(*(t[sl].clone() for t in (tu, tdt)), tA, *(t[sl].clone() for t in (tB, tC)), tD,
                                     tz[sl].clone(), tdb, delta_softplus=True)
            o.backward(dout[sl].clone())
            outs[sl] = o.detach()
            s += n
    g_theirs = [t.grad for t in theirs]

    report = [("out", rel_err(out_ours, out64), rel_err(outs, out64))]
    report += [(f"d{name}", rel_err(a, ref64), rel_err(b, ref64)) for name, a, b, ref64 in zip(names, g_ours, g_theirs, g64)]
    print(f"\nbf16 relative error against float64 (seed {seed}): ours (packed) | mamba-ssm one by one")
    for name, e_ours, e_up in report:
        print(f"  {name:12s} {e_ours:.3e} | {e_up:.3e}")
    for name, e_ours, e_up in report:
        # bf16 tensors: as accurate (the same roundings, 1.6e-3 both; dz better); the float32 parameter gradients
        # (dA, dD, ddelta_bias, ~2e-7 both) differ by their summation order: within 1.5x (one running sum over the
        # row instead of per-chunk partials measured 2.7x on dA)
        bound = 1.5 if name in ("dA", "dD", "ddelta_bias") else 1.05
        assert e_ours <= bound * e_up, (name, e_ours, e_up)


# ---------------------------------------------------------------------------------------------------------------
# causal conv1d

def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with the same strides whose storage starts one element past an aligned address: the layout the
    vector kernels refuse (channel-first: the register kernels run; channel-last: the one-step loads)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    if t.is_contiguous():
        out = buf[1:].view(t.shape)
    else:   # channel-last (batch, dim, seqlen) view of (batch, seqlen, dim) memory
        out = buf[1:].view(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2)
    out.copy_(t)
    assert out.stride() == t.stride() and out.data_ptr() % 16 != 0
    return out


def check_conv(cuda_ops, batch, dim, L, width, dtype, kinds, *, channel_last, has_bias=True, activation="silu",
               misalign=False):
    if channel_last:
        x = torch.randn(batch, L, dim, device="cuda").to(dtype).transpose(1, 2)
    else:
        x = torch.randn(batch, dim, L, device="cuda").to(dtype)
    if misalign:
        x = misaligned(x)
    weight = torch.randn(dim, width, device="cuda") * 0.5
    bias = torch.randn(dim, device="cuda") if has_bias else None
    rows = [lengths_mix(L, kinds[i % len(kinds)]) for i in range(batch)]
    pos = position_ids_for(rows, "cuda")
    out = cuda_ops.causal_conv1d_fwd(x, weight, bias, pos.int(), activation)
    assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == dtype
    dout = torch.randn_like(out)
    if misalign:
        dout = misaligned(dout)
    dx, dw, dbias = cuda_ops.causal_conv1d_bwd(x, weight, bias, dout, pos.int(), activation)
    assert dx.shape == x.shape and dx.dtype == dtype and dw.dtype == torch.float32
    assert (dbias is None) == (bias is None)
    xl = x.detach().double().requires_grad_(True)
    wl = weight.detach().double().requires_grad_(True)
    bl = bias.detach().double().requires_grad_(True) if bias is not None else None
    ref = conv_ref64(xl, wl, bl, pos, activation)
    ref.backward(dout.double())
    tol = TOL[dtype]
    errs = {"out": kernel_err(out, ref), "dx": kernel_err(dx, xl.grad), "dweight": kernel_err(dw, wl.grad)}
    raw = {"out": rel_err(out, ref), "dx": rel_err(dx, xl.grad), "dweight": rel_err(dw, wl.grad)}
    if bias is not None:
        errs["dbias"] = kernel_err(dbias, bl.grad)
        raw["dbias"] = rel_err(dbias, bl.grad)
    report(errs, raw)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative error above {tol}: {bad}"
    # each sequence alone: the same values, up to the rounding of the output dtype element by element (a sequence
    # alone may take another kernel path, e.g. an odd length not vectorized, that sums its taps in another order; a
    # norm bound over a 3-token slice failed on one bf16 element one ulp apart, 2.0e-3 of the slice's norm, seed
    # 1801634241). A leak across a boundary is off by the order of the values themselves.
    for b, lens in enumerate(rows):
        for s, e in segments(lens):
            xs = x[b:b + 1, :, s:e]
            xs = xs.transpose(1, 2).contiguous().transpose(1, 2) if channel_last else xs.contiguous()
            p1 = torch.arange(e - s, device="cuda", dtype=torch.int32)[None]
            o1 = cuda_ops.causal_conv1d_fwd(xs, weight, bias, p1, activation)
            assert_within_ulps(out[b:b + 1, :, s:e], o1, dtype)
            dx1, _, _ = cuda_ops.causal_conv1d_bwd(xs, weight, bias, dout[b:b + 1, :, s:e], p1, activation)
            assert_within_ulps(dx[b:b + 1, :, s:e], dx1, dtype)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """got == want element by element up to ULP_RTOL (about one rounding of dtype), near zero relative to want's
    largest magnitude."""
    want = want.float()
    torch.testing.assert_close(got.float(), want, rtol=ULP_RTOL[dtype],
                               atol=ULP_RTOL[dtype] * max(want.abs().max().item(), 1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("seqlen", [333, 2048])   # ragged tails / whole vector runs and several blocks
def test_conv_vs_float64(cuda_ops, dtype, channel_last, width, seqlen):
    check_conv(cuda_ops, 3, 40, seqlen, width, dtype, ("mixed", "tiny", "padded"), channel_last=channel_last)


@pytest.mark.parametrize("kernels", ["regs", "vec"])
@pytest.mark.parametrize("dtype,seqlen", [(torch.bfloat16, 5000), (torch.float32, 4100), (torch.float16, 1032),
                                          (torch.bfloat16, 1000)])
def test_conv_channel_first_kernels(cuda_ops, kernels, dtype, seqlen):
    # the register kernels (storage off the 16-byte grid) and the vector ones (aligned rows; 1024 / 2048 / 4096 steps a
    # block, picked by seqlen); seqlens give several tiles, a partial last tile and (fp32 4100) a partial last run.
    # The per-sequence runs inside check_conv use odd lengths, i.e. the register kernels: the two agree.
    for width in (2, 3, 4):
        check_conv(cuda_ops, 4, 24, seqlen, width, dtype, ("mixed", "tiny", "padded", "one"), channel_last=False,
                   misalign=kernels == "regs")


@pytest.mark.parametrize("dtype,seqlen", [(torch.bfloat16, 5000), (torch.float32, 4100), (torch.bfloat16, 2000),
                                          (torch.float32, 1000)])
def test_conv_channel_first_kernels_elementwise(cuda_ops, dtype, seqlen):
    # The vector kernels element by element against the register kernels (the same data off the 16-byte grid), on
    # many (row, channel, tile) blocks (a norm-based tolerance would let a few wrong blocks through: it did once, for
    # a race in a persistent variant). The forward does the same arithmetic in the same order: equal bits. The
    # backward sums dx in another order: within one rounding of the dtype; dweight / dbias are fp32 sums in another
    # order.
    batch, dim, width = 2, 1024, 4
    x = torch.randn(batch, dim, seqlen, device="cuda").to(dtype)
    weight = torch.randn(dim, width, device="cuda") * 0.5
    bias = torch.randn(dim, device="cuda")
    dout = torch.randn_like(x)
    rows = [lengths_mix(seqlen, k) for k in ("mixed", "tiny")]
    pos = position_ids_for(rows, "cuda").int()
    xm, doutm = misaligned(x), misaligned(dout)
    out_r = cuda_ops.causal_conv1d_fwd(xm, weight, bias, pos, "silu")
    dx_r, dw_r, db_r = cuda_ops.causal_conv1d_bwd(xm, weight, bias, doutm, pos, "silu")
    for _ in range(2):   # twice: a race shows up as a difference between runs too
        out = cuda_ops.causal_conv1d_fwd(x, weight, bias, pos, "silu")
        dx, dw, db = cuda_ops.causal_conv1d_bwd(x, weight, bias, dout, pos, "silu")
        bad = (out != out_r).sum().item()
        assert bad == 0, f"{bad} forward outputs differ from the register kernel"
        torch.testing.assert_close(dx.float(), dx_r.float(), rtol=ULP_RTOL[dtype], atol=1e-5 * dx_r.float().abs().max().item())
        torch.testing.assert_close(dw, dw_r, rtol=1e-4, atol=1e-4 * dw_r.abs().max().item())
        torch.testing.assert_close(db, db_r, rtol=1e-4, atol=1e-4 * db_r.abs().max().item())


def tile_edge_row(seqlen: int) -> list[int]:
    """Sequences starting at 1024k + {0, 1, 2, 3} and 1024k - 1: every tile edge of the vector kernels has a boundary
    right at it, inside the 3 steps a tap reaches, and one step before it."""
    starts = {0}
    for edge in range(1024, seqlen, 1024):
        starts |= {edge - 1, edge, edge + 1, edge + 3}
    starts = sorted(t for t in starts if t < seqlen)
    return [b - a for a, b in zip(starts, starts[1:] + [seqlen])]


@pytest.mark.parametrize("dtype,seqlen", [(torch.float32, 4), (torch.float32, 12), (torch.float32, 1028),
                                          (torch.float32, 2052), (torch.bfloat16, 8), (torch.bfloat16, 16),
                                          (torch.bfloat16, 1032), (torch.float16, 3080), (torch.float32, 4104),
                                          (torch.bfloat16, 6152)])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_vector_kernels_edge_cases(cuda_ops, dtype, seqlen, width):
    # fixed shapes the vector kernels must get right: a single partial run (fp32 L=4), runs past a tile edge by 4
    # or 8 steps, boundaries at every tile edge, no silu and no bias; against float64 and element by element
    # against the register kernels
    x = torch.randn(3, 16, seqlen, device="cuda").to(dtype)
    weight = torch.randn(16, width, device="cuda") * 0.5
    dout = torch.randn_like(x)
    rows = [tile_edge_row(seqlen), lengths_mix(seqlen, "tiny"), lengths_mix(seqlen, "one")]
    pos = position_ids_for(rows, "cuda").int()
    xm, doutm = misaligned(x), misaligned(dout)
    for bias, act in ((torch.randn(16, device="cuda"), "silu"), (None, None)):
        ref = (cuda_ops.causal_conv1d_fwd(xm, weight, bias, pos, act),
               *cuda_ops.causal_conv1d_bwd(xm, weight, bias, doutm, pos, act))
        got = (cuda_ops.causal_conv1d_fwd(x, weight, bias, pos, act),
               *cuda_ops.causal_conv1d_bwd(x, weight, bias, dout, pos, act))
        assert torch.equal(got[0], ref[0]), "forward differs from the register kernels"
        torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=ULP_RTOL[dtype],
                                   atol=1e-5 * ref[1].float().abs().max().item())
        torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-4 * ref[2].abs().max().item())
        assert (got[3] is None) == (bias is None)
        xl = x.detach().double().requires_grad_(True)
        wl = weight.detach().double().requires_grad_(True)
        out64 = conv_ref64(xl, wl, None if bias is None else bias.double(), pos, act)
        out64.backward(dout.double())
        tol = TOL[dtype]
        assert kernel_err(got[0], out64) <= tol and kernel_err(got[1], xl.grad) <= tol
        assert kernel_err(got[2], wl.grad) <= tol


@pytest.mark.parametrize("layout,seqlen", [("channel-first", 2048), ("channel-first", 333), ("channel-last", 2048),
                                           ("channel-last", 333)])
def test_conv_inf_does_not_cross_a_boundary(cuda_ops, layout, seqlen):
    # an inf in the last step of one sequence: every other sequence's outputs and input gradients stay finite and
    # equal to the same sequence run alone (a dropped tap is skipped, not multiplied by zero). Channel-first 2048
    # runs the vector kernels, 333 the register kernels.
    dim, width = (32 if seqlen % 8 == 0 else 36), 4   # 36 channels: the channel-last forward's one-step path
    mid = (seqlen - 103) // 2
    rows = [[100, 1, 2, mid, seqlen - 103 - mid], [seqlen]]
    pos = position_ids_for(rows, "cuda").int()
    x = torch.randn(2, seqlen, dim, device="cuda").transpose(1, 2) if layout == "channel-last" else \
        torch.randn(2, dim, seqlen, device="cuda")
    x = x.to(torch.bfloat16)
    x[0, :, 99] = float("inf")   # the last step of sequence [0, 100)
    weight = torch.randn(dim, width, device="cuda") * 0.5
    bias = torch.randn(dim, device="cuda")
    dout = torch.randn_like(x)
    out = cuda_ops.causal_conv1d_fwd(x, weight, bias, pos, "silu")
    dx, _, _ = cuda_ops.causal_conv1d_bwd(x, weight, bias, dout, pos, "silu")
    for s, e in ((100, 101), (101, 103), (103, 103 + mid), (103 + mid, seqlen)):
        xs = x[0:1, :, s:e]
        xs = xs.transpose(1, 2).contiguous().transpose(1, 2) if layout == "channel-last" else xs.contiguous()
        p1 = torch.arange(e - s, device="cuda", dtype=torch.int32)[None]
        o1 = cuda_ops.causal_conv1d_fwd(xs, weight, bias, p1, "silu")
        d1, _, _ = cuda_ops.causal_conv1d_bwd(xs, weight, bias, dout[0:1, :, s:e], p1, "silu")
        assert torch.isfinite(out[0:1, :, s:e]).all() and torch.isfinite(dx[0:1, :, s:e]).all(), (s, e)
        assert rel_err(out[0:1, :, s:e], o1) <= TOL[torch.bfloat16], (s, e)
        assert rel_err(dx[0:1, :, s:e], d1) <= TOL[torch.bfloat16], (s, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_conv_channel_last_grouped_loads_equal_plain(cuda_ops, dtype):
    # aligned channel-last rows load 8 timesteps at a time, rows off the vector grid one at a time; the arithmetic
    # is the same code, so every output and gradient has the same bits
    batch, dim, L, width = 2, 512, 1003, 4   # (1003: the last group of 8 steps is partial)
    x = torch.randn(batch, L, dim, device="cuda").to(dtype).transpose(1, 2)
    weight = torch.randn(dim, width, device="cuda") * 0.5
    bias = torch.randn(dim, device="cuda")
    dout = torch.randn(batch, L, dim, device="cuda").to(dtype).transpose(1, 2)
    pos = position_ids_for([lengths_mix(L, k) for k in ("mixed", "tiny")], "cuda").int()
    res = {}
    for mode in ("plain", "grouped"):
        xi, gi = (misaligned(x), misaligned(dout)) if mode == "plain" else (x, dout)
        res[mode] = (cuda_ops.causal_conv1d_fwd(xi, weight, bias, pos, "silu"),
                     *cuda_ops.causal_conv1d_bwd(xi, weight, bias, gi, pos, "silu"))
    for name, a, b in zip(("out", "dx", "dweight", "dbias"), res["grouped"], res["plain"]):
        if name in ("out", "dx"):
            assert torch.equal(a, b), name
        else:   # block sums in the same order, atomics across blocks in any order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("channel_last", [False, True])
def test_conv_variants(cuda_ops, channel_last):
    check_conv(cuda_ops, 2, 64, 1024, 4, torch.float32, ("one", "mixed"), channel_last=channel_last,
               has_bias=False, activation=None)
    check_conv(cuda_ops, 2, 8, 3, 4, torch.bfloat16, ("tiny",), channel_last=channel_last)
    check_conv(cuda_ops, 2, 13, 77, 4, torch.bfloat16, ("mixed",), channel_last=channel_last)  # ragged channels
    check_conv(cuda_ops, 1, 6, 1030, 3, torch.float32, ("one", "tiny"), channel_last=channel_last)


# ---- carried states: the CUDA kernels against the float64 reference, and pieces across calls against the whole ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 48, 16, 200, 0), (1, 64, 16, 2048, 0), (2, 96, 13, 640, 2)],
                         ids=["b3L200", "b1L2048-segments", "b2L640-groups"])
def test_scan_states_vs_float64(dtype, shape):
    """Initial states (random flags), every final state, a gradient into the final states: the kernel's output,
    final states and every gradient (the initial states' included) against the float64 reference implementation;
    the one-row shape runs the forward and backward cut into segments."""
    from ops import selective_scan_interface as ssi
    from ops.states import state_slots
    batch, dim, dstate, L, groups = shape
    inputs = make_scan_inputs(batch, dim, dstate, L, dtype, groups=groups)
    pos = position_ids_for([lengths_mix(L, k) for k in ("mixed", "tiny", "one")[:batch]], "cuda").int().contiguous()
    count = int((pos == 0).sum())
    slots = state_slots(pos, torch.rand(count, device="cuda") < 0.6, True)
    h0, dfinal = torch.randn(count, dim, dstate, device="cuda"), torch.randn(count, dim, dstate, device="cuda")
    out, saved, final = torch.ops.packloader.selective_scan_fwd(*inputs, pos, True, slots, h0, count)
    dout = torch.randn_like(out)
    grads = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, saved, dout, True, slots, h0, dfinal)
    args64 = [None if t is None else t.double() for t in inputs]
    ref_out, _, ref_final = ssi._scan_fwd_reference(*args64, pos, True, slots, h0.double(), count)
    ref = ssi._scan_bwd_reference(*args64, pos, True, saved, dout.double(), True, slots, h0.double(),
                                  dfinal.double())
    assert kernel_err(out, ref_out) <= TOL[dtype]
    assert kernel_err(final, ref_final) <= (1e-5 if dtype == torch.float32 else TOL[dtype])
    for name, g, rg in zip(GRAD_NAMES + ["out", "dinitial_state"], grads, ref):
        assert not g.isnan().any(), name
        assert kernel_err(g, rg) <= (1e-5 if dtype == torch.float32 else TOL[dtype]), (name, kernel_err(g, rg))
    assert torch.equal(grads[8], out)
    torch.use_deterministic_algorithms(True)   # deterministic mode: the same bits twice, with states too
    try:
        det = [torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, saved, dout, True, slots, h0, dfinal)
               for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(GRAD_NAMES + ["out", "dinitial_state"], *det):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 1024, 16, 4096), (3, 96, 13, 1000)], ids=["b2-d1024-L4096", "b3L1000"])
def test_scan_row_edge_states_match_the_states_variant(dtype, shape):
    """Row-edge slots ((2, batch): context parallelism) on the plain kernels against the same states per token on
    the states variant: the output, saved and final states bit for bit, every gradient within rounding of the
    atomics (dB / dC) and the initial states' gradient equal; and against float64."""
    from ops import selective_scan_interface as ssi
    from ops.states import token_slots
    batch, dim, dstate, L = shape
    inputs = make_scan_inputs(batch, dim, dstate, L, dtype)
    lens = [[L], lengths_mix(L, "mixed"), lengths_mix(L, "tiny")][:batch]
    pos = position_ids_for(lens, "cuda").int().contiguous()
    edges = torch.tensor([[1, -1, 0][:batch], [0, 1, -1][:batch]], dtype=torch.int32, device="cuda")
    per_token = token_slots(edges, L).contiguous()
    h0, dfinal = torch.randn(2, dim, dstate, device="cuda"), torch.randn(2, dim, dstate, device="cuda")
    got = torch.ops.packloader.selective_scan_fwd(*inputs, pos, True, edges, h0, 2)
    want = torch.ops.packloader.selective_scan_fwd(*inputs, pos, True, per_token, h0, 2)
    for name, a, b in zip(("out", "saved", "final_state"), got, want):
        assert torch.equal(a, b), name
    dout = torch.randn_like(got[0])
    grads = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, got[1], dout, True, edges, h0, dfinal)
    grads_tok = torch.ops.packloader.selective_scan_bwd(*inputs, pos, True, got[1], dout, True, per_token, h0,
                                                        dfinal)
    args64 = [None if t is None else t.double() for t in inputs]
    ref = ssi._scan_bwd_reference(*args64, pos, True, got[1], dout.double(), True, edges, h0.double(),
                                  dfinal.double())
    for name, g, gt, rg in zip(GRAD_NAMES + ["out", "dinitial_state"], grads, grads_tok, ref):
        assert not g.isnan().any(), name
        assert kernel_err(g, gt) <= (1e-6 if dtype == torch.float32 else 1e-3) and kernel_err(g, rg) <= (1e-5 if dtype == torch.float32 else TOL[dtype]), (
            name, kernel_err(g, gt), kernel_err(g, rg))
    assert torch.equal(grads[8], got[0]) and torch.equal(grads[9], grads_tok[9])


def test_scan_pieces_across_calls_match_the_whole_document_fp32():
    """A 4000-token document cut into pieces of 2048, 1, 3 and 1948 tokens, each packed into a later call among other
    sequences and started from the final state of the piece before: outputs and every gradient within 1e-5 of the
    whole document run alone (fp32 kernel against fp32 kernel)."""
    dim, dstate, N = 64, 16, 4000
    whole_in = [t.requires_grad_(True) if t is not None else None
                for t in make_scan_inputs(1, dim, dstate, N, torch.float32)]
    u, delta, A, Bm, Cm, D, z, db = whole_in
    whole = ops.packed_selective_scan(u, delta, A, Bm, Cm, D, z, db, True)
    g = torch.randn_like(whole)
    want = torch.autograd.grad((whole * g).sum(), whole_in)
    state, loss, a = None, 0, 0
    for b in (2048, 2049, 2052, 4000):
        n = b - a
        Lrow = 2048
        left = random.randint(0, Lrow - n) if n < Lrow else 0
        fill_l, fill_r = left, Lrow - n - left
        row = lambda t, c: torch.cat([torch.randn(1, c, fill_l, device="cuda"), t[..., a:b],  # noqa: E731
                                      torch.randn(1, c, fill_r, device="cuda")], -1)
        pos = torch.cat([torch.arange(fill_l), torch.arange(n), torch.arange(fill_r)])[None].cuda()
        if fill_l == 0:
            pos = torch.cat([torch.arange(n), torch.arange(fill_r)])[None].cuda()
        seq_no = 1 if fill_l else 0
        count = int((pos == 0).sum())
        has = torch.zeros(count, dtype=torch.bool, device="cuda")
        init = torch.zeros(count, dim, dstate, device="cuda")
        if state is not None:
            has[seq_no] = True
            init = torch.cat([init[:seq_no], state[None], init[seq_no + 1:]])
        out, final = ops.packed_selective_scan(row(u, dim), row(delta, dim), A, row(Bm, dstate), row(Cm, dstate), D,
                                               row(z, dim), db, True, position_ids=pos, initial_state=init,
                                               has_initial_state=has, output_final_state=True)
        piece = out[0, :, fill_l:fill_l + n]
        assert rel_err(piece, whole[0, :, a:b]) <= 1e-5
        loss = loss + (piece * g[0, :, a:b]).sum()
        state, a = final[seq_no], b
    got = torch.autograd.grad(loss, whole_in)
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert rel_err(x, y) <= 1e-5, (name, rel_err(x, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channel_last", [False, True], ids=["cf", "cl"])
def test_conv_states_on_the_kernels_vs_float64(dtype, channel_last):
    """The conv's initial / final states on the CUDA kernels (sequences of 1-3 tokens continue from states that
    reach over them) against the float64 reference run on [state, sequence] for every sequence: outputs, final
    states, and the gradients of x, weight, bias and the initial states."""
    batch, dim, L, width = 2, 64, 256, 4
    rows = [lengths_mix(L, "tiny"), lengths_mix(L, "mixed")]
    pos = position_ids_for(rows, "cuda")
    x = torch.randn(batch, L, dim, device="cuda").to(dtype).transpose(1, 2) if channel_last else \
        torch.randn(batch, dim, L, device="cuda").to(dtype)
    x.requires_grad_(True)
    w = torch.randn(dim, width, device="cuda", requires_grad=True)
    bias = torch.randn(dim, device="cuda", requires_grad=True)
    count = int((pos == 0).sum())
    init = torch.randn(count, dim, width - 1, device="cuda").to(dtype).requires_grad_(True)
    has = torch.rand(count, device="cuda") < 0.6
    out, final = ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos, initial_state=init,
                                          has_initial_state=has, output_final_state=True)
    go, gf = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * go).sum() + (final * gf).sum(), [x, w, bias, init])
    # float64: each sequence alone after its state (zeros without one)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, bias))
    i64 = init.detach().double().requires_grad_(True)
    xs = x64.unbind(0)
    outs, finals, i = [[] for _ in range(batch)], [], 0
    for r, lens in enumerate(rows):
        c = 0
        for m in lens:
            h = torch.where(has[i], i64[i], torch.zeros_like(i64[i]))
            ext = torch.cat([h, xs[r][:, c:c + m]], -1)[None]
            outs[r].append(ops.causal_conv1d_ref(ext, w64, b64, "silu")[0, :, width - 1:])
            finals.append(ext[0, :, -(width - 1):])
            c += m
            i += 1
    ref_out = torch.stack([torch.cat(o, -1) for o in outs])
    ref_final = torch.stack(finals)
    ref_grads = torch.autograd.grad((ref_out * go.double()).sum() + (ref_final * gf.double()).sum(),
                                    [x64, w64, b64, i64])
    assert kernel_err(out, ref_out) <= TOL[dtype]
    assert torch.equal(final, ref_final.to(dtype))
    for name, g, rg in zip(["dx", "dweight", "dbias", "dinitial_state"], grads, ref_grads):
        assert kernel_err(g, rg) <= TOL[dtype], (name, kernel_err(g, rg))


# ---------------------------------------------------------------------------------------------------------------
# channel-major activations (ops.contract.is_channel_major): the fused mixer's layout

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,seqlen", [(torch.bfloat16, 4096), (torch.bfloat16, 1001), (torch.float32, 600)])
def test_channel_major_layout_matches_contiguous(cuda_ops, dtype, seqlen):
    """u, delta, z, dout (and the conv's x) laid out as (d, b, L): the kernels read and write that layout in place,
    every (b, d, L) output comes in it, with the contiguous call's bits (dB / dC, dA, dD, ddelta_bias: float atomics
    or sums in another order: within 1e-5); an odd L takes the plain loads, 4096 the 16-byte copies. Then the fused
    mixer, whose activations are channel-major, against the contiguous functional path."""
    dev = torch.device("cuda")
    batch, dim, dstate = 3, 64, 16
    pos = position_ids_for([lengths_mix(seqlen, k) for k in ("mixed", "tiny", "padded")], dev).to(torch.int32)
    u = torch.randn(batch, dim, seqlen, device=dev).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, seqlen, device=dev) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate, device=dev))
    B, C = (torch.randn(batch, dstate, seqlen, device=dev).to(dtype) for _ in range(2))
    D, db = torch.randn(dim, device=dev), 0.5 * torch.randn(dim, device=dev)
    z, dout = torch.randn_like(u), torch.randn_like(u)
    scan = torch.ops.packloader
    want_out, want_saved, _ = scan.selective_scan_fwd(u, delta, A, B, C, D, z, db, pos, True)
    out, saved, _ = scan.selective_scan_fwd(cm(u), cm(delta), A, B, C, D, cm(z), db, pos, True)
    layout = cm(u).stride()
    assert out.stride() == layout and torch.equal(out, want_out) and torch.equal(saved, want_saved)
    want = scan.selective_scan_bwd(u, delta, A, B, C, D, z, db, pos, True, want_saved, dout, True)
    got = scan.selective_scan_bwd(cm(u), cm(delta), A, B, C, D, cm(z), db, pos, True, saved, cm(dout), True)
    for name, g, w in zip(GRAD_NAMES + ["out"], got, want):
        if name in ("du", "ddelta", "dz", "out"):
            assert g.stride() == layout and torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    w4 = torch.randn(dim, 4, device=dev)
    xo = scan.causal_conv1d_fwd(cm(u), w4, D, pos, True)
    assert xo.stride() == layout and torch.equal(xo, scan.causal_conv1d_fwd(u, w4, D, pos, True))
    dx, dw, dbias = scan.causal_conv1d_bwd(cm(u), w4, D, pos, True, cm(dout))
    dx0, dw0, dbias0 = scan.causal_conv1d_bwd(u, w4, D, pos, True, dout)
    assert dx.stride() == layout and torch.equal(dx, dx0) and torch.equal(dw, dw0) and torch.equal(dbias, dbias0)
    # the fused mixer (channel-major inside) against the functional path (contiguous), fp32, every gradient
    if dtype == torch.float32:
        from ops import packed_mamba_inner_fn, packed_mamba_inner_ref

        d_model, d_inner, r = 32, dim, 4
        params = [torch.randn(2 * d_inner, d_model, device=dev) * 0.1, None, torch.randn(d_inner, 1, 4, device=dev),
                  torch.randn(d_inner, device=dev), torch.randn(r + 2 * dstate, d_inner, device=dev) * 0.1,
                  torch.randn(d_inner, r, device=dev) * 0.3, torch.randn(d_model, d_inner, device=dev) * 0.1, None,
                  A, D, db]
        params = [p if p is None else p.clone().requires_grad_(True) for p in params]
        h = torch.randn(batch, seqlen, d_model, device=dev, requires_grad=True)
        g = torch.randn(batch, seqlen, d_model, device=dev)
        outs = []
        for fn in (packed_mamba_inner_fn, packed_mamba_inner_ref):
            y = fn(h, *params, position_ids=pos)
            grads = torch.autograd.grad(y, [h] + [p for p in params if p is not None], g)
            outs.append((y, grads))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
