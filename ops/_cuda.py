"""Compiled CUDA kernels of ``ops``: packed selective scan and packed causal conv1d (forward and backward).

Nothing here builds at import time: ``load()`` returns the extension, installed ahead of time (``ops._C``) or built
just in time on first use (``ops._build`` says how). The extension's functions (``scan_fwd``, ``scan_bwd``,
``conv_fwd``, ``conv_bwd``) are called only by the CUDA implementations of the custom ops in
``ops/selective_scan_interface.py`` and ``ops/conv1d_interface.py`` (their contract: ``ops/contract.py``).
"""
from __future__ import annotations

from . import _build


def is_available() -> bool:
    """A CUDA device is present and the extension is installed, built or buildable. Never raises."""
    return _build.can_load()


def load():
    """The extension module (``ops._C`` if installed, else built just in time; see ``ops._build``)."""
    return _build.load_extension()
