"""The packed scan on grids too small to fill the GPU: rows cut at sequence starts into segments run side by side.

For each shape (batch x dim x seqlen, bf16, dstate 16, with z, D, delta_bias, softplus) and each kind of row, times
the forward kernel in every layout (threads a channel: 1, 2, 4, 8) and segment count (1, 2, 4, ...), the backward
kernel for every segment count, the plan ``ops`` makes (``ops/contract.py``: ``scan_fwd_segments`` /
``scan_bwd_segments``, the layout chosen by the kernel) through the ops, and mamba-ssm's ``selective_scan_fn`` on the
same tensors without boundaries (when installed). Rows:

- ``packed``: 10-20 sequences a row, cut at random (``bench_ops.py``'s rows);
- ``lognormal``: lengths lognormal(5.5, 0.9) clipped to [8, 2048], packed in order;
- ``one``: one sequence a row (nothing to cut: later segments are empty; the worst case of a plan).

    python3 benchmarks/bench_scan_segments.py --out benchmarks/results/scan_segments/scan_segments.json
    python3 benchmarks/bench_scan_segments.py --shapes 1x1024x2048,2x5120x4096 --rows packed

Each time is the median of --iters runs after --warmup, CUDA events. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import bench, packed_position_ids  # noqa: E402

SHAPES = "8x4096x4096,4x4096x4096,2x5120x4096,2x4096x4096,1x5120x4096,2x2048x4096,1x2048x4096,1x1024x2048," \
         "4x1536x2048,8x768x2048,16x1536x2048"


def lognormal_position_ids(batch, seqlen, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lens, left = [], seqlen
        while left > 0:
            n = int(min(left, np.clip(rng.lognormal(5.5, 0.9), 8, 2048)))
            lens.append(n)
            left -= n
        rows.append(torch.cat([torch.arange(n) for n in lens]))
    return torch.stack(rows).int().cuda()


def scan_inputs(batch, dim, seqlen, dstate=16, dtype=torch.bfloat16, seed=0):
    """(u, delta, A, B, C, D, z, delta_bias, dout) on the GPU: B / C (batch, 1, dstate, seqlen), A / D / delta_bias
    float32, the rest ``dtype``; delta around softplus(-4)."""
    torch.manual_seed(seed)
    shape = (batch, dim, seqlen)
    u = torch.randn(shape, device="cuda", dtype=dtype)
    delta = (0.5 * torch.randn(shape, device="cuda") - 4.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate, device="cuda"))
    Bm = torch.randn(batch, 1, dstate, seqlen, device="cuda", dtype=dtype)
    Cm = torch.randn(batch, 1, dstate, seqlen, device="cuda", dtype=dtype)
    Dp = torch.randn(dim, device="cuda")
    z = torch.randn(shape, device="cuda", dtype=dtype)
    dbias = 0.5 * torch.randn(dim, device="cuda")
    dout = torch.randn(shape, device="cuda", dtype=dtype)
    return u, delta, A, Bm, Cm, Dp, z, dbias, dout


def position_ids(kind, batch, seqlen):
    if kind == "packed":
        return packed_position_ids(batch, seqlen)[0]
    if kind == "lognormal":
        return lognormal_position_ids(batch, seqlen)
    return torch.arange(seqlen, dtype=torch.int32, device="cuda").expand(batch, seqlen).contiguous()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="comma list of BATCHxDIMxSEQLEN")
    ap.add_argument("--rows", default="packed,lognormal,one", help="comma list of packed, lognormal, one")
    ap.add_argument("--max-segments", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import ops  # noqa: F401  (registers torch.ops.packloader.*)
    from ops import _cuda
    from ops.contract import scan_bwd_segments, scan_fwd_segments

    ext = _cuda.load()
    kops = torch.ops.packloader
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as e:  # noqa: BLE001
        selective_scan_fn = None
        print(f"(mamba-ssm unavailable: {type(e).__name__}: {e})")
    results = []
    dt, N = torch.bfloat16, 16
    print(f"{'shape':<14} {'rows':<9} {'what':<26} {'ms':>8}")
    for shape in args.shapes.split(","):
        Bz, D, L = (int(v) for v in shape.split("x"))
        u, delta, A, Bm, Cm, Dp, z, dbias, dout = scan_inputs(Bz, D, L, N, dt)
        out = torch.empty_like(u)
        saved = torch.empty(Bz, D, -(-L // 64), 16, device="cuda")
        du, ddelta, dz = torch.empty_like(u), torch.empty_like(u), torch.empty_like(u)
        dB = torch.zeros(Bz, 1, N, L, device="cuda")
        dC = torch.zeros(Bz, 1, N, L, device="cuda")
        ks = [k for k in (1, 2, 4, 8, 16, 32) if k <= args.max_segments and L // k >= 128]
        entry = {"shape": [Bz, D, L], "plan": {"fwd_segments": scan_fwd_segments(Bz, D, L, sm),
                                               "bwd_segments": scan_bwd_segments(Bz, D, L, sm)}, "rows": {}}
        if selective_scan_fn is not None:
            B3, C3 = Bm[:, 0].contiguous(), Cm[:, 0].contiguous()
            uq = u.detach().clone().requires_grad_(True)
            up_f = bench(lambda: selective_scan_fn(u, delta, A, B3, C3, Dp, z, dbias, True), args.warmup, args.iters)

            def up_fb():
                y = selective_scan_fn(uq, delta, A, B3, C3, Dp, z, dbias, True)
                y.backward(dout)

            up_fb_ms = bench(up_fb, args.warmup, args.iters)
            entry["upstream"] = {"fwd": round(up_f, 4), "fwd+bwd": round(up_fb_ms, 4)}
            print(f"{shape:<14} {'-':<9} {'upstream fwd / fwd+bwd':<26} {up_f:8.3f} {up_fb_ms:8.3f}", flush=True)
        for kind in args.rows.split(","):
            pos = position_ids(kind, Bz, L)
            rec = {"sequences_per_row": [int((pos[b] == 0).sum()) for b in range(Bz)], "fwd": {}, "bwd": {}}
            for lanes in (1, 2, 4, 8):
                for k in ks:
                    ms = bench(lambda: ext.scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, out, saved, k,
                                                    lanes, None, None, None), args.warmup, args.iters)
                    rec["fwd"][f"lanes{lanes}_seg{k}"] = round(ms, 4)
            ext.scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, out, saved, 1, 0, None, None, None)
            for k in ks:
                dA = torch.zeros(Bz * k, D, N, device="cuda")
                dD = torch.zeros(Bz * k, D, device="cuda")
                ddb = torch.zeros(Bz * k, D, device="cuda")
                ms = bench(lambda: ext.scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout, None, du,
                                                ddelta, dz, dA, dB, dC, dD, ddb, None, k, None, None, None, None),
                           args.warmup, args.iters)
                rec["bwd"][f"seg{k}"] = round(ms, 4)
            # the plan, through the ops (allocations and the sums of the per-segment rows included)
            f = bench(lambda: kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True), args.warmup,
                      args.iters)
            o, s, _ = kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)

            def fb():
                o2, s2, _ = kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)
                kops.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, s2, dout)

            fbm = bench(fb, args.warmup, args.iters)
            rec["plan_ops"] = {"fwd": round(f, 4), "fwd+bwd": round(fbm, 4)}
            best_f = min(rec["fwd"].items(), key=lambda kv: kv[1])
            best_b = min(rec["bwd"].items(), key=lambda kv: kv[1])
            print(f"{shape:<14} {kind:<9} {'fwd lanes1..8 x seg1':<26} "
                  + " ".join(f"{rec['fwd'][f'lanes{l}_seg1']:8.3f}" for l in (1, 2, 4, 8)))
            print(f"{shape:<14} {kind:<9} {'fwd best':<26} {best_f[1]:8.3f} ({best_f[0]})")
            print(f"{shape:<14} {kind:<9} {'bwd seg ' + ','.join(map(str, ks)):<26} "
                  + " ".join(f"{rec['bwd'][f'seg{k}']:8.3f}" for k in ks) + f"  best {best_b[0]}")
            print(f"{shape:<14} {kind:<9} {'plan (ops) fwd / fwd+bwd':<26} {f:8.3f} {fbm:8.3f}  plan "
                  f"{entry['plan']}", flush=True)
            entry["rows"][kind] = rec
        results.append(entry)
        del u, delta, z, dout, out, saved, du, ddelta, dz, dB, dC
        torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "sm_count": sm, "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(),
              "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "method": f"median of {args.iters} runs after {args.warmup} warm-up runs, CUDA events; bf16, dstate 16, "
                        "z, D, delta_bias, softplus", "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    random.seed(0)
    main()
