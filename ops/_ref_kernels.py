"""The raw-kernel contract of ``ops._cuda``, implemented with the PyTorch references.

Stands in for the compiled kernels so that the autograd Functions (``PackedSelectiveScanFn``,
``PackedCausalConv1dFn``, ``PackedMambaInnerFn``) can be tested on any device and in float64
(backend ``"ref_kernel"``). Backward passes recompute the forward under autograd. Not fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def is_available() -> bool:
    return True


def load():
    import sys

    return sys.modules[__name__]


def _leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, position_ids, delta_softplus):
    from .selective_scan_interface import selective_scan_ref

    with torch.no_grad():
        out = selective_scan_ref(u, delta, A, B, C, D, None, delta_bias, delta_softplus, position_ids=position_ids,
                                 validate=False)
        out_z = None
        if z is not None:
            ct = torch.float64 if u.dtype == torch.float64 else torch.float32
            out_z = (out.to(ct) * F.silu(z.to(ct))).to(u.dtype)
    return out, None, out_z


def selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, saved, out, position_ids, delta_softplus):
    from .selective_scan_interface import selective_scan_ref

    ins = [_leaf(t) for t in (u, delta, A, B, C, D, z, delta_bias)]
    with torch.enable_grad():
        y = selective_scan_ref(*ins, delta_softplus, position_ids=position_ids, validate=False)
        wrt = [t for t in ins if t is not None]
        grads = torch.autograd.grad(y, wrt, dout, allow_unused=True)
    it = iter(grads)
    res = []
    for t in ins:
        if t is None:
            res.append(None)
        else:
            g = next(it)
            res.append(torch.zeros_like(t) if g is None else g)
    return tuple(res)


def causal_conv1d_fwd(x, weight, bias, position_ids, activation):
    from .conv1d_interface import causal_conv1d_ref

    with torch.no_grad():
        return causal_conv1d_ref(x, weight, bias, activation, position_ids=position_ids, validate=False)


def causal_conv1d_bwd(x, weight, bias, dout, position_ids, activation):
    from .conv1d_interface import causal_conv1d_ref

    ins = [_leaf(t) for t in (x, weight, bias)]
    with torch.enable_grad():
        y = causal_conv1d_ref(*ins, activation, position_ids=position_ids, validate=False)
        wrt = [t for t in ins if t is not None]
        grads = torch.autograd.grad(y, wrt, dout)
    dx, dw = grads[0], grads[1]
    db = grads[2] if bias is not None else None
    return dx, dw, db
