"""Packing-safe Mamba kernels (causal conv1d, selective scan) and modules.

A packed row holds several sequences; every op here resets at each sequence start so nothing leaks
across boundaries, in the forward and the backward pass::

    input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]
    position_ids  [  0  1  2  3  4 |  0  1  2 |  0  1  2 | 0 ]

Public API (``import ops`` needs neither a GPU nor mamba-ssm / causal-conv1d; the CUDA kernels build on first use
on a CUDA tensor):

- ``packed_selective_scan``, ``selective_scan_ref``: the selective scan (mamba-ssm's
  ``selective_scan_fn`` shapes) with position_ids / seq_idx resets, and its PyTorch oracle.
- ``packed_causal_conv1d``, ``causal_conv1d_ref``: depthwise causal conv1d without cross-sequence taps.
- ``packed_mamba_inner_fn``, ``packed_mamba_inner_ref``: the fused Mamba-1 mixer (in_proj -> conv ->
  x_proj -> dt_proj -> gated scan -> out_proj) in one autograd Function, and the same composed.
- ``PackedMamba``: drop-in for ``mamba_ssm.modules.mamba_simple.Mamba`` (same parameters);
  ``forward(hidden_states, position_ids=None, seq_idx=None)``.
- ``StateCache``, ``CarryStep``: carrying the state across the pieces of a long document (``overflow="carry"``):
  ``carry = cache.step(batch)``, then ``model(..., carry=carry)`` (:mod:`ops.carry`).
- ``enable_packing(model)``: converts a ``MambaLMHeadModel`` (Mamba-1 / Mamba-2 mixers), or a Hugging
  Face ``MambaForCausalLM`` / ``FalconMambaForCausalLM`` / ``Mamba2ForCausalLM`` or the Mamba-2 layers of its
  hybrids Bamba / NemotronH / GraniteMoeHybrid / FalconH1 / Zamba2 (``ops.hf``), in place.
- ``ops.decode``: generation's single-token step (``causal_conv1d_step``, ``selective_state_step``, ``mamba_step``;
  Mamba-2's ``mamba2_state_step``; Triton kernels on CUDA, CUDA-graph safe), what ``PackedMamba.step`` and
  converted transformers mixers run.
- ``check_isolation(model_fn, batch)``: leak detector for any model on a packed batch.
- boundaries: ``seq_idx_to_position_ids``, ``position_ids_to_seq_idx``, ``cu_seqlens_to_position_ids``,
  ``position_ids_to_cu_seqlens``, ``validate_position_ids``, ``resolve_position_ids``.
- dispatch (:mod:`ops.backends`): ``use_backend("reference")`` (context manager), ``set_backend``,
  ``get_backend``, ``available_backends``, ``KernelUnsupportedError``.
- the kernel ops ``torch.ops.packloader.{selective_scan,causal_conv1d}_{fwd,bwd}``, registered on import
  (their contract: :mod:`ops.contract`).
"""
from __future__ import annotations

from .backends import KernelUnsupportedError, available_backends, get_backend, set_backend, use_backend
from .boundaries import (
    BoundaryError,
    PackedBoundaries,
    cu_seqlens_to_position_ids,
    cu_seqlens_to_seq_idx,
    position_ids_to_cu_seqlens,
    position_ids_to_seq_idx,
    resolve_position_ids,
    seq_idx_to_position_ids,
    validate_position_ids,
)
from .carry import CarryError, CarryStep, StateCache
from .context_parallel import ContextParallelError, all_reduce_gradients, context_parallel, shard_batch
from .conv1d_interface import causal_conv1d_ref, packed_causal_conv1d
from .convert import enable_packing
from .generate import PackedEvalCallback, PackedEvalResult, evaluate_packed, generate_packed
from .isolation import IsolationReport, check_isolation
from .mamba_inner import PackedMambaInnerFn, packed_mamba_inner_fn, packed_mamba_inner_ref
from .modules.mamba_simple import PackedMamba
from .selective_scan_interface import packed_selective_scan, selective_scan_ref

__all__ = [
    "packed_selective_scan",
    "selective_scan_ref",
    "packed_causal_conv1d",
    "causal_conv1d_ref",
    "packed_mamba_inner_fn",
    "packed_mamba_inner_ref",
    "PackedMambaInnerFn",
    "PackedMamba",
    "enable_packing",
    "StateCache",
    "CarryStep",
    "CarryError",
    "context_parallel",
    "shard_batch",
    "all_reduce_gradients",
    "ContextParallelError",
    "generate_packed",
    "evaluate_packed",
    "PackedEvalResult",
    "PackedEvalCallback",
    "check_isolation",
    "IsolationReport",
    "seq_idx_to_position_ids",
    "position_ids_to_seq_idx",
    "cu_seqlens_to_position_ids",
    "position_ids_to_cu_seqlens",
    "cu_seqlens_to_seq_idx",
    "validate_position_ids",
    "resolve_position_ids",
    "BoundaryError",
    "PackedBoundaries",
    "set_backend",
    "get_backend",
    "use_backend",
    "available_backends",
    "KernelUnsupportedError",
]
