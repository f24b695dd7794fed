"""Compiled CUDA kernels of ``ops``: packed selective scan and packed causal conv1d (forward and backward).

Nothing here builds at import time.  ``load()`` compiles ``ops/csrc/*`` once with
``torch.utils.cpp_extension.load`` into a cache folder keyed by a hash of the sources, torch, CUDA and the GPU
architecture (``~/.cache/packloader/ops-<hash>``, or ``$PACKLOADER_CACHE``), printing a message to stderr while
it builds.  The extension's functions (``scan_fwd``, ``scan_bwd``, ``conv_fwd``, ``conv_bwd``) are called only by the
CUDA implementations of the custom ops in ``ops/selective_scan_interface.py`` and ``ops/conv1d_interface.py``
(their contract: ``ops/contract.py``).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys
import threading

import torch

_CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
_SOURCES = ("binding.cpp", "selective_scan.cu", "causal_conv1d.cu")
_HEADERS = ("ops_common.h", "dtype_utils.cuh", "cp_async.cuh")

_ext = None
_lock = threading.Lock()


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        return str(pathlib.Path(home) / "bin" / "nvcc")
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover
        CUDA_HOME = None
    if CUDA_HOME and (pathlib.Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def is_available() -> bool:
    """A CUDA device is present and the extension is built or buildable (nvcc found). Never raises."""
    try:
        if not torch.cuda.is_available() or torch.version.cuda is None:
            return False
        return _ext is not None or _nvcc() is not None
    except Exception:
        return False


def _build_dir() -> pathlib.Path:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_CSRC / name).read_bytes())
    major, minor = torch.cuda.get_device_capability()
    h.update(f"torch={torch.__version__};cuda={torch.version.cuda};arch={major}{minor};py={sys.version_info[:2]}".encode())
    root = pathlib.Path(os.environ.get("PACKLOADER_CACHE", pathlib.Path.home() / ".cache" / "packloader"))
    return root / f"ops-{h.hexdigest()[:16]}"


def load():
    """Build (once, cached) and return the extension module."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if not torch.cuda.is_available():
            raise RuntimeError("packloader ops: the CUDA kernels need a CUDA GPU; none is visible to torch")
        if _nvcc() is None:
            raise RuntimeError(
                "packloader ops: cannot build the CUDA kernels: nvcc not found (set CUDA_HOME to a CUDA toolkit "
                "matching torch's CUDA " + str(torch.version.cuda) + ", or put nvcc on PATH); the pure-PyTorch "
                "reference path still works")
        from torch.utils import cpp_extension

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
        fresh = not any(build.glob("*.so"))
        if fresh:
            print(f"packloader ops: building CUDA kernels for sm_{arch} in {build} (once; about a minute)...",
                  file=sys.stderr, flush=True)
        old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        try:
            _ext = cpp_extension.load(
                name="packloader_ops_cuda",
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
                build_directory=str(build),
                verbose=False,
            )
        except Exception as e:
            raise RuntimeError(f"packloader ops: building the CUDA kernels in {build} failed: {e}") from e
        finally:
            if old_arch is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
        if fresh:
            print("packloader ops: CUDA kernels built.", file=sys.stderr, flush=True)
        return _ext
