"""Channel-first packed conv1d: our kernel variants (PACKLOADER_CONV_CF) against causal-conv1d, fwd and bwd apart.

    python benchmarks/gpu/conv_variants.py --out conv_variants.json     # timings (CUDA events, medians)
    ncu ... python benchmarks/gpu/conv_variants.py --once                # one call of each, for the profiler

B=8, D=4096, L=4096, width 4, silu, bf16 by default; 10-20 sequences per row. "bwd" is the backward call alone
(ours) or fwd+bwd minus fwd (causal-conv1d through autograd). GB/s counts the bytes each call must move. Each
sample times --reps calls back to back (the GPU queue never runs dry, as in training), divided by --reps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.bench_ops import bench, packed_position_ids  # noqa: E402

VARIANTS = ("regs", "vec1", "vec2", "vec4", "vecm")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--reps", type=int, default=10,
                    help="calls per timed sample, back to back, so the GPU never waits for Python")
    ap.add_argument("--once", action="store_true", help="one call of each kernel (for ncu)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated PACKLOADER_CONV_CF values")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--channel-last", action="store_true",
                    help="channel-last x / dout; variants are then PACKLOADER_CONV_CL values (plain, grouped)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from ops import _cuda

    dt = getattr(torch, args.dtype)
    Bz, D, L, W = args.batch, args.dim, args.seqlen, args.width
    torch.manual_seed(0)
    pos, seq_idx = packed_position_ids(Bz, L)
    x = torch.randn(Bz, D, L, device="cuda", dtype=dt)
    g = torch.randn(Bz, D, L, device="cuda", dtype=dt)
    env_name = "PACKLOADER_CONV_CF"
    if args.channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
        g = g.transpose(1, 2).contiguous().transpose(1, 2)
        env_name = "PACKLOADER_CONV_CL"
        if args.variants == ",".join(VARIANTS):
            args.variants = "plain,grouped"
    w = 0.3 * torch.randn(D, W, device="cuda")
    cb = torch.randn(D, device="cuda")
    _cuda.load()
    nbytes = x.numel() * x.element_size()
    rows = []

    def run(fn, phase, impl, moved):
        if args.once:
            fn()
            torch.cuda.synchronize()
            return
        ms = bench(lambda: [fn() for _ in range(args.reps)], 3, args.iters) / args.reps
        rows.append({"impl": impl, "phase": phase, "ms": round(ms, 4), "GB/s": round(moved / ms / 1e6, 1)})
        print(f"  {impl:<28} {phase:<8} {ms:8.4f} ms {moved / ms / 1e6:8.1f} GB/s", flush=True)

    ref = None
    for v in args.variants.split(","):
        os.environ[env_name] = v
        out = _cuda.causal_conv1d_fwd(x, w, cb, pos, "silu")
        grads = _cuda.causal_conv1d_bwd(x, w, cb, g, pos, "silu")
        if ref is None:
            ref = (out, grads)
        else:   # every variant computes the same thing
            assert torch.equal(out, ref[0]), v   # same arithmetic in every variant
            for a, b in zip(grads, ref[1]):   # summation orders differ: compare as relative norms
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err < 1e-3, (v, err)
        run(lambda: _cuda.causal_conv1d_fwd(x, w, cb, pos, "silu"), "fwd", f"ours {v}", 2 * nbytes)
        run(lambda: _cuda.causal_conv1d_bwd(x, w, cb, g, pos, "silu"), "bwd", f"ours {v}", 3 * nbytes)
    os.environ.pop(env_name)
    try:
        if args.no_upstream:
            raise ImportError("--no-upstream")
        from causal_conv1d import causal_conv1d_fn
    except ImportError as e:
        print(f"  (causal-conv1d unavailable: {e})")
        causal_conv1d_fn = None
    if causal_conv1d_fn is not None:
        with torch.no_grad():
            run(lambda: causal_conv1d_fn(x, w, cb, activation="silu"), "fwd", "causal-conv1d (no bnd)", 2 * nbytes)
        xl, wl, bl = (t.detach().clone().requires_grad_(True) for t in (x, w, cb))

        def fb():
            xl.grad = wl.grad = bl.grad = None
            causal_conv1d_fn(xl, wl, bl, activation="silu").backward(g)

        run(fb, "fwd+bwd", "causal-conv1d (no bnd)", 5 * nbytes)
        if not args.once:
            f = [r for r in rows if r["impl"] == "causal-conv1d (no bnd)"]
            bwd = f[1]["ms"] - f[0]["ms"]
            rows.append({"impl": "causal-conv1d (no bnd)", "phase": "bwd", "ms": round(bwd, 4),
                         "GB/s": round(3 * nbytes / bwd / 1e6, 1), "note": "fwd+bwd minus fwd"})
            print(f"  {'causal-conv1d (no bnd)':<28} {'bwd':<8} {bwd:8.4f} ms (fwd+bwd minus fwd)")
    if args.out and not args.once:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": [Bz, D, L, W], "dtype": args.dtype,
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
