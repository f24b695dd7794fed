"""The float32-gate plugin of the upstream scan suite (tests/ops/upstream_gate32.py), on the CPU, with our own
reference standing in for mamba-ssm's (the same signature)."""
import torch
import torch.nn.functional as F

from ops import selective_scan_ref
from tests.ops.upstream_gate32 import float32_gate_reference


def _inputs(dtype, L=300, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    b, d, n = 2, 4, 8
    t = dict(
        u=torch.randn(b, d, L, generator=g).to(dtype), delta=(0.5 * torch.rand(b, d, L, generator=g)).to(dtype),
        A=-0.5 * torch.rand(d, n, generator=g), B=torch.randn(b, n, L, generator=g).to(dtype),
        C=torch.randn(b, n, L, generator=g).to(dtype), D=torch.randn(d, generator=g),
        z=torch.randn(b, d, L, generator=g).to(dtype), delta_bias=0.5 * torch.rand(d, generator=g))
    return {k: v.requires_grad_() for k, v in t.items()}, torch.randn(b, d, L, generator=g).to(dtype)


def test_the_reference_gets_z_in_float32_and_nothing_else_changes():
    seen = {}

    def fake_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
        seen.update(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias, softplus=delta_softplus,
                    last=return_last_state)
        return selective_scan_ref(u, delta, A, B, C, D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                                  return_last_state=return_last_state)

    x, g = _inputs(torch.bfloat16)
    out, last = float32_gate_reference(fake_ref)(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], z=x["z"],
                                                 delta_bias=x["delta_bias"], delta_softplus=True,
                                                 return_last_state=True)
    assert seen["z"].dtype == torch.float32 and torch.equal(seen["z"], x["z"].float())
    for k in ("u", "delta", "A", "B", "C", "D", "delta_bias"):
        assert seen[k] is x[k], k
    assert seen["softplus"] is True and seen["last"] is True
    assert out.dtype == torch.bfloat16 and last.shape == (2, 4, 8)
    out.backward(g)
    assert x["z"].grad is not None and x["z"].grad.dtype == torch.bfloat16
    no_z = float32_gate_reference(fake_ref)(x["u"], x["delta"], x["A"], x["B"], x["C"])
    assert seen["z"] is None and no_z.shape == x["u"].shape


def test_gate_rounding_is_what_the_float32_reference_loses():
    """Why the plugin exists: gating with silu(z) rounded to bf16 (as mamba-ssm's float32 reference does) moves dA
    much further from float64 than a float32 computation with a float32 gate."""
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
