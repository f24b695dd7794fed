"""Which implementation runs a packed op: one rule, one override.

The rule is the tensors' device, as for any torch op (each op is a ``torch.library.custom_op``, see
:mod:`ops.contract`):

=====================================  ===========================================================
inputs                                 what runs
=====================================  ===========================================================
CUDA tensors                           the compiled kernel (``ops._cuda``), built on first use
anything else (CPU, float64, ...)      the reference: pure PyTorch, any float dtype incl. float64
CUDA tensors inside                    the reference (for tests and benchmarks)
``with ops.use_backend("reference")``
=====================================  ===========================================================

A CUDA tensor never falls back to the reference silently. Where the kernel cannot take a case (float64 or
another dtype outside float32/float16/bfloat16, ``dstate > MAX_DSTATE``, a conv width outside
``CONV_MIN_WIDTH..CONV_MAX_WIDTH``, kernels that cannot be built here), the op raises
:class:`KernelUnsupportedError` naming the reason and how to run the reference instead.

The override is read when an op runs (forward and backward each), not when it is traced: inside a
``torch.compile``-d function it applies without recompiling, except under CUDA graphs
(``mode="reduce-overhead"``), where what ran at capture is replayed. Set it around the whole step (forward and
backward). The scan's forward and backward may run on different implementations (the state they hand over,
``saved``, is the same in both: see :mod:`ops.contract`).

This is also where a later switch that changes the kernel choice (a deterministic mode, say) belongs:
:func:`implementation` is the one function that decides.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import torch

from .contract import CONV_MAX_WIDTH, CONV_MIN_WIDTH, KERNEL_DTYPES, MAX_DSTATE

__all__ = [
    "OPS",
    "BACKENDS",
    "KernelUnsupportedError",
    "set_backend",
    "get_backend",
    "use_backend",
    "available_backends",
    "implementation",
]

OPS = ("selective_scan", "causal_conv1d")
BACKENDS = ("auto", "reference")   # "auto": by device (the default); "reference": the reference everywhere

_forced: List[Optional[str]] = [None]   # None or "reference"

HOW_TO_REFERENCE = 'to run the (slow) pure-PyTorch reference on CUDA tensors instead, wrap the call in ' \
                   '`with ops.use_backend("reference"):`'


class KernelUnsupportedError(RuntimeError):
    """A CUDA tensor reached an op whose compiled kernel cannot take the case (or cannot be built here)."""


def _normalize(backend: Optional[str]) -> Optional[str]:
    if backend is None or backend == "auto":
        return None
    if backend == "reference":
        return "reference"
    raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS} (or None, the same as 'auto')")


def set_backend(backend: Optional[str] = None) -> None:
    """Set the override: ``"reference"`` (every op on every device runs the reference) or ``None`` /
    ``"auto"`` (by device, the default). Prefer :func:`use_backend`, which restores the previous choice."""
    _forced[0] = _normalize(backend)


def get_backend() -> str:
    """``"reference"`` while the override is on, else ``"auto"``."""
    return _forced[0] or "auto"


@contextlib.contextmanager
def use_backend(backend: Optional[str]) -> Iterator[None]:
    """Run the ops inside on ``backend`` (``"reference"`` or ``"auto"``); restores the previous choice on exit.

    Example::

        with ops.use_backend("reference"):          # CUDA tensors run the PyTorch reference
            out = layer(h, position_ids=pos)
            out.sum().backward()
    """
    new = _normalize(backend)
    saved = _forced[0]
    _forced[0] = new
    try:
        yield
    finally:
        _forced[0] = saved


def use_backend_for_call(backend: str):
    """The ``backend=`` argument of a functional op: :func:`use_backend` around one call (eager mode only)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"backend={backend!r} cannot be passed to an op inside torch.compile (the override is "
                           "read when the op runs): wrap the compiled call in `with ops.use_backend(...):` instead")
    return use_backend(backend)


def available_backends() -> List[str]:
    """``["reference"]``, plus ``"cuda"`` where a GPU is visible and the kernels are built or buildable."""
    out = ["reference"]
    try:
        if torch.cuda.is_available():
            from . import _cuda

            if _cuda.is_available():
                out.append("cuda")
    except Exception:  # never fatal: this only reports
        pass
    return out


def unsupported_reason(op: str, dtype: torch.dtype, *, dstate: Optional[int] = None,
                       width: Optional[int] = None) -> Optional[str]:
    """Why the CUDA kernel of ``op`` cannot take this case, or None when it can."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    if dtype not in KERNEL_DTYPES:
        return f"the kernel takes float32/float16/bfloat16 inputs, got {dtype}"
    if op == "selective_scan" and dstate is not None and dstate > MAX_DSTATE:
        return f"the kernel takes dstate <= {MAX_DSTATE}, got dstate={dstate}"
    if op == "causal_conv1d" and width is not None and not CONV_MIN_WIDTH <= width <= CONV_MAX_WIDTH:
        return f"the kernel takes conv widths {CONV_MIN_WIDTH}..{CONV_MAX_WIDTH}, got width={width}"
    return None


def implementation(op: str, device_type: str, dtype: torch.dtype, *, dstate: Optional[int] = None,
                   width: Optional[int] = None) -> str:
    """The dispatch rule: ``"cuda"`` (the compiled kernel) or ``"reference"`` for ``op`` on inputs of this
    device type and dtype, or :class:`KernelUnsupportedError` for a CUDA case the kernel cannot take.

    Args:
        op: ``"selective_scan"`` or ``"causal_conv1d"``.
        device_type: the inputs' ``device.type`` (``"cuda"``, ``"cpu"``, ...).
        dtype: the activations' dtype (``u`` / ``x``).
        dstate: the scan's state size; width: the conv's width.
    """
    if device_type != "cuda" or _forced[0] == "reference":
        return "reference"
    reason = unsupported_reason(op, dtype, dstate=dstate, width=width)
    if reason is not None:
        raise KernelUnsupportedError(f"packloader ops: {op} on CUDA tensors: {reason}; {HOW_TO_REFERENCE}")
    return "cuda"


def load_kernels():
    """The compiled extension (built once, cached), or :class:`KernelUnsupportedError` saying why not."""
    from . import _cuda   # imported on first use on a CUDA tensor only: `import ops` never needs it

    try:
        return _cuda.load()
    except Exception as e:
        raise KernelUnsupportedError(f"{e}; {HOW_TO_REFERENCE}") from e


DIRECT_DEVICE_TYPES = ("cuda",)   # where calls_directly may say yes (the kernel-emulation tests add "cpu")


def calls_directly(t: torch.Tensor) -> bool:
    """Whether code already below autograd (a fused autograd Function, the eager functional conv) may call a kernel
    op's CUDA implementation itself instead of through ``torch.ops.packloader``: plain eager mode on a CUDA tensor,
    i.e. not compiling, no tensor subclass (fake tensors, DTensor) and no dispatch mode active. Elsewhere the custom
    op is needed (its fake implementation, its reference on other devices). See ``ops/kernel_calls.py``."""
    return (t.device.type in DIRECT_DEVICE_TYPES and not torch.compiler.is_compiling() and type(t) is torch.Tensor
            and not torch._C._len_torch_dispatch_stack())
