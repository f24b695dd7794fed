"""One forward and one backward of our packed selective scan and of mamba-ssm's selective_scan_fn (for ncu).

    ncu -k regex:scan python benchmarks/gpu/scan_once.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.bench_ops import packed_position_ids  # noqa: E402


def main():
    from ops import _cuda

    Bz, D, L, N = 8, 4096, 4096, 16
    dt = torch.bfloat16
    torch.manual_seed(0)
    pos, _ = packed_position_ids(Bz, L)
    u = torch.randn(Bz, D, L, device="cuda", dtype=dt)
    delta = (0.5 * torch.randn(Bz, D, L, device="cuda") - 4.0).to(dt)
    A = -torch.exp(0.5 * torch.randn(D, N, device="cuda"))
    Bm = torch.randn(Bz, N, L, device="cuda", dtype=dt)
    Cm = torch.randn(Bz, N, L, device="cuda", dtype=dt)
    Dp = torch.randn(D, device="cuda")
    z = torch.randn(Bz, D, L, device="cuda", dtype=dt)
    dbias = 0.5 * torch.randn(D, device="cuda")
    dout = torch.randn(Bz, D, L, device="cuda", dtype=dt)
    out, saved, _ = _cuda.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)
    _cuda.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, dout, saved, out, pos, True)
    torch.cuda.synchronize()
    try:
        import selective_scan_cuda
    except ImportError as e:
        print("upstream unavailable:", e)
        return
    res = selective_scan_cuda.fwd(u, delta, A, Bm, Cm, Dp, z, dbias, True)
    x = res[1]
    selective_scan_cuda.bwd(u, delta, A, Bm, Cm, Dp, z, dbias, dout, x, res[0], None, True, False)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
