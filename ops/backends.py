"""Which implementation runs each packed op.

Backends, per op:

============  ===============  ====================================================================
op            backend          what runs
============  ===============  ====================================================================
both          ``"cuda"``       our compiled kernels (``ops._cuda``), position_ids resets
both          ``"reference"``  the pure-PyTorch reference (any device, any dtype incl. float64);
                               torch autograd through it. The CPU path.
conv1d        ``"upstream"``   Dao-AILab causal-conv1d's ``causal_conv1d_fn`` with ``seq_idx``
                               (channel-last layout; converted when needed)
both          ``"ref_kernel"`` our autograd Functions with the reference standing in for the
                               compiled kernels (tests the Functions' plumbing on CPU)
both          ``"auto"``       the measured default: the first available of
                               :data:`PREFERENCE` for CUDA tensors in fp32/fp16/bf16, else
                               ``"reference"``
============  ===============  ====================================================================

Mamba-2 mixers have no op here: :func:`ops.enable_packing` routes ``seq_idx`` into mamba-ssm's own
``Mamba2.forward`` (its Triton SSD kernels already take ``seq_idx``).

Choose with, from highest priority: the ``backend=`` keyword of an op, :func:`set_backend` /
:func:`use_backend`, the environment variable ``PACKLOADER_OPS_BACKEND`` (``"cuda"``, or per op:
``"causal_conv1d=upstream,selective_scan=cuda"``), then ``"auto"``.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Dict, Iterator, List, Optional

import torch

__all__ = [
    "OPS",
    "BACKENDS",
    "PREFERENCE",
    "set_backend",
    "get_backend",
    "use_backend",
    "available_backends",
    "resolve_backend",
    "kernels_for",
]

OPS = ("selective_scan", "causal_conv1d")
BACKENDS: Dict[str, tuple] = {
    "selective_scan": ("cuda", "reference", "ref_kernel"),
    "causal_conv1d": ("cuda", "upstream", "reference", "ref_kernel"),
}
ENV_VAR = "PACKLOADER_OPS_BACKEND"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# "auto" on CUDA tensors: the first available of these. Ordered by measurement: our kernel is
# the one that resets on position_ids in both ops; for the conv, upstream causal-conv1d with
# seq_idx needs the channel-last layout (an extra transpose in Mamba-1's channel-first path), so
# ours goes first; benchmarks/bench_mamba_stack.py measures both (rows "conv=cuda" / "conv=upstream").
PREFERENCE: Dict[str, tuple] = {
    "selective_scan": ("cuda",),
    "causal_conv1d": ("cuda", "upstream"),
}

_override: Dict[str, Optional[str]] = {op: None for op in OPS}


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")


def _check_name(op: str, name: str) -> None:
    if name != "auto" and name not in BACKENDS[op]:
        raise ValueError(f"unknown backend {name!r} for {op}; choose from {('auto',) + BACKENDS[op]}")


def _from_env(op: str) -> Optional[str]:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    if "=" not in raw:
        if raw != "auto" and raw not in BACKENDS[op]:
            if op == "selective_scan" and raw == "upstream":
                return None  # no upstream packed Mamba-1 scan: keep auto for this op
            raise ValueError(f"{ENV_VAR}={raw!r}: unknown backend for {op}; choose from {('auto',) + BACKENDS[op]}")
        return raw
    for part in raw.split(","):
        if not part.strip():
            continue
        key, _, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if key not in OPS:
            raise ValueError(f"{ENV_VAR}: unknown op {key!r} in {raw!r}; ops are {OPS}")
        if key == op:
            _check_name(op, val)
            return val
    return None


def set_backend(backend: Optional[str] = None, op: Optional[str] = None) -> None:
    """Select the backend for one op, or for every op that has it (``op=None``).

    ``backend=None`` (or ``"auto"``) returns to the measured default. Example::

        ops.set_backend("reference")                    # everything through the PyTorch reference
        ops.set_backend("upstream", op="causal_conv1d") # causal-conv1d's seq_idx kernel for the conv
    """
    ops_ = OPS if op is None else (op,)
    if op is not None:
        _check_op(op)
        if backend is not None:
            _check_name(op, backend)
    elif backend is not None and backend != "auto" and not any(backend in BACKENDS[o] for o in OPS):
        raise ValueError(f"unknown backend {backend!r}")
    for o in ops_:
        if backend is None or backend == "auto":
            _override[o] = None
        elif backend in BACKENDS[o]:
            _override[o] = backend


def get_backend(op: str) -> str:
    """The configured backend name for ``op`` (``"auto"`` unless overridden)."""
    _check_op(op)
    return _override[op] or _from_env(op) or "auto"


@contextlib.contextmanager
def use_backend(backend: Optional[str], op: Optional[str] = None) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous choice on exit."""
    saved = dict(_override)
    try:
        set_backend(backend, op)
        yield
    finally:
        _override.update(saved)


def _cuda_module():
    try:
        return importlib.import_module("ops._cuda")
    except Exception:  # not built / not written yet / broken: never fatal for `import ops`
        return None


def _is_available(op: str, name: str) -> bool:
    if name in ("reference", "ref_kernel"):
        return True
    if not torch.cuda.is_available():
        return False
    if name == "cuda":
        mod = _cuda_module()
        if mod is None:
            return False
        try:
            return bool(mod.is_available())
        except Exception:
            return False
    if name == "upstream":
        if op != "causal_conv1d":
            return False
        from . import _upstream

        return _upstream.conv_available()
    return False


def available_backends(op: str) -> List[str]:
    """Backends that can run ``op`` here (CUDA ones only when a GPU and the kernels are present)."""
    _check_op(op)
    return [b for b in BACKENDS[op] if _is_available(op, b)]


def resolve_backend(op: str, tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    """The concrete backend for ``op`` on ``tensor`` (device and dtype decide what ``auto`` means).

    Explicit choices are honoured or fail loudly; only ``auto`` falls back.
    """
    _check_op(op)
    name = backend or get_backend(op)
    _check_name(op, name)
    if name == "auto":
        if tensor.is_cuda and tensor.dtype in KERNEL_DTYPES:
            for cand in PREFERENCE[op]:
                if _is_available(op, cand):
                    return cand
        return "reference"
    if name in ("cuda", "upstream"):
        if not tensor.is_cuda:
            raise ValueError(f"backend {name!r} for {op} needs CUDA tensors, got a tensor on {tensor.device}")
        if tensor.dtype not in KERNEL_DTYPES:
            raise ValueError(f"backend {name!r} for {op} takes float32/float16/bfloat16, got {tensor.dtype}")
        if not _is_available(op, name):
            what = "ops._cuda (our kernels)" if name == "cuda" else "the causal-conv1d package"
            raise RuntimeError(f"backend {name!r} for {op} is not available: {what} cannot be loaded here")
    return name


def kernels_for(op: str, name: str):
    """The module implementing the raw-kernel contract for a kernel backend.

    ``"cuda"`` -> ``ops._cuda`` (built on first use), ``"upstream"`` -> ``ops._upstream``,
    ``"ref_kernel"`` -> ``ops._ref_kernels``.
    """
    if name == "cuda":
        mod = _cuda_module()
        if mod is None:
            raise RuntimeError("ops._cuda cannot be imported")
        if not getattr(mod, "_packloader_loaded", False):
            mod.load()
            try:
                mod._packloader_loaded = True
            except Exception:
                pass
        return mod
    if name == "upstream":
        from . import _upstream

        return _upstream
    if name == "ref_kernel":
        from . import _ref_kernels

        return _ref_kernels
    raise ValueError(f"backend {name!r} has no raw kernels")
