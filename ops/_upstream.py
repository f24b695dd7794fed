"""Upstream kernels as an alternative backend: Dao-AILab causal-conv1d with ``seq_idx``.

causal-conv1d resets at ``seq_idx`` changes only in the channel-last layout (``x.stride(1) == 1``);
channel-first inputs are transposed (a copy) and the output returned in the input's layout.
Imported lazily: nothing here is needed (or imported) unless the ``"upstream"`` backend is chosen.
"""
from __future__ import annotations

import torch

from .boundaries import position_ids_to_seq_idx

_state = {"checked": False, "fn": None, "fwd": None, "bwd": None}


def _load():
    if not _state["checked"]:
        _state["checked"] = True
        try:
            from causal_conv1d import causal_conv1d_fn

            _state["fn"] = causal_conv1d_fn
        except Exception:
            _state["fn"] = None
        try:
            from causal_conv1d.cpp_functions import causal_conv1d_bwd_function, causal_conv1d_fwd_function

            _state["fwd"], _state["bwd"] = causal_conv1d_fwd_function, causal_conv1d_bwd_function
        except Exception:
            pass
    return _state


def conv_available() -> bool:
    return torch.cuda.is_available() and _load()["fn"] is not None


def is_available() -> bool:
    return conv_available()


def load():
    import sys

    if not conv_available():
        raise RuntimeError("the causal-conv1d package (with CUDA) is not importable")
    return sys.modules[__name__]


def _to_channel_last(x):
    if x.stride(1) == 1 and x.stride(2) == x.shape[1]:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _back_to(out, like):
    if like.stride(1) == 1 and not like.is_contiguous():
        return out
    return out.contiguous()


def causal_conv1d(x, weight, bias, activation, position_ids):
    """Autograd op: causal_conv1d_fn with seq_idx (channel-last), output in x's layout."""
    fn = _load()["fn"]
    if position_ids is None:
        return fn(x, weight, bias, activation=activation)
    seq_idx = position_ids_to_seq_idx(position_ids)
    out = fn(_to_channel_last(x), weight, bias, seq_idx=seq_idx, activation=activation)
    return _back_to(out, x)


# ---- raw-kernel contract (used by the fused Mamba path with conv backend "upstream") ----

def causal_conv1d_fwd(x, weight, bias, position_ids, activation):
    st = _load()
    seq_idx = position_ids_to_seq_idx(position_ids) if position_ids is not None else None
    xin = _to_channel_last(x) if seq_idx is not None else x
    if st["fwd"] is not None:
        out = st["fwd"](xin, weight, bias, seq_idx, None, None, activation == "silu")
    else:
        with torch.no_grad():
            out = st["fn"](xin, weight, bias, seq_idx=seq_idx, activation=activation)
    return _back_to(out, x)


def causal_conv1d_bwd(x, weight, bias, dout, position_ids, activation):
    st = _load()
    seq_idx = position_ids_to_seq_idx(position_ids) if position_ids is not None else None
    xin = _to_channel_last(x) if seq_idx is not None else x
    dout_in = _to_channel_last(dout) if seq_idx is not None else dout.contiguous()
    if st["bwd"] is not None:
        dx, dw, db, *_ = st["bwd"](xin, weight, bias, dout_in, seq_idx, None, None, None, False, activation == "silu")
    else:
        ins = [t.detach().requires_grad_(True) if t is not None else None for t in (xin, weight, bias)]
        with torch.enable_grad():
            y = st["fn"](ins[0], ins[1], ins[2], seq_idx=seq_idx, activation=activation)
            grads = torch.autograd.grad(y, [t for t in ins if t is not None], dout_in)
        dx, dw = grads[0], grads[1]
        db = grads[2] if bias is not None else None
    return _back_to(dx, x), dw, (db if bias is not None else None)
