"""A pytest plugin that hands mamba-ssm's ``selective_scan_ref`` its gate ``z`` in float32 (GPU suites).

mamba-ssm's ``tests/ops/test_selective_scan.py`` compares a kernel with ``selective_scan_ref``, which computes in
float32 except for one factor: it gates with ``F.silu(z)`` in ``z``'s own dtype, so for fp16 / bf16 inputs the gate is
rounded to that dtype, and with it every gradient that flows through the output. At long sequences that rounding adds
up past the test's tolerances (dA is a sum of large terms that cancel): the widened suite fails for any kernel that
gates in float32, upstream's own included (``tests/ops/test_upstream_gate32.py`` shows the effect against float64 on
the CPU). With this plugin the same reference gets ``z.float()``: nothing else changes (it still computes in float32
and returns ``u``'s dtype; autograd casts ``z``'s gradient back to ``z``'s dtype). ``benchmarks/gpu/upstream_suites.sh``
runs the suite both ways::

    python -m pytest -p tests.ops.upstream_adapter -p tests.ops.upstream_gate32 test_selective_scan.py
"""
from __future__ import annotations

import functools


def float32_gate_reference(ref):
    """``ref`` (mamba-ssm's ``selective_scan_ref`` signature) called with ``z`` upcast to float32."""
    @functools.wraps(ref)
    def ref_gate32(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
        return ref(u, delta, A, B, C, D, z=None if z is None else z.float(), delta_bias=delta_bias,
                   delta_softplus=delta_softplus, return_last_state=return_last_state)

    return ref_gate32


def pytest_configure(config):
    try:
        import mamba_ssm.ops.selective_scan_interface as ss
    except ImportError:
        return
    ss.selective_scan_ref = float32_gate_reference(ss.selective_scan_ref)
