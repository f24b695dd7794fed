"""The kernel ops as the fused autograd Functions call them (``ops.mamba_inner``, ``ops.carry``,
``ops.context_parallel``).

Below autograd a fused Function needs only the implementation of each op for its tensors' device. Called as
``torch.ops.packloader.<op>``, every call also passes the custom op's dispatch layers (Python before and after the
C++ dispatcher, its autograd and alias checks), which cost 0.1-0.4 ms of host time a call: profiled inside FSDP2 on
H200s, more than several of a layer's kernels take, so a training step with 6 such calls a layer became host-bound in
places. Each name here calls the op's CUDA implementation directly where :func:`ops.backends.calls_directly` allows
(plain eager mode on CUDA tensors: the same kernels and bits), and the custom op everywhere else (``torch.compile``,
fake tensors, dispatch modes, other devices). The custom ops remain the public interface (``ops/contract.py``).
"""
from __future__ import annotations

import torch

from . import conv1d_interface as _conv
from . import selective_scan_interface as _scan
from .backends import calls_directly

__all__ = ["causal_conv1d_fwd", "causal_conv1d_bwd", "conv_states_fwd", "conv_states_bwd", "selective_scan_fwd",
           "selective_scan_bwd"]


def _direct_or_op(op, cuda_impl):
    """``op``'s CUDA implementation where :func:`calls_directly` allows it for the first argument, else ``op``."""

    def call(*args):
        return cuda_impl(*args) if calls_directly(args[0]) else op(*args)

    call.__name__ = call.__qualname__ = op.__name__
    call.__doc__ = f"``torch.ops.packloader.{op.__name__}`` (see ops/contract.py), without its dispatch in eager mode."
    return call


causal_conv1d_fwd = _direct_or_op(torch.ops.packloader.causal_conv1d_fwd, _conv._conv_fwd_cuda)
causal_conv1d_bwd = _direct_or_op(torch.ops.packloader.causal_conv1d_bwd, _conv._conv_bwd_cuda)
conv_states_fwd = _direct_or_op(torch.ops.packloader.conv_states_fwd, _conv._conv_states_fwd_cuda)
conv_states_bwd = _direct_or_op(torch.ops.packloader.conv_states_bwd, _conv._conv_states_bwd_cuda)
selective_scan_fwd = _direct_or_op(torch.ops.packloader.selective_scan_fwd, _scan._scan_fwd_cuda)
selective_scan_bwd = _direct_or_op(torch.ops.packloader.selective_scan_bwd, _scan._scan_bwd_cuda)
