"""A pytest plugin that runs upstream's own test suites against ``ops`` (GPU).

It replaces causal-conv1d's ``causal_conv1d_fn`` by :func:`ops.packed_causal_conv1d` and mamba-ssm's
``selective_scan_fn`` by :func:`ops.packed_selective_scan` before the upstream test modules import them, so their
tests check our kernels against their references. Upstream's test files are not part of this repository:
``benchmarks/gpu/upstream_suites.sh`` takes them from causal-conv1d's source archive and mamba-ssm's repository
at run time::

    python -m pytest -p tests.ops.upstream_adapter <causal-conv1d>/tests/test_causal_conv1d.py

What packing does not cover is skipped with its reason (initial / final conv states, complex or time-invariant
B / C); everything else must pass.
"""
from __future__ import annotations

import pytest
import torch

import ops


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal-conv1d's signature over ops.packed_causal_conv1d."""
    if initial_states is not None or return_final_states or final_states_out is not None:
        pytest.skip("initial / final conv states (streaming generation) are outside packing")
    return ops.packed_causal_conv1d(x, weight, bias, activation, seq_idx=seq_idx)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """mamba-ssm's signature over ops.packed_selective_scan (each row one sequence)."""
    if A.is_complex():
        pytest.skip("complex A is not Mamba-1 training")
    if B.dim() == 2 or C.dim() == 2:
        pytest.skip("time-invariant B / C is not Mamba-1 training")
    out = ops.packed_selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    if not return_last_state:
        return out
    # the state after the last token: the scan op's last saved chunk state (see ops/contract.py)
    batch, _, seqlen = u.shape
    pos = torch.arange(seqlen, device=u.device, dtype=torch.int32).expand(batch, seqlen).contiguous()
    with torch.no_grad():
        _, saved, _ = torch.ops.packloader.selective_scan_fwd(u, delta, A.float(), B, C, D, z, delta_bias, pos,
                                                           bool(delta_softplus))
    return out, saved[:, :, -1, :A.shape[1]]


def pytest_configure(config):
    try:
        import causal_conv1d.causal_conv1d_interface as cc
    except ImportError:
        cc = None
    if cc is not None:
        cc.causal_conv1d_fn = causal_conv1d_fn
    try:
        import mamba_ssm.ops.selective_scan_interface as ss
    except ImportError:
        ss = None
    if ss is not None:
        ss.selective_scan_fn = selective_scan_fn
