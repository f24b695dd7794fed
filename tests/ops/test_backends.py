"""ops.backends: the dispatch rule for every input kind (CPU fp32/fp64/bf16/fp16, CUDA cases the kernel takes and
cases it refuses, the override), the override's mechanics, and the CUDA implementations' Python side (input
preparation, output allocation, the calls into the extension) run on the CPU against a stand-in extension that
checks what the C++ binding assumes and fills the outputs with the reference. Also: ``import ops`` on a machine
without mamba-ssm, causal-conv1d, triton or a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ops
from ops.contract import CONV_SLOT_STEPS, SCAN_BLOCK_CHANNELS, scan_blocks
from ops import backends
from ops import conv1d_interface as conv_mod
from ops import selective_scan_interface as scan_mod
from ops.backends import KernelUnsupportedError, get_backend, implementation, set_backend, use_backend
from ops.contract import MAX_DSTATE, SCAN_LANES, scan_bwd_segments, scan_chunks, scan_fwd_segments

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = not torch.cuda.is_available()
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


# ---------------------------------------------------------------------------------------------------------------
# the rule

@pytest.mark.parametrize("op", backends.OPS)
@pytest.mark.parametrize("device_type", ["cpu", "meta", "mps"])
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16])
def test_anything_but_cuda_runs_the_reference(op, device_type, dtype):
    assert implementation(op, device_type, dtype, dstate=64, width=7) == "reference"


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_cuda_tensors_run_the_kernel(dtype):
    assert implementation("selective_scan", "cuda", dtype, dstate=1) == "cuda"
    assert implementation("selective_scan", "cuda", dtype, dstate=MAX_DSTATE) == "cuda"
    for width in (2, 3, 4):
        assert implementation("causal_conv1d", "cuda", dtype, width=width) == "cuda"


@pytest.mark.parametrize(
    "op, dtype, case, reason",
    [
        ("selective_scan", F64, {"dstate": 4}, r"float32/float16/bfloat16 inputs, got torch\.float64"),
        ("causal_conv1d", F64, {"width": 4}, r"float32/float16/bfloat16 inputs, got torch\.float64"),
        ("selective_scan", BF16, {"dstate": MAX_DSTATE + 1}, rf"dstate <= {MAX_DSTATE}, got dstate={MAX_DSTATE + 1}"),
        ("causal_conv1d", F32, {"width": 1}, r"conv widths 2\.\.4, got width=1"),
        ("causal_conv1d", F16, {"width": 5}, r"conv widths 2\.\.4, got width=5"),
    ],
)
def test_cuda_cases_the_kernel_cannot_take_raise_and_say_how_to_get_the_reference(op, dtype, case, reason):
    with pytest.raises(KernelUnsupportedError, match=rf"{op} on CUDA tensors: the kernel takes {reason}.*"
                                                     r'with ops\.use_backend\("reference"\)'):
        implementation(op, "cuda", dtype, **case)
    with use_backend("reference"):  # ... and the override runs them on the reference
        assert implementation(op, "cuda", dtype, **case) == "reference"


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_cpu_tensors_run_the_reference_implementation(seed, monkeypatch, dtype):
    """Through the real ops and torch's dispatcher: CPU tensors of every dtype run the reference implementations
    (forward and backward) and never reach the CUDA implementations or the kernels."""
    def unreachable(*a, **k):
        raise AssertionError("the CUDA path ran for CPU tensors")

    monkeypatch.setattr(backends, "load_kernels", unreachable)
    monkeypatch.setattr(backends, "implementation", unreachable)  # only the CUDA implementations ask
    u, delta, A, B, C, D, z, db, pos, softplus = scan_case(dtype, dim=8, L=10)
    u.requires_grad_(True)
    out = ops.packed_selective_scan(u, delta, A, B, C, D, z, db, softplus, position_ids=pos)
    out.float().sum().backward()
    want = scan_mod._scan_fwd_reference(u.detach(), delta, A, B, C, D, z, db, pos, softplus)[0]
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    x = torch.randn(2, 8, 10).to(dtype).requires_grad_(True)
    y = ops.packed_causal_conv1d(x, torch.randn(8, 4), activation="silu", position_ids=pos)
    y.float().sum().backward()
    assert out.dtype == y.dtype == dtype and u.grad.dtype == x.grad.dtype == dtype


def test_the_override_sends_cuda_tensors_to_the_reference():
    with use_backend("reference"):
        for dtype in (F32, BF16):
            assert implementation("selective_scan", "cuda", dtype, dstate=16) == "reference"
            assert implementation("causal_conv1d", "cuda", dtype, width=4) == "reference"
    assert implementation("selective_scan", "cuda", F32, dstate=16) == "cuda"


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'scan'"):
        implementation("scan", "cuda", F32)


# ---------------------------------------------------------------------------------------------------------------
# the override's mechanics

def test_use_backend_nests_and_restores_even_on_error():
    assert get_backend() == "auto"
    with use_backend("reference"):
        assert get_backend() == "reference"
        with use_backend("auto"):
            assert get_backend() == "auto"
        assert get_backend() == "reference"
    assert get_backend() == "auto"
    with pytest.raises(RuntimeError, match="boom"):
        with use_backend("reference"):
            raise RuntimeError("boom")
    assert get_backend() == "auto"


def test_set_backend_is_the_same_switch():
    set_backend("reference")
    assert get_backend() == "reference"
    assert implementation("causal_conv1d", "cuda", F32, width=4) == "reference"
    with use_backend(None):
        assert get_backend() == "auto"
    assert get_backend() == "reference"
    set_backend(None)
    assert get_backend() == "auto"


@pytest.mark.parametrize("name", ["cuda", "upstream", "ref_kernel", "triton"])
def test_removed_and_unknown_backends_are_refused(name):
    with pytest.raises(ValueError, match=rf"unknown backend '{name}'; choose from \('auto', 'reference'\)"):
        set_backend(name)
    with pytest.raises(ValueError, match=rf"unknown backend '{name}'"):
        with use_backend(name):
            pass
    x = torch.randn(1, 4, 6)
    with pytest.raises(ValueError, match=rf"unknown backend '{name}'"):
        ops.packed_causal_conv1d(x, torch.randn(4, 3), backend=name)
    assert get_backend() == "auto"  # failed calls changed nothing


def test_backend_keyword_on_cpu_gives_the_same_result(seed):
    x, w = torch.randn(2, 4, 9), torch.randn(4, 3)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]] * 2)
    torch.testing.assert_close(ops.packed_causal_conv1d(x, w, position_ids=pos, backend="reference"),
                               ops.packed_causal_conv1d(x, w, position_ids=pos), rtol=0, atol=0)


@pytest.mark.skipif(not CPU_ONLY, reason="checks the CPU-only behaviour")
def test_available_backends_on_cpu():
    assert ops.available_backends() == ["reference"]


def test_no_environment_variable_chooses_anything(monkeypatch):
    monkeypatch.setenv("PACKLOADER_OPS_BACKEND", "reference")
    assert get_backend() == "auto"
    assert implementation("selective_scan", "cuda", F32, dstate=16) == "cuda"


# ---------------------------------------------------------------------------------------------------------------
# the CUDA implementations' Python side, on the CPU, against a stand-in extension

class FakeExt:
    """Stands in for the compiled extension: checks what binding.cpp assumes of its arguments (the Python side
    prepared them), then fills the outputs with the reference."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _check_scan(u, delta, A, B, C, D, z, delta_bias, pos):
        assert u.dtype in (F32, F16, BF16) and u.is_contiguous()
        assert delta.dtype == u.dtype and delta.is_contiguous()
        assert z is None or (z.dtype == u.dtype and z.is_contiguous())
        for t in (A, D, delta_bias):
            assert t is None or (t.dtype == F32 and t.is_contiguous())
        assert B.dim() == 4 and C.shape == B.shape and B.is_contiguous() and C.is_contiguous()
        assert B.dtype in (u.dtype, F32) and C.dtype == B.dtype
        groups = B.shape[1]
        assert groups == 1 or (u.shape[1] // groups) % 16 == 0, "a 16-channel block must not straddle groups"
        assert pos.dtype == torch.int32 and pos.is_contiguous() and pos.shape == (u.shape[0], u.shape[2])

    def scan_fwd(self, u, delta, A, B, C, D, z, delta_bias, pos, softplus, out, saved, segments, lanes,
                 state_slots=None, initial_state=None, final_state=None):
        assert state_slots is None and initial_state is None and final_state is None, "the plain scan: no states"
        self._check_scan(u, delta, A, B, C, D, z, delta_bias, pos)
        self.calls.append(("scan_fwd", u.shape[1], B.shape[1]))
        # segments as ops/contract.py plans them for the GPU (132 multiprocessors off CUDA); the layout is the kernel's
        assert segments == scan_fwd_segments(u.shape[0], u.shape[1], u.shape[2], 132) and lanes == 0
        assert out.shape == u.shape and out.dtype == u.dtype and out.is_contiguous()
        assert saved.shape == (u.shape[0], u.shape[1], scan_chunks(u.shape[2]), SCAN_LANES) and saved.dtype == F32
        o, s, _ = scan_mod._scan_fwd_reference(u, delta, A, B, C, D, z, delta_bias, pos, softplus)
        out.copy_(o)
        saved.copy_(s)

    def scan_bwd(self, u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved, dout, out_rec, du, ddelta, dz,
                 dA, dB, dC, dD, ddb, det_part, segments, state_slots=None, initial_state=None,
                 dfinal_state=None, dinitial_state=None):
        assert state_slots is None and initial_state is None and dfinal_state is None and dinitial_state is None
        self._check_scan(u, delta, A, B, C, D, z, delta_bias, pos)
        self.calls.append(("scan_bwd", u.shape[1], B.shape[1]))
        batch, dim = u.shape[:2]
        assert segments == scan_bwd_segments(batch, dim, u.shape[2], 132)
        assert dout.dtype == u.dtype and dout.is_contiguous() and saved.is_contiguous()
        rows = batch * segments
        assert dA.dtype == F32 and dA.shape == (rows,) + tuple(A.shape)
        # dA / dD / ddelta_bias: one row of partials per (batch row, segment), summed by the caller
        assert all(t.shape == (rows, dim) and t.dtype == F32 for t in (dD, ddb) if t is not None)
        assert all(float(t.abs().sum()) == 0 for t in (dA, dD, ddb) if t is not None), "zeroed"
        # deterministic mode hands the kernel one [dB | dC] slot per channel block (to be written in full), which the
        # caller sums over each B/C group's blocks; otherwise zeroed dB / dC to add into
        det = torch.are_deterministic_algorithms_enabled()
        if det:
            blocks = scan_blocks(dim)
            assert det_part.dtype == F32 and det_part.shape == (batch, blocks, 2) + tuple(B.shape[2:])
            assert det_part.is_contiguous() and blocks % B.shape[1] == 0
            self.calls.append(("det", blocks))
        else:
            assert det_part is None
            assert dB.dtype == dC.dtype == F32 and dB.shape == B.shape and dC.shape == C.shape
            assert float(dB.abs().sum()) == 0 and float(dC.abs().sum()) == 0, "zeroed"
        assert out_rec is None or (out_rec.shape == u.shape and out_rec.dtype == u.dtype and out_rec.is_contiguous())
        grads = scan_mod._scan_bwd_reference(u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved, dout,
                                             out_rec is not None)
        for buf, g in zip((du, ddelta, dA, dB, dC, dD, dz, ddb, out_rec), grads):
            if buf is None:
                continue
            if buf is dA or buf is dD or buf is ddb:   # the whole sum in row 0, as if the other rows gave 0
                buf[0].copy_(g)
            elif det and (buf is dB or buf is dC):   # split over the first and the last block of each group
                # (one and the same when a group has one block), as if the others gave 0
                k = 0 if buf is dB else 1
                n_groups = B.shape[1]
                slots = det_part.view(batch, n_groups, det_part.shape[1] // n_groups, *det_part.shape[2:])
                if k == 0:
                    det_part.fill_(0.0)
                slots[:, :, 0, k].copy_(g / 4)
                slots[:, :, -1, k].add_(g * 3 / 4)
            else:
                buf.copy_(g)

    def conv_runmask(self, pos):
        assert pos.dtype == torch.int32 and pos.is_contiguous()
        self.calls.append(("conv_runmask",))
        return conv_mod._runmask_reference(pos)

    @staticmethod
    def _check_runmask(x, pos, runmask):
        if runmask is not None:   # the op's words for these position_ids, handed on as they are
            assert torch.equal(runmask, conv_mod._runmask_reference(pos))

    def conv_fwd(self, x, weight, bias, pos, silu, out, runmask):
        self._check_conv(x, weight, bias, pos)
        self._check_runmask(x, pos, runmask)
        self.calls.append(("conv_fwd", x.stride()))
        assert out.stride() == x.stride() and out.dtype == x.dtype
        out.copy_(conv_mod._conv_fwd_reference(x, weight, bias, pos, silu))

    def conv_bwd(self, x, weight, bias, pos, silu, dout, dx, dw_part, dweight, dbias, runmask):
        self._check_conv(x, weight, bias, pos)
        self._check_runmask(x, pos, runmask)
        self.calls.append(("conv_bwd", x.stride(), dout.stride()))
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        assert dout.stride() == x.stride() and dout.dtype == x.dtype, "dout in x's layout and dtype"
        # [dweight | dbias] partials: one slot per block, at most one block per CONV_SLOT_STEPS steps of a row
        slots = batch * -(-seqlen // CONV_SLOT_STEPS)
        assert dw_part.shape == (slots, dim, width + 1) and dw_part.dtype == F32
        assert dx.stride() == x.stride()
        # the kernel sums the slots it wrote into float32 dweight / dbias (given exactly when there is a bias)
        assert dweight.shape == (dim, width) and dweight.dtype == F32 and dweight.is_contiguous()
        assert (dbias is None) == (bias is None)
        assert dbias is None or (dbias.shape == (dim,) and dbias.dtype == F32)
        gx, gw, gb = conv_mod._conv_bwd_reference(x, weight, bias, pos, silu, dout)
        dx.copy_(gx)
        dweight.copy_(gw)
        if dbias is not None:
            dbias.copy_(gb)
        return 2

    @staticmethod
    def _check_conv(x, weight, bias, pos):
        assert x.dtype in (F32, F16, BF16)
        assert x.is_contiguous() or (x.stride(1) == 1 and x.stride(2) == x.shape[1])
        assert weight.dtype == F32 and weight.is_contiguous() and weight.dim() == 2
        assert bias is None or (bias.dtype == F32 and bias.is_contiguous())
        assert pos.dtype == torch.int32 and pos.is_contiguous()


@pytest.fixture
def fake_ext(monkeypatch):
    ext = FakeExt()
    monkeypatch.setattr(backends, "load_kernels", lambda: ext)
    return ext


def scan_case(dtype, dim=32, groups=0, has=True, bc_fp32=False, L=70):
    b, n = 2, 4
    u = torch.randn(b, dim, L).to(dtype)
    delta = torch.rand(b, dim, L).to(dtype)
    A = -torch.rand(dim, n)
    shape = (b, n, L) if not groups else (b, groups, n, L)
    B = torch.randn(shape).to(F32 if bc_fp32 else dtype)
    C = torch.randn(shape).to(F32 if bc_fp32 else dtype)
    D = torch.randn(dim) if has else None
    z = torch.randn(b, dim, L).to(dtype) if has else None
    db = torch.randn(dim) if has else None
    pos = torch.tensor([[0, 1, 2] + list(range(L - 3)), list(range(L))], dtype=torch.int32)
    return u, delta, A, B, C, D, z, db, pos, has


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["plain", "groups_by_block", "groups_one_by_one", "fp32_bc", "no_optionals"])
def test_scan_cuda_glue_against_a_stand_in_extension(seed, fake_ext, dtype, layout):
    kw = {"plain": {}, "groups_by_block": {"groups": 2}, "groups_one_by_one": {"dim": 40, "groups": 2},
          "fp32_bc": {"bc_fp32": True}, "no_optionals": {"has": False}}[layout]
    args = scan_case(dtype, **kw)
    # the stand-in computes per kernel call (a group at a time, or bf16 B/C cast to float32 in the group-by-group
    # backward): the last bits may differ from the reference computed in one go
    tol = 1e-5 if dtype == F32 else 2e-2
    out, saved, _ = scan_mod._scan_fwd_cuda(*args)
    want, want_saved, _ = scan_mod._scan_fwd_reference(*args)
    assert out.dtype == dtype and out.shape == args[0].shape and saved.shape == want_saved.shape
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(saved, want_saved, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape).to(dtype)
    got = scan_mod._scan_bwd_cuda(*args, saved, dout)
    ref = scan_mod._scan_bwd_reference(*args, saved, dout)
    for name, g, r in zip(["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"], got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    n_calls = 2 if layout == "groups_one_by_one" else 1
    assert [c[0] for c in fake_ext.calls] == ["scan_fwd"] * n_calls + ["scan_bwd"] * n_calls
    if layout == "groups_one_by_one":  # 20 channels per group: the kernel runs group by group
        assert all(c[1:] == (20, 1) for c in fake_ext.calls)


@pytest.mark.parametrize("dim,groups", [(16, 1), (48, 1), (64, 2)])   # one block; three; two groups of two
def test_scan_cuda_glue_in_deterministic_mode(seed, fake_ext, dim, groups):
    """Deterministic mode: the kernel gets one [dB | dC] slot per channel block; dB / dC are the sums over each B/C
    group's blocks."""
    args = scan_case(F32, dim=dim, groups=groups)
    out, saved, _ = scan_mod._scan_fwd_cuda(*args)
    dout = torch.randn(out.shape)
    torch.use_deterministic_algorithms(True)
    try:
        got = scan_mod._scan_bwd_cuda(*args, saved, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    ref = scan_mod._scan_bwd_reference(*args, saved, dout)
    for name, g, r in zip(["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"], got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert ("det", dim // SCAN_BLOCK_CHANNELS) in fake_ext.calls
    # dB and dC are separate tensors (a custom op's outputs must not share storage)
    assert got[3].untyped_storage().data_ptr() != got[4].untyped_storage().data_ptr()


@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_cuda_glue_against_a_stand_in_extension(seed, fake_ext, channel_last, bias):
    b, d, L = 2, 8, 13
    x = torch.randn(b, L, d).transpose(1, 2) if channel_last else torch.randn(b, d, L)
    w = torch.randn(d, 3, dtype=F64)  # not float32: the glue casts the weight for the kernel, returns its dtype
    bb = torch.randn(d) if bias else None
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 0, 1]] * b, dtype=torch.int32)
    out = conv_mod._conv_fwd_cuda(x, w, bb, pos, True)
    assert out.stride() == x.stride()
    torch.testing.assert_close(out, conv_mod._conv_fwd_reference(x, w.float(), bb, pos, True), rtol=0, atol=0)
    dout = torch.randn(b, d, L)  # channel-first whatever x is: the glue hands the kernel dout in x's layout
    dx, dw, db = conv_mod._conv_bwd_cuda(x, w, bb, pos, True, dout)
    rx, rw, rb = conv_mod._conv_bwd_reference(x, w.float(), bb, pos, True, dout)
    assert dx.stride() == x.stride() and dw.dtype == F64 and dw.shape == w.shape
    torch.testing.assert_close(dx, rx, rtol=0, atol=0)
    torch.testing.assert_close(dw, rw.double(), rtol=1e-5, atol=1e-5)  # sums over strided memory: order differs
    assert db.shape == ((d,) if bias else (0,))
    if bias:
        torch.testing.assert_close(db, rb, rtol=1e-5, atol=1e-5)
    assert [c[0] for c in fake_ext.calls] == ["conv_fwd", "conv_bwd"]
    # with float32 parameters (no cast) the outputs are still separate tensors: a custom op may not return aliases
    outs = conv_mod._conv_bwd_cuda(x, w.float(), bb, pos, True, dout)
    ptrs = [t.untyped_storage().data_ptr() for t in outs if t.numel()]
    assert len(set(ptrs)) == len(ptrs), "conv backward outputs share storage"


def test_cuda_glue_refuses_before_touching_the_kernel(fake_ext):
    args = scan_case(F32)
    wide = (args[0], args[1], -torch.rand(32, MAX_DSTATE + 1), torch.randn(2, MAX_DSTATE + 1, 70),
            torch.randn(2, MAX_DSTATE + 1, 70)) + args[5:]
    with pytest.raises(KernelUnsupportedError, match=rf"dstate <= {MAX_DSTATE}, got dstate={MAX_DSTATE + 1}"):
        scan_mod._scan_fwd_cuda(*wide)
    x64 = torch.randn(1, 4, 6, dtype=F64)
    pos = torch.zeros(1, 6, dtype=torch.int32)
    with pytest.raises(KernelUnsupportedError, match="got torch.float64"):
        conv_mod._conv_fwd_cuda(x64, torch.randn(4, 3), None, pos, False)
    with pytest.raises(KernelUnsupportedError, match="got width=5"):
        conv_mod._conv_fwd_cuda(x64.float(), torch.randn(4, 5), None, pos, False)
    assert fake_ext.calls == []
    with use_backend("reference"):  # the override: the reference runs, the kernel is not touched
        out, _, _ = scan_mod._scan_fwd_cuda(*wide)
        conv_mod._conv_fwd_cuda(x64, torch.randn(4, 5, dtype=F64), None, pos, False)
    assert fake_ext.calls == [] and out.shape == args[0].shape


def test_kernels_that_cannot_be_built_say_why_and_how_to_get_the_reference(monkeypatch):
    from ops import _cuda

    def fail():
        raise RuntimeError("packloader ops: cannot build the CUDA kernels: nvcc not found")

    monkeypatch.setattr(_cuda, "load", fail)
    with pytest.raises(KernelUnsupportedError, match=r'nvcc not found; .*with ops\.use_backend\("reference"\)'):
        conv_mod._conv_fwd_cuda(torch.randn(1, 4, 6), torch.randn(4, 3), None, torch.zeros(1, 6, dtype=torch.int32),
                                False)


# ---------------------------------------------------------------------------------------------------------------
# the package

def test_exports():
    for name in ops.__all__:
        assert getattr(ops, name) is not None
    assert set(ops.__all__) <= set(dir(ops))
    with pytest.raises(AttributeError, match="module 'ops' has no attribute 'selective_scan_fn'"):
        ops.selective_scan_fn  # noqa: B018
    for name in ("selective_scan_fwd", "selective_scan_bwd", "conv_runmask", "causal_conv1d_fwd", "causal_conv1d_bwd"):
        assert hasattr(torch.ops.packloader, name), name


IMPORT_CHECK = textwrap.dedent(
    """
    import sys
    for name in ("mamba_ssm", "causal_conv1d", "causal_conv1d_cuda", "selective_scan_cuda", "triton"):
        sys.modules[name] = None  # any import of these raises ImportError
    import torch
    assert not torch.cuda.is_available()
    import ops
    for name in ops.__all__:
        getattr(ops, name)
    torch.manual_seed(0)
    layer = ops.PackedMamba(8, d_state=4)
    h = torch.randn(2, 10, 8, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])
    out = layer(h, position_ids=pos)
    out.sum().backward()
    assert h.grad.shape == h.shape and layer.A_log.grad is not None
    x = torch.randn(2, 8, 10)
    ops.packed_causal_conv1d(x, torch.randn(8, 4), activation="silu", position_ids=pos)
    ops.packed_selective_scan(x, torch.rand(2, 8, 10), -torch.rand(8, 3), torch.randn(2, 3, 10),
                              torch.randn(2, 3, 10), seq_idx=ops.position_ids_to_seq_idx(pos))
    report = ops.check_isolation(lambda b: layer(b["h"], position_ids=b["position_ids"]),
                                 {"h": h.detach(), "position_ids": pos})
    assert report.ok, report
    for name in ("mamba_ssm", "causal_conv1d", "triton"):
        assert sys.modules[name] is None, name
    assert "ops._cuda" not in sys.modules, "the CUDA module is not even imported without a CUDA tensor"
    print("IMPORT-OK")
    """
)


def test_import_ops_without_optional_packages_or_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "IMPORT-OK" in proc.stdout, proc.stdout + proc.stderr


def test_blocked_module_really_fails_to_import():
    """Sanity check of the subprocess trick above."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['mamba_ssm'] = None; import mamba_ssm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "import of mamba_ssm halted" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# on the GPU (marked gpu): the rule with real CUDA tensors, and the `saved` hand-over between implementations

@pytest.mark.gpu
def test_gpu_dispatch_and_saved_hand_over(seed, monkeypatch):
    if "cuda" not in ops.available_backends():
        pytest.skip("the CUDA kernels cannot be built here")
    dev = "cuda"
    loads = []
    real_load = backends.load_kernels
    monkeypatch.setattr(backends, "load_kernels", lambda: loads.append(1) or real_load())
    u, delta, A, B, C, D, z, db, pos, softplus = (t.to(dev) if isinstance(t, torch.Tensor) else t
                                                  for t in scan_case(F32, dim=32, L=200))
    leaves = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, B, C, D, z, db)]
    dout = torch.randn(u.shape, device=dev)

    def run(reference_fwd, reference_bwd):
        ins = [t.detach().clone().requires_grad_(True) for t in leaves]
        with use_backend("reference" if reference_fwd else "auto"):
            out = ops.packed_selective_scan(*ins, delta_softplus=softplus, position_ids=pos)
        with use_backend("reference" if reference_bwd else "auto"):
            out.backward(dout)
        return [out.detach()] + [t.grad for t in ins]

    loads.clear()
    kernel = run(False, False)
    assert loads, "CUDA float32 tensors ran the kernel"
    loads.clear()
    reference = run(True, True)
    assert not loads, "the override kept the kernel out"
    mixed = [run(True, False), run(False, True)]  # the forward's `saved` taken over by the other implementation
    for got in [kernel] + mixed:
        for i, (a, b) in enumerate(zip(got, reference)):
            assert ((a - b).norm() / b.norm()).item() <= 1e-4, i
    with pytest.raises(KernelUnsupportedError, match=r"got torch\.float64.*use_backend"):
        ops.packed_selective_scan(u.double(), delta.double(), A.double(), B.double(), C.double(), position_ids=pos)
    wide = (-torch.rand(32, MAX_DSTATE + 4, device=dev), torch.randn(2, MAX_DSTATE + 4, 200, device=dev))
    with pytest.raises(KernelUnsupportedError, match=rf"dstate <= {MAX_DSTATE}"):
        ops.packed_selective_scan(u, delta, wide[0], wide[1], wide[1], position_ids=pos)
    with use_backend("reference"):
        ops.packed_selective_scan(u.double(), delta.double(), A.double(), B.double(), C.double(), position_ids=pos)
    x = torch.randn(2, 32, 200, device=dev)
    with pytest.raises(KernelUnsupportedError, match="got width=5"):
        ops.packed_causal_conv1d(x, torch.randn(32, 5, device=dev), position_ids=pos)
