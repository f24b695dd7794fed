"""`ops.PackedMamba` against mamba-ssm's `Mamba` on the small grids: prefill, evaluation, long documents, small batches.

    python3 benchmarks/bench_shapes.py --out benchmarks/results/shapes/shapes_h100.json
    python3 benchmarks/bench_shapes.py --shapes 1024:1x4096 --profile      # where the time goes, per variant
    python3 benchmarks/bench_shapes.py --device cpu --tiny                   # smoke run, any machine

For each d_model and rows x tokens (default: d_model 1024 and 2048; 1 x 4096, 2 x 4096, 1 x 16384), ``--layers``
mixers ``h = h + mixer(h)`` (default 1), bf16 parameters, the same weights (``PackedMamba.from_mamba``). Upstream
runs without boundaries (its fused ``mamba_inner_fn``); ours on the same tensors with

- ``one``: position_ids of one sequence a row (nothing to cut);
- ``nopos``: no position_ids (each row one sequence; no boundary work at all);
- ``packed``: 10-20 sequences a row per 4096 tokens, cut at random.

A fresh int64 position_ids tensor every step, resolved and validated once at the stack's entry (one host sync), as
a converted model does. Forward under ``torch.no_grad()`` (prefill, evaluation); forward + backward with the
parameters' and the input's gradients. Each time is the median over ``--rounds`` rounds of ``--iters`` steps (after
``--warmup``), every variant timed once a round (CUDA events, eager: host time included where the GPU waits for it;
at these sizes the host sets the pace and drifts, so the variants are interleaved). The table gives ours / upstream
(lower is faster; the goal is <= 1.0x everywhere). ``--profile`` adds, per variant, one profiled step: its wall
time, the time the GPU was busy (the kernels' share, free of the host), its kernels and host-side operators.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mamba_stack import Stack, packed_positions, timer  # noqa: E402

SHAPES = "1024:1x4096,1024:2x4096,1024:1x16384,2048:1x4096,2048:2x4096,2048:1x16384"
COLUMNS = [("fwd", "one"), ("fwd", "nopos"), ("fwd", "packed"), ("fwd+bwd", "one"), ("fwd+bwd", "packed")]


def parse_shapes(text):
    out = []
    for item in text.split(","):
        d, rest = item.split(":")
        b, L = rest.split("x")
        out.append((int(d), int(b), int(L)))
    return out


def rows_of(kind, batch, seqlen, device):
    if kind == "nopos":
        return None
    if kind == "one":
        return torch.arange(seqlen, device=device).expand(batch, seqlen).contiguous()
    per = max(1, seqlen // 4096)
    return packed_positions(batch, seqlen, min(10 * per, seqlen), min(20 * per, seqlen)).to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test; CPU-friendly)")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of D_MODEL:ROWSxTOKENS")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="steps timed per variant and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over all variants (interleaved)")
    ap.add_argument("--profile", action="store_true", help="one profiled step per variant: wall, GPU busy, kernels")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    dev = args.device
    if args.tiny:
        args.shapes, args.warmup, args.iters, args.rounds = "32:1x64,32:2x64", 1, 2, 2
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32

    from ops import PackedMamba

    try:
        from mamba_ssm.modules.mamba_simple import Mamba as UpstreamMamba
    except Exception as e:  # noqa: BLE001
        UpstreamMamba = None
        print(f"(mamba-ssm not importable: {type(e).__name__}: {e}; ours only)")
    run = timer(dev)
    trace_call = None
    if args.profile and dev == "cuda":
        from _trace import trace_call
    results = []
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else platform.processor() or 'cpu'}; "
          f"{args.layers} layer(s); {str(dtype).replace('torch.', '')}", flush=True)
    for d_model, batch, seqlen in parse_shapes(args.shapes):
        torch.manual_seed(0)
        if UpstreamMamba is not None:
            up_layers = [UpstreamMamba(d_model, layer_idx=i, device=dev, dtype=dtype) for i in range(args.layers)]
            upstream = Stack(up_layers)
            ours = Stack([PackedMamba.from_mamba(m) for m in up_layers])
        else:
            upstream = None
            ours = Stack([PackedMamba(d_model, layer_idx=i, device=dev, dtype=dtype) for i in range(args.layers)])
        h0 = torch.randn(batch, seqlen, d_model, device=dev, dtype=dtype)
        dy = torch.randn(batch, seqlen, d_model, device=dev, dtype=dtype) * 0.01

        def step(model, kind, mode):
            pos = rows_of(kind, batch, seqlen, dev)
            params = list(model.parameters())

            def fn():
                kw = {} if pos is None else {"position_ids": pos.clone()}   # a fresh batch: validated once
                if mode == "fwd":
                    with torch.no_grad():
                        model(h0, **kw)
                    return
                for p in params:
                    p.grad = None
                out = model(h0.detach().requires_grad_(True), **kw)
                out.backward(dy)
            return fn

        entry = {"d_model": d_model, "batch": batch, "seqlen": seqlen, "ms": {}, "ratio": {}, "profile": {}}
        variants = [(mode, "upstream", upstream) for mode in ("fwd", "fwd+bwd") if upstream is not None]
        variants += [(mode, kind, ours) for mode, kind in COLUMNS]
        fns = {f"{mode} {kind}": step(model, "nopos" if kind == "upstream" else kind, mode)
               for mode, kind, model in variants}
        # rounds: every variant timed in each round, the median over all rounds' steps (host-bound timings drift
        # with the host; interleaving gives every variant the same drift)
        samples = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                samples[name] += run(fn, args.warmup, args.iters)[1]
        for name, ts in samples.items():
            entry["ms"][name] = round(statistics.median(ts), 4)
            if trace_call is not None:
                entry["profile"][name] = trace_call(fns[name], label=name, top=6, cpu_top=12)
        for mode, kind in COLUMNS:
            base = entry["ms"].get(f"{mode} upstream")
            if base:
                entry["ratio"][f"{mode} {kind}"] = round(entry["ms"][f"{mode} {kind}"] / base, 3)
        results.append(entry)
        print(f"d_model {d_model}, {batch} x {seqlen}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry["ms"].items()),
              flush=True)
        for name, p in entry["profile"].items():
            print(f"    {name:<18} wall {p['wall_ms']:.3f} ms, GPU busy {p['gpu_busy_ms']:.3f} ms, "
                  f"{p['kernels']} kernels, {p['host_ops']} host ops: "
                  + "; ".join(f"{n[:40]} {ms:.3f}" for n, ms, _ in p["top_kernels"]))
        del h0, dy, upstream, ours
        if dev == "cuda":
            torch.cuda.empty_cache()

    head = " | ".join(f"{m}, {k}" for m, k in COLUMNS)
    print(f"\n| d_model | rows x tokens | upstream fwd / fwd+bwd ms | {head} |")
    print("| --- | --- | --- |" + " ---: |" * len(COLUMNS))
    for e in results:
        up = (f"{e['ms']['fwd upstream']:.3f} / {e['ms']['fwd+bwd upstream']:.3f}" if e["ratio"] else "-")
        cells = [(f"{e['ratio'][f'{m} {k}']:.2f}x" if e["ratio"] else f"{e['ms'][f'{m} {k}']:.3f} ms")
                 for m, k in COLUMNS]
        print(f"| {e['d_model']} | {e['batch']} x {e['seqlen']} | {up} | " + " | ".join(cells) + " |")
    worst = max((v for e in results for v in e["ratio"].values()), default=None)
    if worst is not None:
        print(f"worst ours / upstream: {worst:.2f}x (goal <= 1.0x: {'met' if worst <= 1.0 else 'NOT met'})")
    result = {"benchmark": "bench_shapes", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "python": platform.python_version(), "layers": args.layers,
              "dtype": str(dtype), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "method": f"median of {args.rounds} rounds x {args.iters} steps (after {args.warmup} a round; the variants "
                        "interleaved), CUDA events, eager; forward under "
                        "no_grad; fresh position_ids each step, validated once at the entry",
              "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
