"""Throughput of a 4-layer Mamba-1 stack, forward + backward over packed rows.

    python benchmarks/bench_mamba_stack.py --out benchmarks/results/mamba_stack/mamba_stack_h200.json
    python benchmarks/bench_mamba_stack.py --device cpu --tiny            # smoke run, any machine

Default shapes (the issue's): d_model 2048 (Mamba 1.4B width: d_inner 4096, d_state 16, d_conv 4),
4 layers ``h = h + mixer(h)``, bf16, B=8 rows of 4096 tokens with 10-20 sequences per row.
Variants, all on the same tensors and the same weights (PackedMamba shares upstream's parameters):

- ``upstream``: mamba-ssm's ``Mamba`` (fused ``mamba_inner_fn``) WITHOUT boundaries: the target;
- ``packed fused``: ``PackedMamba`` with position_ids, fused path (the boundaries of a fresh position_ids
  tensor resolved and validated once per step at the stack's entry, as a model does; the layers do not check
  again);
- ``packed fused no-bounds``: ``PackedMamba`` without boundaries (what the boundaries cost);
- ``packed non-fused``: ``PackedMamba(use_fast_path=False)``: the composed functional ops.

Each time is the median of ``--iters`` steps after ``--warmup`` steps (CUDA events). The table gives
ms/step, tokens/s and the throughput ratio against upstream (target >= 0.97); JSON goes to --out.
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

TARGET = 0.97


def packed_positions(batch, seqlen, lo, hi, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        k = max(1, min(rng.randint(lo, hi), seqlen))
        cuts = sorted(rng.sample(range(1, seqlen), k - 1)) if k > 1 else []
        b = [0] + cuts + [seqlen]
        rows.append(torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]))
    return torch.stack(rows).long()  # int64, as the loader emits


class Stack(torch.nn.Module):
    """``h = h + layer(h)`` over the layers; boundaries resolved and validated once, at the entry."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        for layer in layers:
            if hasattr(layer, "validate_boundaries"):
                layer.validate_boundaries = False

    def forward(self, h, position_ids=None):
        import ops

        kw = {}
        if position_ids is not None:
            kw["position_ids"] = ops.resolve_position_ids(position_ids, batch=h.shape[0], seqlen=h.shape[1])
        for layer in self.layers:
            h = h + layer(h, **kw)
        return h


def timer(device):
    if device == "cuda":
        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            return statistics.median(ts), ts
    else:
        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts), ts
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test; CPU-friendly)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--min-seqs", type=int, default=10)
    ap.add_argument("--max-seqs", type=int, default=20)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.batch, args.seqlen, args.d_model = 2, 64, 32
        args.min_seqs, args.max_seqs = 2, 5
        args.warmup, args.iters = 1, 2
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if dev == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # CPU reference path: float32

    from ops import PackedMamba

    torch.manual_seed(0)
    B, L, d = args.batch, args.seqlen, args.d_model
    notes = []
    try:
        from mamba_ssm.modules.mamba_simple import Mamba as UpstreamMamba
    except Exception as e:  # noqa: BLE001
        UpstreamMamba = None
        notes.append(f"mamba_ssm not importable ({type(e).__name__}: {e}); upstream row skipped, "
                     "PackedMamba layers initialised on their own")
    if UpstreamMamba is not None:
        up_layers = [UpstreamMamba(d, layer_idx=i, device=dev, dtype=dtype) for i in range(args.layers)]
        upstream = Stack(up_layers)
        packed_layers = [PackedMamba.from_mamba(m) for m in up_layers]  # same parameters
    else:
        upstream = None
        packed_layers = [PackedMamba(d, layer_idx=i, device=dev, dtype=dtype) for i in range(args.layers)]
    packed = Stack(packed_layers)
    nonfused = Stack([PackedMamba.from_mamba(m) for m in packed_layers])
    for m in nonfused.layers:
        m.use_fast_path = False

    pos_loader = packed_positions(B, L, args.min_seqs, args.max_seqs).to(dev)
    h0 = torch.randn(B, L, d, device=dev, dtype=dtype)
    dy = torch.randn(B, L, d, device=dev, dtype=dtype) * 0.01
    params = list(packed.parameters())

    def step(model, bounded):
        def fn():
            for p in params:
                p.grad = None
            h = h0.detach().requires_grad_(True)
            kw = {}
            if bounded:
                kw["position_ids"] = pos_loader.clone()  # a fresh batch: validated once, as in training
            out = model(h, **kw)
            out.backward(dy)
        return fn

    variants = []
    if upstream is not None:
        variants.append(("upstream Mamba (no boundaries)", step(upstream, False)))
    variants.append(("packed fused", step(packed, True)))
    variants.append(("packed fused no-bounds", step(packed, False)))
    variants.append(("packed non-fused", step(nonfused, True)))

    run = timer(dev)
    backend = "cuda" if dev == "cuda" else "reference"  # the kernel ops dispatch on the device
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else platform.processor() or 'cpu'}; "
          f"B={B} L={L} d_model={d} layers={args.layers} {str(dtype).replace('torch.', '')}; ops: {backend}",
          flush=True)
    rows = []
    base_ms = None
    for name, fn in variants:
        try:
            ms, all_ms = run(fn, args.warmup, args.iters)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {name:<34} FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            continue
        if name.startswith("upstream"):
            base_ms = ms
        rows.append({"variant": name, "ms": round(ms, 4), "tokens_per_s": round(B * L / (ms / 1e3), 1),
                     "all_ms": [round(t, 4) for t in all_ms]})
    # sanity: fused and non-fused agree on the same input
    with torch.no_grad():
        pos = pos_loader
        a = packed(h0[:1, : min(L, 512)], position_ids=pos[:1, : min(L, 512)]).float()
        b = nonfused(h0[:1, : min(L, 512)], position_ids=pos[:1, : min(L, 512)]).float()
        agree = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    print(f"\n{'variant':<34} {'ms/step':>10} {'tokens/s':>14} {'vs upstream':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<34} {'failed':>10}")
            continue
        ratio = base_ms / r["ms"] if base_ms else None
        r["throughput_ratio_vs_upstream"] = round(ratio, 4) if ratio else None
        mark = "" if ratio is None or r["variant"].startswith("upstream") else (
            "  (target >= %.2f: %s)" % (TARGET, "met" if ratio >= TARGET else "NOT met"))
        print(f"{r['variant']:<34} {r['ms']:>10.3f} {r['tokens_per_s']:>14,.0f} "
              f"{(f'{ratio:.3f}x' if ratio else '-'):>12}{mark}")
    print(f"fused vs non-fused output rel. error (first 512 tokens): {agree:.2e}")
    for n in notes:
        print("note:", n)
    result = {
        "benchmark": "bench_mamba_stack",
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"batch": B, "seqlen": L, "d_model": d, "layers": args.layers, "dtype": args.dtype,
                  "seqs_per_row": [args.min_seqs, args.max_seqs]},
        "backend": backend,
        "target_throughput_ratio": TARGET,
        "rows": rows,
        "fused_vs_nonfused_rel_err": agree,
        "notes": notes,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
