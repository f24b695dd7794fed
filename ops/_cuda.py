"""Compiled CUDA kernels of ``ops``: packed selective scan and packed causal conv1d (forward and backward).

Nothing here builds at import time: ``load()`` returns the extension, installed ahead of time (``ops._C``) or built
just in time on first use (``ops._build`` says how). The extension's functions (``scan_fwd``, ``scan_bwd``,
``conv_runmask``, ``conv_fwd``, ``conv_bwd``, ``conv_states_fwd``, ``conv_states_bwd``) are called only by the CUDA
implementations of the custom ops in ``ops/selective_scan_interface.py`` and ``ops/conv1d_interface.py`` (their
contract: ``ops/contract.py``); ``segment_sums`` by ``ops/time_split.py`` (the cut along time, the carry's chains).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import _build


def is_available() -> bool:
    """A CUDA device is present and the extension is installed, built or buildable. Never raises."""
    return _build.can_load()


def load():
    """The extension module (``ops._C`` if installed, else built just in time; see ``ops._build``)."""
    return _build.load_extension()


@contextlib.contextmanager
def kernel_outputs() -> Iterator[None]:
    """Allocate, inside this block, only buffers that a kernel then writes in full (every element it returns).

    Under ``torch.use_deterministic_algorithms(True)`` torch fills every ``torch.empty`` with NaN first
    (``torch.utils.deterministic.fill_uninitialized_memory``), so that uninitialised memory reads the same every run.
    For a buffer the kernel overwrites entirely that fill is a wasted pass over memory (about 5 % of the scan's
    forward and backward in deterministic mode); the buffers are still written the same bits every run.
    The setting is torch's process-wide flag: another thread allocating inside this short block (allocations only,
    no kernel runs in it) would get its tensor unfilled too.
    """
    det = torch.utils.deterministic
    prev = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = prev
