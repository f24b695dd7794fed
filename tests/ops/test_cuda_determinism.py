"""GPU: the packed kernels' backward gives the same bits on every run, and an inf / NaN never crosses a boundary.

- The conv's dweight / dbias and the scan's dA / dD / ddelta_bias are per-block / per-row partials summed in a fixed
  order: bit-identical in every mode. The scan's dB / dC are summed over channel blocks with atomics by default and in
  a fixed order (each block stores its own sums, the caller adds them) under ``torch.use_deterministic_algorithms(True)``: bit-identical there.
- The scan resets with a select: an inf state at the end of one sequence, or a NaN gradient in a later one, stays on
  its side of the boundary (the former multiply-by-zero made it NaN across).
"""
import pytest
import torch

import ops

from ops.contract import SCAN_BLOCK_CHANNELS

from .test_cuda_kernels import GRAD_NAMES, check_scan, cuda_ops, lengths_mix, position_ids_for  # noqa: F401

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (gpu marker); none on this machine", allow_module_level=True)


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _scan_inputs(batch, dim, dstate, L, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    u, delta, z = (r(batch, dim, L).to(dtype).requires_grad_() for _ in range(3))
    A = (-torch.rand(dim, dstate, device="cuda", generator=g) - 0.5).requires_grad_()
    B, C = (r(batch, dstate, L).to(dtype).requires_grad_() for _ in range(2))
    D = r(dim).requires_grad_()
    delta_bias = (r(dim) * 0.1).requires_grad_()
    rows = [lengths_mix(L, k) for k in ("mixed", "tiny", "padded", "one")[:batch]]
    pos = position_ids_for(rows, "cuda").int()
    return (u, delta, A, B, C, D, z, delta_bias), pos, rows


def _scan_grads(inputs, pos, dout):
    for t in inputs:
        t.grad = None
    y = ops.packed_selective_scan(*inputs[:6], z=inputs[6], delta_bias=inputs[7], delta_softplus=True,
                                  position_ids=pos)
    y.backward(dout)
    return [y.detach().clone()] + [t.grad.clone() for t in inputs]


NAMES = ["out", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"]


def _first_run_then_bits_repeat(dtype, skip):
    """Run the scan 5 times on one fresh random packed batch; every result but those in ``skip`` has the same bits
    each time. Returns (inputs, position_ids, dout, first results)."""
    inputs, pos, _ = _scan_inputs(4, 1024, 16, 2048, dtype, seed=torch.seed() % 2**31)
    dout = torch.randn_like(inputs[0])
    first = _scan_grads(inputs, pos, dout)
    for _ in range(4):
        again = _scan_grads(inputs, pos, dout)
        for name, a, b in zip(NAMES, first, again):
            if name not in skip:
                assert torch.equal(a, b), f"{name} differs between two runs"
    return inputs, pos, dout, first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scan_backward_bits_repeat(dtype):
    # 64 channel blocks a row add into the same dB / dC elements: atomics make their last bits vary by default;
    # everything else is fixed-order in every mode
    _first_run_then_bits_repeat(dtype, skip=("dB", "dC"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scan_deterministic_mode_bits_repeat(deterministic, dtype):
    inputs, pos, dout, first = _first_run_then_bits_repeat(dtype, skip=())
    # and the ordered sums are the same numbers as the atomic ones, up to fp32 summation order
    torch.use_deterministic_algorithms(False)
    free = _scan_grads(inputs, pos, dout)
    for name, a, b in zip(NAMES, first, free):
        tol = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-4   # one rounding of the result's dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scan_deterministic_mode_ragged_shapes(deterministic, cuda_ops, dtype):
    """Deterministic mode on ragged shapes: 33 channel blocks in three B/C groups of 11 blocks (each group's block
    slots summed on their own), odd L (16-bit rows then stage without cp.async), dstate 12. Within tolerance of
    float64, and the same bits on 5 runs."""
    dim = SCAN_BLOCK_CHANNELS * 33
    inputs, pos, _, softplus, _, _, dout, _ = check_scan(cuda_ops, 2, dim, 12, 333, dtype, ("mixed", "tiny"),
                                                         groups=3)
    u, delta, A, Bm, Cm, D, z, db = inputs
    first = None
    for _ in range(5):
        out, saved, _ = cuda_ops.selective_scan_fwd(u, delta, A, Bm, Cm, D, z, db, pos.int(), softplus)
        grads = cuda_ops.selective_scan_bwd(u, delta, A, Bm, Cm, D, z, db, dout, saved, out, pos.int(), softplus)
        if first is None:
            first = grads
            continue
        for name, a, b in zip(GRAD_NAMES, first, grads):
            assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("seqlen", [2048, 333])
def test_conv_backward_bits_repeat(channel_last, seqlen):
    dim, width = 512, 4
    x = (torch.randn(3, seqlen, dim, device="cuda").transpose(1, 2) if channel_last
         else torch.randn(3, dim, seqlen, device="cuda")).to(torch.bfloat16).requires_grad_()
    w = torch.randn(dim, width, device="cuda", requires_grad=True)
    bias = torch.randn(dim, device="cuda", requires_grad=True)
    pos = position_ids_for([lengths_mix(seqlen, k) for k in ("mixed", "tiny", "one")], "cuda").int()
    dout = torch.randn(3, dim, seqlen, device="cuda").to(torch.bfloat16)
    res = []
    for _ in range(5):
        x.grad = w.grad = bias.grad = None
        y = ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos)
        y.backward(dout)
        res.append((x.grad.clone(), w.grad.clone(), bias.grad.clone()))
    for again in res[1:]:
        for name, a, b in zip(("dx", "dweight", "dbias"), res[0], again):
            assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scan_inf_and_nan_stay_in_their_sequence(dtype):
    # row 0: [100 | 1 | 2 | rest]; u = inf at the last step of the first sequence makes its state inf; a NaN upstream
    # gradient in the last sequence must not reach the earlier ones either
    batch, dim, dstate, L = 2, 64, 16, 512
    inputs, _, _ = _scan_inputs(batch, dim, dstate, L, dtype, seed=torch.seed() % 2**31)
    rows = [[100, 1, 2, L - 103], [L]]
    pos = position_ids_for(rows, "cuda").int()
    with torch.no_grad():
        inputs[0][0, :, 99] = float("inf")
    dout = torch.randn_like(inputs[0])
    dout[0, :, 103 + 5] = float("nan")
    got = _scan_grads(inputs, pos, dout)
    out, du, ddelta, _, dB, dC = got[:6]
    dz = got[7]
    for s, e in ((100, 101), (101, 103)):
        for name, t in (("out", out), ("du", du), ("ddelta", ddelta), ("dz", dz)):
            assert torch.isfinite(t[0, :, s:e]).all(), f"{name} of sequence [{s}, {e}) is not finite"
        for name, t in (("dB", dB), ("dC", dC)):
            assert torch.isfinite(t[0, :, s:e]).all(), f"{name} of sequence [{s}, {e}) is not finite"
        # and equal to the sequence run alone
        sl = [t[0:1, ..., s:e].detach().contiguous() if t.dim() == 3 else t.detach() for t in inputs]
        one = ops.packed_selective_scan(sl[0], sl[1], inputs[2].detach(), sl[3], sl[4], inputs[5].detach(),
                                        z=sl[6], delta_bias=inputs[7].detach(), delta_softplus=True)
        torch.testing.assert_close(out[0:1, :, s:e].float(), one.float(), rtol=2e-2, atol=2e-2)
    # the first sequence's own gradients never see the NaN placed in the last one
    assert torch.isfinite(du[0, :, :99]).all() and torch.isfinite(dB[0, :, :99]).all()
    # the other row is untouched by either
    assert torch.isfinite(out[1]).all() and torch.isfinite(du[1]).all() and torch.isfinite(dB[1]).all()
