"""The float64 reference plugin of the upstream scan suite (tests/ops/upstream_ref64.py), on the CPU, with our own
reference standing in for mamba-ssm's (the same signature)."""
import torch
import torch.nn.functional as F

from ops import selective_scan_ref
from tests.ops.upstream_ref64 import float64_reference


def _inputs(dtype, L=300, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    b, d, n = 2, 4, 8
    t = dict(
        u=torch.randn(b, d, L, generator=g).to(dtype), delta=(0.5 * torch.rand(b, d, L, generator=g)).to(dtype),
        A=-0.5 * torch.rand(d, n, generator=g), B=torch.randn(b, n, L, generator=g).to(dtype),
        C=torch.randn(b, n, L, generator=g).to(dtype), D=torch.randn(d, generator=g),
        z=torch.randn(b, d, L, generator=g).to(dtype), delta_bias=0.5 * torch.rand(d, generator=g))
    return {k: v.requires_grad_() for k, v in t.items()}, torch.randn(b, d, L, generator=g).to(dtype)


def test_float64_reference_dtypes_and_gradients():
    ref64 = float64_reference(selective_scan_ref)
    for dtype in (torch.float32, torch.bfloat16):
        x, g = _inputs(dtype)
        out, last = ref64(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], z=x["z"], delta_bias=x["delta_bias"],
                          delta_softplus=True, return_last_state=True)
        assert out.dtype == dtype and last.dtype == torch.float32 and last.shape == (2, 4, 8)
        out.backward(g)
        for k, v in x.items():
            assert v.grad is not None and v.grad.dtype == v.dtype, k
        # the same computation done by hand in float64 gives the same gradients (up to the final cast)
        x64 = {k: v.detach().double().requires_grad_() for k, v in x.items()}
        y = selective_scan_ref(x64["u"], x64["delta"], x64["A"], x64["B"], x64["C"], x64["D"], z=x64["z"],
                               delta_bias=x64["delta_bias"], delta_softplus=True)
        y.backward(g.double())
        for k in x:
            torch.testing.assert_close(x[k].grad, x64[k].grad.to(x[k].dtype), rtol=0, atol=0, msg=k)
        plain = ref64(x["u"], x["delta"], x["A"], x["B"], x["C"], z=x["z"])
        assert plain.dtype == dtype and plain.shape == x["u"].shape


def test_gate_rounding_is_what_the_float32_reference_loses():
    """Why the plugin exists: gating with silu(z) rounded to bf16 (as mamba-ssm's float32 reference does) moves dA
    further from float64 than a float32 computation with a float32 gate."""
    x, g = _inputs(torch.bfloat16, L=1024, seed=0)

    def grad_A(ct, gate_in_input_dtype):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
        up = {k: v.to(ct) for k, v in leaves.items()}
        y = selective_scan_ref(up["u"], up["delta"], up["A"], up["B"], up["C"], up["D"], delta_bias=up["delta_bias"],
                               delta_softplus=True, method="sequential")
        gate = F.silu(leaves["z"]) if gate_in_input_dtype else F.silu(up["z"])
        (y * gate).backward(g.to(ct))
        return leaves["A"].grad.double()

    truth = grad_A(torch.float64, False)
    err_f32 = (grad_A(torch.float32, False) - truth).abs().max()
    err_rounded_gate = (grad_A(torch.float32, True) - truth).abs().max()
    assert err_rounded_gate > 10 * err_f32
