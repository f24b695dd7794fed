"""ops.time_split: rows of one sequence cut along time into pieces that continue from their true states.

CPU: the plan (the states each piece starts from, the gradients entering each piece's end) run through the reference
scan ops equals the uncut scan, forward and backward, in float64; the Triton prefixes in Triton's interpreter against
their references (the CUDA reductions: test_kernel_emulation.py). GPU: the CUDA ops with the cut against the same ops uncut, outputs and every gradient.
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ops
from ops import time_split
from ops.contract import SCAN_CHUNK
from ops.selective_scan_interface import _scan_bwd_reference, _scan_fwd_reference


def _inputs(batch, dim, dstate, L, dtype=torch.float64, seed=0, has_z=True, has_D=True, has_bias=True,
            device="cpu", softplus=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = r(batch, dim, L)
    # delta goes through softplus, or is already a step size (positive)
    delta = r(batch, dim, L) * 0.5 - 1.0 if softplus else torch.rand(batch, dim, L, generator=g, dtype=torch.float64)
    A = -torch.rand(dim, dstate, generator=g, dtype=torch.float64) * 4 - 0.05
    B = r(batch, 1, dstate, L)
    C = r(batch, 1, dstate, L)
    D = r(dim) if has_D else None
    z = r(batch, dim, L) if has_z else None
    bias = r(dim) * 0.3 if has_bias else None
    to = lambda t, dt=dtype: None if t is None else t.to(device=device, dtype=dt)  # noqa: E731
    f32 = torch.float64 if dtype == torch.float64 else torch.float32
    return to(u), to(delta), to(A, f32), to(B), to(C), to(D, f32), to(z), to(bias, f32)


CASES = [
    # batch, dim, dstate, L, piece (pieces = ceil(L / piece)), z / D / bias, softplus
    (1, 5, 16, 4 * 64, 64, True, True),
    (2, 3, 4, 3 * 64 + 17, 64, True, False),    # a shorter last piece; dstate below 16
    (1, 4, 16, 2 * 128 + 1, 128, False, True),  # a last piece of one timestep
    (2, 2, 8, 5 * 64, 64, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}d{c[1]}n{c[2]}L{c[3]}p{c[4]}")
def test_cut_forward_and_backward_equal_the_uncut_scan(case):
    """The states the plan gives each piece, run through the reference ops with the pieces as continued sequences,
    reproduce the uncut scan: output and saved chunk states, then every gradient (float64, fresh inputs)."""
    batch, dim, dstate, L, piece, extras, softplus = case
    pieces = -(-L // piece)
    u, delta, A, B, C, D, z, bias = _inputs(batch, dim, dstate, L, has_z=extras, has_D=extras, has_bias=extras,
                                            seed=L, softplus=softplus)
    pos = torch.arange(L, dtype=torch.int32).expand(batch, L).contiguous()
    out, saved, _ = _scan_fwd_reference(u, delta, A, B, C, D, z, bias, pos, softplus)
    pos_c, slots, init = time_split.forward_states(u, delta, A, B, bias, softplus, pieces, piece)
    assert init.shape == (batch * pieces, dim, dstate)
    out_c, saved_c, _ = _scan_fwd_reference(u, delta, A, B, C, D, z, bias, pos_c, softplus, slots, init, 0)
    torch.testing.assert_close(out_c, out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(saved_c, saved, rtol=1e-10, atol=1e-10)

    dout = torch.randn(batch, dim, L, dtype=torch.float64, generator=torch.Generator().manual_seed(L + 1))
    ref = _scan_bwd_reference(u, delta, A, B, C, D, z, bias, pos, softplus, saved, dout, True)
    pos_c, slots, init, dfinal = time_split.backward_states(saved, dout, z, delta, A, C, bias, softplus, pieces,
                                                            piece)
    got = _scan_bwd_reference(u, delta, A, B, C, D, z, bias, pos_c, softplus, saved, dout, True, slots, init,
                              dfinal)
    # the state before each piece comes from the forward's saved chunk states, float32 by the contract (also in the
    # reference): what depends on the states (ddelta, dA, dC, the output) carries their rounding; the adjoint (du,
    # dB, dz's adjoint part) does not
    names = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "out")
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape, name
        if not b.numel():   # an input that was not given
            continue
        tol = 1e-9 if name in ("du", "dB", "dD") else 2e-6
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(), msg=lambda m: f"{name}: {m}")


def test_cut_changes_nothing_where_a_piece_starts_from_zero_only():
    """A check that the comparison above can fail: pieces run from zero (no initial states) differ from the uncut
    scan."""
    batch, dim, dstate, L, piece = 1, 3, 4, 4 * 64, 64
    u, delta, A, B, C, D, z, bias = _inputs(batch, dim, dstate, L)
    pos = torch.arange(L, dtype=torch.int32)[None]
    out, _, _ = _scan_fwd_reference(u, delta, A, B, C, D, z, bias, pos, True)
    pos_c, _, _ = time_split.forward_states(u, delta, A, B, bias, True, 4, piece)
    out_c, _, _ = _scan_fwd_reference(u, delta, A, B, C, D, z, bias, pos_c, True)
    assert (out_c - out).abs().max() > 1e-3


def test_piece_layout():
    pos, slots, start, length = time_split.piece_layout(2, 200, 4, 64, "cpu")
    assert start.tolist() == [0, 64, 128, 192, 200, 264, 328, 392] and length.tolist() == [64, 64, 64, 8] * 2
    assert pos.dtype == slots.dtype == torch.int32 and pos.shape == (2, 200) and slots.shape == (2, 2, 200)
    assert (pos == 0).nonzero()[:, 1].tolist() == [0, 64, 128, 192] * 2
    for b in range(2):
        starts = {t: int(s) for t, s in enumerate(slots[0, b]) if s >= 0}
        ends = {t: int(s) for t, s in enumerate(slots[1, b]) if s >= 0}
        assert starts == {64: 4 * b + 1, 128: 4 * b + 2, 192: 4 * b + 3}
        assert ends == {63: 4 * b, 127: 4 * b + 1, 191: 4 * b + 2}
    assert time_split.piece_layout(2, 200, 4, 64, "cpu")[0] is pos   # made once a shape


@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_split_plan(which):
    for batch, dim, L in [(1, 2048, 4096), (1, 2048, 16384), (1, 1536, 8192), (2, 768, 2048), (1, 1024, 65536)]:
        plan = time_split.split_plan(which, batch, dim, L, 132)
        assert plan is not None, (batch, dim, L)
        pieces, piece = plan
        assert piece % SCAN_CHUNK == 0 and (pieces - 1) * piece < L <= pieces * piece and pieces >= 2
        assert piece >= 256
    # grids where the cut does not pay, rows too short to cut
    assert time_split.split_plan(which, 8, 4096, 4096, 132) is None
    assert time_split.split_plan(which, 2, 2048, 4096, 132) is None
    assert time_split.split_plan(which, 1, 4096, 16384, 132) is None
    assert time_split.split_plan(which, 1, 2048, 300, 132) is None


def test_fwd_lanes_matches_the_layout_rule():
    assert time_split.fwd_lanes(16, 2048, 132) == 1
    assert time_split.fwd_lanes(1, 2048, 132) == 8
    assert time_split.fwd_lanes(2, 4096, 132) == 4


_INTERPRETED = r"""
import numpy as np
import torch
from ops import time_split as ts
np.seterr(over="raise", invalid="raise")   # an inf or a NaN in the interpreted kernels fails
torch.manual_seed(0)
worst = 0.0
for forward in (True, False):
    for (batch, dim, dstate, L, piece) in [(1, 20, 16, 3 * 64 + 5, 64), (2, 16, 5, 2 * 64, 64)]:
        pieces = -(-L // piece)
        s, d = torch.randn(batch, pieces, dim, dstate), torch.rand(batch, pieces, dim)
        A = -torch.rand(dim, dstate) * 4 - 0.05
        p = ts._chain_prefix_triton(s.flatten(0, 1), d.flatten(0, 1), A, None, pieces, None, False,
                                    not forward).view(s.shape)
        p_r = ts.piece_prefix_ref(forward, s.double(), d.double(), A.double())
        worst = max(worst, ((p.double() - p_r).abs().max() / p_r.abs().max()).item())
# chains of any lengths (the carry's), from given states, inclusive, both directions
S, dim, dstate = 7, 20, 16
sums, dts = torch.randn(S, dim, dstate), torch.rand(S, dim)
A = -torch.rand(dim, dstate) * 4 - 0.05
offsets, h0 = torch.tensor([0, 3, 4, 7]), torch.randn(3, dim, dstate)
for reverse in (False, True):
    for start in (None, h0):
        p = ts._chain_prefix_triton(sums, dts, A, offsets, None, start, True, reverse)
        p_r = ts.chain_prefix_ref(sums.double(), dts.double(), A.double(), offsets,
                                  None if start is None else start.double(), True, reverse)
        worst = max(worst, ((p.double() - p_r).abs().max() / p_r.abs().max()).item())
assert worst == worst, "NaN"
print("worst", worst)
"""


def test_triton_prefixes_in_the_interpreter():
    """The Triton prefixes over the pieces of a cut (both directions, a partial last piece, dstate below 16) and over
    chains of any length (from given states) against their float64 references, on the CPU through Triton's
    interpreter. (The reductions are a CUDA kernel: test_kernel_emulation.py, test_emulated_segment_sums_...)"""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("worst")[-1])
    assert worst < 1e-5, worst


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA ops with the cut against the same ops without it

def _cuda_ok():
    return torch.cuda.is_available() and "cuda" in ops.backends.available_backends() and time_split.HAS_TRITON


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048, 4096), (1, 1024, 8192 + 64 * 3 + 5), (2, 768, 4096 + 64)])
def test_cuda_cut_matches_uncut(monkeypatch, dtype, shape):
    """The scan ops on rows of one sequence, with the cut (the grids below fill a fraction of an H100) and without
    it (the plan switched off): outputs and every gradient within fp32 rounding (bf16: within the uncut run's own
    distance to float64)."""
    if not _cuda_ok():
        pytest.skip("needs CUDA, the compiled kernels and Triton")
    from ops.kernel_calls import selective_scan_bwd, selective_scan_fwd
    from ops.selective_scan_interface import _sm_count

    batch, dim, L = shape
    dev = torch.device("cuda")
    assert time_split.split_plan("fwd", batch, dim, L, _sm_count(dev)) is not None
    assert time_split.split_plan("bwd", batch, dim, L, _sm_count(dev)) is not None
    u, delta, A, B, C, D, z, bias = _inputs(batch, dim, 16, L, dtype=dtype, device=dev, seed=L)
    pos = ops.boundaries.shared_row_positions(batch, L, dev)
    dout = torch.randn(batch, dim, L, device=dev, dtype=dtype)

    def run():
        out, saved, _ = selective_scan_fwd(u, delta, A, B, C, D, z, bias, pos, True)
        return (out,) + tuple(selective_scan_bwd(u, delta, A, B, C, D, z, bias, pos, True, saved, dout, True)[:9])

    cut = run()
    monkeypatch.setattr(time_split, "split_plan", lambda *a: None)
    whole = run()
    names = ("out", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "out recomputed")
    if dtype == torch.float32:
        for name, a, b in zip(names, cut, whole):
            scale = b.float().abs().max().clamp(min=1e-6)
            err = ((a.float() - b.float()).abs().max() / scale).item()
            assert err < 1e-5, (name, err)
    else:
        # against float64 (the reference, on the GPU): the cut no further than the uncut run
        f64 = [None if t is None else t.double() for t in (u, delta, A, B, C, D, z, bias)]
        ref_out, ref_saved, _ = _scan_fwd_reference(*f64, pos, True)
        ref = (ref_out,) + tuple(_scan_bwd_reference(*f64, pos, True, ref_saved, dout.double(), True)[:9])
        for name, a, b, r in zip(names, cut, whole, ref):
            e_cut = ((a.double() - r).abs().max() / r.abs().max()).item()
            e_whole = ((b.double() - r).abs().max() / r.abs().max()).item()
            assert e_cut <= 1.5 * e_whole + 1e-5, (name, e_cut, e_whole)


@pytest.mark.parametrize("ids", ["none", "checked"])
def test_the_mixer_hands_its_scan_rows_known_to_be_one_sequence(monkeypatch, ids):
    """The cut applies only where the scan ops know each row is one sequence: the fused mixer's forward and backward
    (from its saved ids) both see that, without position_ids and with ids the entry check found so."""
    from ops import kernel_calls, mamba_inner
    from ops.boundaries import single_sequence_rows

    seen = []

    def spy(name):
        real = getattr(kernel_calls, name)

        def call(*args):
            seen.append((name, single_sequence_rows(args[8])))
            return real(*args)
        return call

    monkeypatch.setattr(mamba_inner.kernel_calls, "selective_scan_fwd", spy("selective_scan_fwd"))
    monkeypatch.setattr(mamba_inner.kernel_calls, "selective_scan_bwd", spy("selective_scan_bwd"))
    torch.manual_seed(0)
    mixer = ops.PackedMamba(d_model=16, d_state=4, d_conv=4, expand=2)
    x = torch.randn(2, 40, 16, requires_grad=True)
    pos = None if ids == "none" else torch.arange(40).expand(2, 40).contiguous()
    mixer(x, position_ids=pos).sum().backward()
    assert seen == [("selective_scan_fwd", True), ("selective_scan_bwd", True)]
    seen.clear()
    packed = torch.tensor([list(range(20)) + list(range(20))] * 2)
    mixer(x, position_ids=packed).sum().backward()
    assert seen == [("selective_scan_fwd", False), ("selective_scan_bwd", False)]
