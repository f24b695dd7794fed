"""Packing-safe Mamba kernels (causal conv1d, selective scan) and modules.

A packed row holds several sequences; every op here resets at each sequence start so nothing leaks
across boundaries, in the forward and the backward pass::

    input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]
    position_ids  [  0  1  2  3  4 |  0  1  2 |  0  1  2 | 0 ]

Public API (imported lazily: ``import ops`` needs neither a GPU nor mamba-ssm / causal-conv1d):

- ``packed_selective_scan``, ``selective_scan_ref``: the selective scan (mamba-ssm's
  ``selective_scan_fn`` shapes) with position_ids / seq_idx resets, and its PyTorch reference.
- ``packed_causal_conv1d``, ``causal_conv1d_ref``: depthwise causal conv1d without cross-sequence taps.
- ``packed_mamba_inner_fn``, ``packed_mamba_inner_ref``: the fused Mamba-1 mixer (in_proj -> conv ->
  x_proj -> dt_proj -> gated scan -> out_proj) in one autograd Function.
- ``PackedMamba``: drop-in for ``mamba_ssm.modules.mamba_simple.Mamba`` (same parameters);
  ``forward(hidden_states, position_ids=None, seq_idx=None)``.
- ``enable_packing(model)``: converts a ``MambaLMHeadModel`` (Mamba-1 / Mamba-2 mixers), or a Hugging
  Face ``MambaForCausalLM`` / ``FalconMambaForCausalLM`` / ``Mamba2ForCausalLM`` (``ops.hf``), in place.
- ``check_isolation(model_fn, batch)``: leak detector for any model on a packed batch.
- boundaries: ``seq_idx_to_position_ids``, ``position_ids_to_seq_idx``, ``cu_seqlens_to_position_ids``,
  ``position_ids_to_cu_seqlens``, ``validate_position_ids``, ``resolve_position_ids``.
- backends: ``set_backend``, ``get_backend``, ``use_backend``, ``available_backends``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "packed_selective_scan": "ops.selective_scan_interface",
    "selective_scan_ref": "ops.selective_scan_interface",
    "PackedSelectiveScanFn": "ops.selective_scan_interface",
    "packed_causal_conv1d": "ops.conv1d_interface",
    "causal_conv1d_ref": "ops.conv1d_interface",
    "PackedCausalConv1dFn": "ops.conv1d_interface",
    "packed_mamba_inner_fn": "ops.mamba_inner",
    "packed_mamba_inner_ref": "ops.mamba_inner",
    "PackedMambaInnerFn": "ops.mamba_inner",
    "PackedMamba": "ops.modules.mamba_simple",
    "enable_packing": "ops.convert",
    "check_isolation": "ops.isolation",
    "IsolationReport": "ops.isolation",
    "seq_idx_to_position_ids": "ops.boundaries",
    "position_ids_to_seq_idx": "ops.boundaries",
    "cu_seqlens_to_position_ids": "ops.boundaries",
    "position_ids_to_cu_seqlens": "ops.boundaries",
    "cu_seqlens_to_seq_idx": "ops.boundaries",
    "validate_position_ids": "ops.boundaries",
    "resolve_position_ids": "ops.boundaries",
    "BoundaryError": "ops.boundaries",
    "set_backend": "ops.backends",
    "get_backend": "ops.backends",
    "use_backend": "ops.backends",
    "available_backends": "ops.backends",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
