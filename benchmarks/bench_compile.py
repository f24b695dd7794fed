"""Eager vs torch.compile step time of ``ops.PackedMamba``, forward + backward over packed rows.

    python benchmarks/bench_compile.py --out benchmarks/results/compile/compile_h200.json  # the GPU run (default shapes)
    python benchmarks/bench_compile.py --quick                                   # smoke run on any machine (CPU)

Default shapes (issue 12): one ``PackedMamba(d_model=1024)`` layer, 4 rows x 4096 tokens with 10-20 sequences per
row, bf16 autocast over float32 weights, forward + backward. Rows:

- ``eager``: the module as is;
- ``compile``: ``torch.compile(fn, fullgraph=True)`` (inductor; ``aot_eager`` on the CPU);
- ``compile reduce-overhead``: the same with ``mode="reduce-overhead"`` (CUDA graphs; GPU only).

Each step runs the forward on a fresh ``position_ids`` tensor and the backward; the time is the median of
``--iters`` steps after ``--warmup`` steps (CUDA events on the GPU). Also printed: graph breaks counted by
``torch._dynamo.explain`` (must be 0), the compile time (first call), and compiled vs eager relative error of
the output and the input gradient. A table is printed; JSON goes to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def packed_positions(batch, seqlen, lo, hi, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        n = rng.randint(lo, hi)
        cuts = sorted(rng.sample(range(1, seqlen), n - 1)) if n > 1 else []
        bounds = [0] + cuts + [seqlen]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]))
    return torch.stack(rows)


def timed(fn, warmup, iters, device):
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--min-seqs", type=int, default=10)
    ap.add_argument("--max-seqs", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="autocast dtype (fp32: none)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on CUDA, "
                                                    "aot_eager on the CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a few steps: a smoke test (CPU is fine)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.batch, args.seqlen, args.min_seqs, args.max_seqs = 32, 2, 64, 2, 5
        args.warmup, args.iters = 1, 3
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu (or --quick)")
    backend = args.backend or ("inductor" if dev == "cuda" else "aot_eager")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    if dev == "cpu":
        amp = None  # the CPU runs the float32 reference

    import ops

    torch.manual_seed(0)
    B, L, d = args.batch, args.seqlen, args.d_model
    layer = ops.PackedMamba(d, device=dev)
    pos_loader = packed_positions(B, L, args.min_seqs, args.max_seqs).to(dev)
    h0 = torch.randn(B, L, d, device=dev)
    dy = torch.randn(B, L, d, device=dev) * 0.01
    params = list(layer.parameters())

    def fwd(h, position_ids):
        return layer(h, position_ids=position_ids)

    def make_step(f):
        def step():
            for p in params:
                p.grad = None
            h = h0.detach().requires_grad_(True)
            with torch.autocast(dev, dtype=amp, enabled=amp is not None):
                out = f(h, pos_loader.clone())  # a fresh boundary tensor every step, as from a loader
            out.backward(dy.to(out.dtype))
            return out, h
        return step

    with torch.autocast(dev, dtype=amp, enabled=amp is not None):
        explained = torch._dynamo.explain(fwd)(h0, pos_loader)
    breaks = explained.graph_break_count
    torch._dynamo.reset()
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else platform.processor() or 'cpu'}; torch "
          f"{torch.__version__}; PackedMamba d_model={d}, {B} x {L} tokens, {args.dtype if amp else 'fp32'}"
          f"{' autocast' if amp else ''}, fwd+bwd; compile backend {backend}; graph breaks: {breaks}", flush=True)

    variants = [("eager", fwd, None)]
    variants.append(("compile", torch.compile(fwd, backend=backend, fullgraph=True), None))
    if dev == "cuda" and backend == "inductor":
        variants.append(("compile reduce-overhead",
                         torch.compile(fwd, backend=backend, mode="reduce-overhead", fullgraph=True), None))
    rows = []
    ref = None
    for name, f, _ in variants:
        step = make_step(f)
        t0 = time.perf_counter()
        try:
            out, h = step()
            if dev == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            check = (out.detach().clone(), h.grad.detach().clone())
            ms, all_ms = timed(step, args.warmup, args.iters, dev)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {name:<26} FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            continue
        row = {"variant": name, "ms": round(ms, 4), "tokens_per_s": round(B * L / (ms / 1e3), 1),
               "first_call_s": round(first_s, 2), "all_ms": [round(t, 4) for t in all_ms]}
        if ref is None:
            ref = check
        else:
            row["rel_err_out"], row["rel_err_dh"] = rel(check[0], ref[0]), rel(check[1], ref[1])
        rows.append(row)
    base = next((r["ms"] for r in rows if r["variant"] == "eager" and "ms" in r), None)
    print(f"\n{'variant':<26} {'ms/step':>10} {'tokens/s':>12} {'vs eager':>9} {'1st call s':>11} "
          f"{'err out':>9} {'err dh':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<26} {'failed':>10}")
            continue
        r["speedup_vs_eager"] = round(base / r["ms"], 4) if base else None
        err_o = f"{r['rel_err_out']:.1e}" if "rel_err_out" in r else "-"
        err_h = f"{r['rel_err_dh']:.1e}" if "rel_err_dh" in r else "-"
        print(f"{r['variant']:<26} {r['ms']:>10.3f} {r['tokens_per_s']:>12,.0f} {r['speedup_vs_eager']:>8.3f}x "
              f"{r['first_call_s']:>11.1f} {err_o:>9} {err_h:>9}")
    result = {
        "benchmark": "bench_compile",
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"batch": B, "seqlen": L, "d_model": d, "autocast": args.dtype if amp else None,
                  "seqs_per_row": [args.min_seqs, args.max_seqs]},
        "compile_backend": backend,
        "graph_breaks": breaks,
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.out}")
    if breaks:
        print(f"graph breaks: {explained.break_reasons}")
    return result


if __name__ == "__main__":
    main()
