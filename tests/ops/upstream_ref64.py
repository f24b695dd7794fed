"""A pytest plugin that evaluates mamba-ssm's own ``selective_scan_ref`` in float64 (GPU suites).

mamba-ssm's ``tests/ops/test_selective_scan.py`` compares a kernel with ``selective_scan_ref``, which computes in
float32 but gates with ``F.silu(z)`` in ``z``'s own dtype: for fp16 / bf16 inputs the gate is rounded to that dtype,
and with it every gradient that flows through the output. At long sequences the rounding adds up past the test's
tolerances (dA is a sum of large terms that cancel), so the widened suite fails for any kernel that gates in float32,
upstream's own included. With this plugin the same tests compare against the same function evaluated in float64
(inputs upcast, output cast back to the input dtype, gradients cast back to each input's dtype by autograd), so
what fails is the kernel's own error. ``benchmarks/gpu/upstream_suites.sh`` runs the suite both ways::

    python -m pytest -p tests.ops.upstream_adapter -p tests.ops.upstream_ref64 test_selective_scan.py
"""
from __future__ import annotations

import functools

import torch


def float64_reference(ref):
    """``ref`` (mamba-ssm's ``selective_scan_ref`` signature) evaluated on float64 copies of its tensor arguments.

    The output comes back in ``u``'s dtype and the last state in float32 (what the kernels return); autograd carries
    the gradients back to the caller's tensors in their own dtypes.
    """
    @functools.wraps(ref)
    def ref64(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
        up = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
        res = ref(up(u), up(delta), up(A), up(B), up(C), up(D), z=up(z), delta_bias=up(delta_bias),
                  delta_softplus=delta_softplus, return_last_state=return_last_state)
        if return_last_state:
            out, last_state = res
            return out.to(u.dtype), last_state.to(torch.float32)
        return res.to(u.dtype)

    return ref64


def pytest_configure(config):
    try:
        import mamba_ssm.ops.selective_scan_interface as ss
    except ImportError:
        return
    ss.selective_scan_ref = float64_reference(ss.selective_scan_ref)
