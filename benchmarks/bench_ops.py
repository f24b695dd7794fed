"""Benchmark of the packed kernels (the torch.ops.packloader ops on CUDA tensors: ops._cuda) against upstream mamba-ssm / causal-conv1d on one GPU.

    python benchmarks/bench_ops.py --out benchmarks/results/ops/ops_h200.json

Shapes (the issue's): selective scan B=8, D=4096, L=4096, dstate 16, bf16, with z, D, delta_bias and
delta_softplus (as Mamba calls it), ~10-20 sequences per packed row; causal conv1d B=8, D=4096, L=4096, width 4,
bf16, silu.  Upstream runs WITHOUT boundaries (the plain op, the target) and, for the conv, also WITH seq_idx.
Each timing is the median of --iters runs after --warmup runs, measured with CUDA events; rows print as a table
and are written to JSON with the ratios against the targets. The conv is also timed replayed from CUDA graphs (rows
"CUDA graph"): a conv call takes 0.2-1 ms, and eager timings of it include the host wherever Python issues calls more
slowly than the GPU runs them (causal-conv1d's autograd path moved 0.36-0.55 ms between runs of the same code), so the
graph rows and the kernels' own durations (rows "kernels alone", torch.profiler) are the GPU-time comparisons.
--only conv / scan / functional times one part ("functional": the functional ops with position_ids= and boundaries=
against their kernel ops, issue 34).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def bench(fn, warmup=5, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def bench_reps(fn, reps, warmup=5, iters=20):
    """Median time of one call, timing `reps` calls issued back to back per sample."""
    return bench(lambda: [fn() for _ in range(reps)], warmup, iters) / reps


def bench_graph(fn, reps, warmup=3, iters=20):
    """Median time of one call with the host taken out: `reps` calls captured in one CUDA graph, replayed.

    Eager timings of a call this short (0.2-1 ms) include the host whenever Python issues a call more slowly than the
    GPU runs it (autograd, custom-op dispatch): they moved by 25 % between runs of the same code. A replayed graph
    times the GPU's work alone, the gaps between its kernels included."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up outside the capture (allocator, autograd, lazy init)
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return bench(graph.replay, warmup, iters) / reps


@contextlib.contextmanager
def deterministic_mode():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def packed_position_ids(batch, seqlen, lo=10, hi=20, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        k = rng.randint(lo, hi)
        cuts = sorted(rng.sample(range(1, seqlen), k - 1))
        b = [0] + cuts + [seqlen]
        rows.append(torch.cat([torch.arange(e - s) for s, e in zip(b[:-1], b[1:])]))
    pos = torch.stack(rows)
    seq_idx = torch.cumsum((pos == 0).int(), dim=1) - 1
    return pos.int().cuda(), seq_idx.int().cuda()


def time_scan(args, pos, add):
    """The selective scan: ours (kernel ops, and through packed_selective_scan's autograd) and mamba-ssm's
    selective_scan_fn. Returns (ours fwd, ours fwd+bwd, ours deterministic fwd+bwd, upstream fwd, upstream
    fwd+bwd), None where not timed."""
    Bz, D, L, N = args.batch, args.dim, args.seqlen, args.dstate
    dt, dev = torch.bfloat16, "cuda"
    kops = torch.ops.packloader  # the kernel ops (CUDA implementation on these CUDA tensors)
    u = torch.randn(Bz, D, L, device=dev, dtype=dt)
    delta = (0.5 * torch.randn(Bz, D, L, device=dev) - 4.0).to(dt)
    A = -torch.exp(0.5 * torch.randn(D, N, device=dev))
    Bm = torch.randn(Bz, N, L, device=dev, dtype=dt)
    Cm = torch.randn(Bz, N, L, device=dev, dtype=dt)
    Dp = torch.randn(D, device=dev)
    z = torch.randn(Bz, D, L, device=dev, dtype=dt)
    dbias = 0.5 * torch.randn(D, device=dev)
    dout = torch.randn(Bz, D, L, device=dev, dtype=dt)
    state = {}

    def ours_fwd():
        state["f"] = kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)

    def ours_fwdbwd():
        out, saved, _ = kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)
        kops.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout)

    ours_f = bench(ours_fwd, args.warmup, args.iters)
    add("selective_scan", "ours (packed, position_ids)", "fwd", ours_f)
    out, saved, _ = state["f"]
    ours_b = bench(lambda: kops.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout),
                   args.warmup, args.iters)
    add("selective_scan", "ours (packed, position_ids)", "bwd", ours_b)
    ours_fb = bench(ours_fwdbwd, args.warmup, args.iters)
    add("selective_scan", "ours (packed, position_ids)", "fwd+bwd", ours_fb)
    ours_det_fb = None
    if args.deterministic:
        with deterministic_mode():
            ours_det_fb = bench(ours_fwdbwd, args.warmup, args.iters)
        add("selective_scan", "ours, deterministic mode", "fwd+bwd", ours_det_fb)
    del state["f"], out, saved

    # through the ops-python helper's autograd Function, when present
    try:
        from ops.selective_scan_interface import packed_selective_scan
        leaves = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, dbias)]

        def auto_fwdbwd():
            for t in leaves:
                t.grad = None
            y = packed_selective_scan(*leaves, delta_softplus=True, position_ids=pos, validate=False)
            y.backward(dout)

        add("selective_scan", "ours via packed_selective_scan", "fwd+bwd", bench(auto_fwdbwd, args.warmup, args.iters))
        leaves.clear()
    except Exception as e:  # noqa: BLE001
        print(f"  (packed_selective_scan autograd path skipped: {type(e).__name__}: {e})")

    up_f = up_fb = None
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        import selective_scan_cuda  # noqa: F401

        with torch.no_grad():
            up_f = bench(lambda: selective_scan_fn(u, delta, A, Bm, Cm, Dp, z, dbias, True), args.warmup, args.iters)
        add("selective_scan", "mamba-ssm selective_scan_fn (no bnd)", "fwd", up_f)
        leaves = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, dbias)]

        def up_fwdbwd():
            for t in leaves:
                t.grad = None
            y = selective_scan_fn(*leaves, delta_softplus=True)
            y.backward(dout)

        up_fb = bench(up_fwdbwd, args.warmup, args.iters)
        add("selective_scan", "mamba-ssm selective_scan_fn (no bnd)", "fwd+bwd", up_fb)
        leaves.clear()
    except Exception as e:  # noqa: BLE001
        print(f"  (upstream selective_scan_fn unavailable: {type(e).__name__}: {e})")
    return ours_f, ours_fb, ours_det_fb, up_f, up_fb


def kernel_time(fn, reps=20, warmup=3):
    """GPU time of one call's kernels alone (torch.profiler: the sum of its kernels' durations, no gaps, no host), and
    the per-kernel breakdown {name: us per call}."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():   # the GPU's own events (kernels, memsets, copies), not host ops that contain them
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
    return sum(per.values()) / 1000.0, {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def gpu_rows(conv, key, label, add, args, fwd, fwdbwd):
    """The conv's GPU-time rows into conv[key] and the table: fwd and fwd+bwd replayed from CUDA graphs
    (bench_graph), and fwd+bwd's kernels alone (kernel_time, with its breakdown in the row's note). A capture that
    fails is reported, not fatal."""
    ktime, kernels = kernel_time(fwdbwd)
    add("causal_conv1d", label + ", kernels alone", "fwd+bwd", ktime, note=json.dumps(kernels))
    conv[key + ("kernels",)] = (None, ktime)
    try:
        f = bench_graph(fwd, args.graph_reps, iters=args.conv_iters)
        fb = bench_graph(fwdbwd, args.graph_reps, iters=args.conv_iters)
    except Exception as e:  # noqa: BLE001
        print(f"  ({label}: capture failed: {type(e).__name__}: {e})")
        return
    add("causal_conv1d", label + ", CUDA graph", "fwd", f)
    add("causal_conv1d", label + ", CUDA graph", "fwd+bwd", fb)
    conv[key + ("graph",)] = (f, fb)


def time_conv(args, pos, seq_idx, add):
    """The causal conv1d, channel-first and channel-last: ours (kernel ops) and causal-conv1d's
    causal_conv1d_fn, eager and replayed from CUDA graphs. Returns {(impl, layout): (fwd, fwd+bwd)}."""
    Bz, D, L = args.batch, args.dim, args.seqlen
    dt, dev = torch.bfloat16, "cuda"
    kops = torch.ops.packloader
    W = args.width
    x_cf = torch.randn(Bz, D, L, device=dev, dtype=dt)
    x_cl = x_cf.transpose(1, 2).contiguous().transpose(1, 2)
    w = 0.3 * torch.randn(D, W, device=dev)
    cb = torch.randn(D, device=dev)
    g_cf = torch.randn(Bz, D, L, device=dev, dtype=dt)
    g_cl = g_cf.transpose(1, 2).contiguous().transpose(1, 2)
    conv = {}
    for name, x, g in (("channel-first", x_cf, g_cf), ("channel-last", x_cl, g_cl)):
        f = bench_reps(lambda: kops.causal_conv1d_fwd(x, w, cb, pos, True), args.conv_reps, args.warmup, args.conv_iters)
        add("causal_conv1d", f"ours {name} (position_ids)", "fwd", f)

        def fb():   # as the autograd formula runs it: the boundary words made once for the forward and backward
            runmask = kops.conv_runmask(pos) if x.is_contiguous() else None
            kops.causal_conv1d_fwd(x, w, cb, pos, True, runmask)
            kops.causal_conv1d_bwd(x, w, cb, pos, True, g, runmask)

        fbt = bench_reps(fb, args.conv_reps, args.warmup, args.conv_iters)
        add("causal_conv1d", f"ours {name} (position_ids)", "fwd+bwd", fbt)
        conv[("ours", name)] = (f, fbt)
        gpu_rows(conv, ("ours", name), f"ours {name}", add, args, lambda: kops.causal_conv1d_fwd(x, w, cb, pos, True),
                 fb)
        if args.deterministic:
            with deterministic_mode():
                det = bench_reps(fb, args.conv_reps, args.warmup, args.conv_iters)
            add("causal_conv1d", f"ours {name}, deterministic mode", "fwd+bwd", det)
            conv[("ours_det", name)] = (None, det)
    try:
        from causal_conv1d import causal_conv1d_fn

        for name, x, g, si in (("channel-first", x_cf, g_cf, None), ("channel-last", x_cl, g_cl, None),
                               ("channel-last", x_cl, g_cl, seq_idx)):
            label = f"causal-conv1d {name} " + ("seq_idx" if si is not None else "(no bnd)")
            with torch.no_grad():
                f = bench_reps(lambda: causal_conv1d_fn(x, w, cb, seq_idx=si, activation="silu"), args.conv_reps,
                               args.warmup, args.conv_iters)
            add("causal_conv1d", label, "fwd", f)
            xl = x.detach().clone().requires_grad_(True) if si is None else \
                x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
            wl = w.detach().clone().requires_grad_(True)
            bl = cb.detach().clone().requires_grad_(True)

            def ufb():
                xl.grad = wl.grad = bl.grad = None
                y = causal_conv1d_fn(xl, wl, bl, seq_idx=si, activation="silu")
                y.backward(g)

            fbt = bench_reps(ufb, args.conv_reps, args.warmup, args.conv_iters)
            add("causal_conv1d", label, "fwd+bwd", fbt)
            conv[("up" + ("_seq" if si is not None else ""), name)] = (f, fbt)

            def ufwd():
                with torch.no_grad():
                    causal_conv1d_fn(x, w, cb, seq_idx=si, activation="silu")

            gpu_rows(conv, ("up" + ("_seq" if si is not None else ""), name), label, add, args, ufwd, ufb)
    except Exception as e:  # noqa: BLE001
        print(f"  (upstream causal_conv1d_fn unavailable: {type(e).__name__}: {e})")

    return conv


def time_functional(args, pos, add):
    """The functional API's cost over its kernels (issue 34), forward + backward eagerly, ``--conv-reps`` calls back to
    back per sample: the kernel ops alone (boundary words made once per call pair, as the autograd formula does), the
    functional op with ``position_ids`` (converted and checked on every call) and with ``boundaries=`` (an
    :class:`ops.PackedBoundaries` made once, as a model makes it once per batch). Returns {(op, how): ms}."""
    import ops
    Bz, D, L, N, W = args.batch, args.dim, args.seqlen, args.dstate, args.width
    dt, dev = torch.bfloat16, pos.device   # (a CPU pos: the reference kernels, for the tests' smoke run)
    kops = torch.ops.packloader
    bounds = ops.PackedBoundaries.resolve(position_ids=pos, device=dev)
    got = {}
    # conv
    x = torch.randn(Bz, D, L, device=dev, dtype=dt)
    w, cb = 0.3 * torch.randn(D, W, device=dev), torch.randn(D, device=dev)
    g = torch.randn(Bz, D, L, device=dev, dtype=dt)

    def conv_kernels():
        runmask = kops.conv_runmask(pos)
        kops.causal_conv1d_fwd(x, w, cb, pos, True, runmask)
        kops.causal_conv1d_bwd(x, w, cb, pos, True, g, runmask)

    xl, wl, bl = (t.detach().clone().requires_grad_(True) for t in (x, w, cb))

    def conv_functional(**kw):
        def run():
            xl.grad = wl.grad = bl.grad = None
            ops.packed_causal_conv1d(xl, wl, bl, "silu", **kw).backward(g)
        return run

    # scan
    u = torch.randn(Bz, D, L, device=dev, dtype=dt)
    delta = (0.5 * torch.randn(Bz, D, L, device=dev) - 4.0).to(dt)
    A = -torch.exp(0.5 * torch.randn(D, N, device=dev))
    Bm, Cm = torch.randn(Bz, N, L, device=dev, dtype=dt), torch.randn(Bz, N, L, device=dev, dtype=dt)
    Dp, z, dbias = torch.randn(D, device=dev), torch.randn(Bz, D, L, device=dev, dtype=dt), 0.5 * torch.randn(D, device=dev)
    dout = torch.randn(Bz, D, L, device=dev, dtype=dt)

    def scan_kernels():
        _, saved, _ = kops.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)
        kops.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout)

    leaves = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, dbias)]

    def scan_functional(**kw):
        def run():
            for t in leaves:
                t.grad = None
            ops.packed_selective_scan(*leaves, delta_softplus=True, **kw).backward(dout)
        return run

    for op, kern, func, reps in (("causal_conv1d", conv_kernels, conv_functional, args.conv_reps),
                                 ("selective_scan", scan_kernels, scan_functional, 1)):
        iters = args.conv_iters if op == "causal_conv1d" else args.iters
        base = bench_reps(kern, reps, args.warmup, iters)
        add(op, "functional API: kernel ops alone", "fwd+bwd", base)
        got[(op, "kernels")] = base
        for how, kw in (("position_ids", {"position_ids": pos}), ("boundaries", {"boundaries": bounds})):
            t = bench_reps(func(**kw), reps, args.warmup, iters)
            add(op, f"functional API: {how}=", "fwd+bwd", t, note=f"{t / base:.3f}x the kernels")
            got[(op, how)] = t
    return got


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--dstate", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--conv-iters", type=int, default=100, help="conv calls are ~0.2-1 ms: more runs per median")
    ap.add_argument("--conv-reps", type=int, default=10,
                    help="conv calls per timed sample, back to back (the GPU never waits for Python, as in "
                         "training); the sample is divided by this")
    ap.add_argument("--graph-reps", type=int, default=10,
                    help="conv calls captured per CUDA graph (the graph rows: GPU time without the host)")
    ap.add_argument("--only", choices=("all", "scan", "conv", "functional"), default="all", help="time only these ops")
    ap.add_argument("--out", default=None)
    ap.add_argument("--deterministic", action="store_true",
                    help="also time ours under torch.use_deterministic_algorithms(True) (the scan adds dB/dC in a "
                         "fixed block order), in the same run as the default mode")
    args = ap.parse_args(argv)

    import ops  # noqa: F401  (registers torch.ops.packloader.*)
    from ops import _cuda

    Bz, L = args.batch, args.seqlen
    torch.manual_seed(0)
    pos, seq_idx = packed_position_ids(Bz, L)
    rows = []

    def add(op, impl, phase, ms, note=""):
        rows.append({"op": op, "impl": impl, "phase": phase, "ms": round(ms, 4), "note": note})
        print(f"  {op:<15} {impl:<34} {phase:<8} {ms:9.3f} ms {note}", flush=True)

    t0 = time.time()
    _cuda.load()
    print(f"ops._cuda loaded in {time.time() - t0:.1f} s", flush=True)
    ours_f = ours_fb = ours_det_fb = up_f = up_fb = None
    functional = {}
    if args.only in ("all", "functional"):
        functional = time_functional(args, pos, add)
        torch.cuda.empty_cache()
    if args.only in ("all", "scan"):
        ours_f, ours_fb, ours_det_fb, up_f, up_fb = time_scan(args, pos, add)
    torch.cuda.empty_cache()
    conv = time_conv(args, pos, seq_idx, add) if args.only in ("all", "conv") else {}

    summary = {}
    if up_fb:
        summary["scan_fwdbwd_ratio_vs_upstream"] = round(ours_fb / up_fb, 3)
        summary["scan_fwd_ratio_vs_upstream"] = round(ours_f / up_f, 3)
        summary["scan_target"] = "fwd+bwd <= 1.0x (stretch 0.8x)"
    if ours_det_fb:
        summary["scan_fwdbwd_deterministic_over_default"] = round(ours_det_fb / ours_fb, 3)
    for name in ("channel-first", "channel-last"):
        if ("ours_det", name) in conv and ("ours", name) in conv:
            summary[f"conv_{name}_fwdbwd_deterministic_over_default"] = round(
                conv[("ours_det", name)][1] / conv[("ours", name)][1], 3)
    if args.deterministic:
        summary["deterministic_target"] = "<= 1.10x the default mode's fwd+bwd"
    if ("up", "channel-first") in conv:
        summary["conv_fwdbwd_ratio_cf_vs_upstream_cf"] = round(conv[("ours", "channel-first")][1] / conv[("up", "channel-first")][1], 3)
        summary["conv_fwd_ratio_cf_vs_upstream_cf"] = round(conv[("ours", "channel-first")][0] / conv[("up", "channel-first")][0], 3)
    if ("up", "channel-last") in conv:
        summary["conv_fwdbwd_ratio_cl_vs_upstream_cl"] = round(conv[("ours", "channel-last")][1] / conv[("up", "channel-last")][1], 3)
        summary["conv_fwd_ratio_cl_vs_upstream_cl"] = round(conv[("ours", "channel-last")][0] / conv[("up", "channel-last")][0], 3)
        summary["conv_target"] = "fwd+bwd <= 1.1x causal-conv1d without seq_idx"
    for name, short in (("channel-first", "cf"), ("channel-last", "cl")):
        for how in ("graph", "kernels"):
            ours, up = conv.get(("ours", name, how)), conv.get(("up", name, how))
            if ours and up:
                summary[f"conv_{how}_fwdbwd_ratio_{short}_vs_upstream_{short}"] = round(ours[1] / up[1], 3)
                if how == "graph":
                    summary[f"conv_graph_fwd_ratio_{short}_vs_upstream_{short}"] = round(ours[0] / up[0], 3)
    for op in ("causal_conv1d", "selective_scan"):
        for how in ("position_ids", "boundaries"):
            if (op, how) in functional:
                summary[f"functional_{op}_{how}_over_kernels"] = round(functional[(op, how)] / functional[(op, "kernels")], 3)
    if functional:
        summary["functional_target"] = "boundaries= <= 1.0x the kernels; position_ids= <= 1.1x"
    print("\nsummary:", json.dumps(summary, indent=1))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "shapes": {"batch": Bz, "dim": args.dim, "seqlen": L, "dstate": args.dstate, "width": args.width, "dtype": "bf16",
                   "sequences_per_row": [int((pos[b] == 0).sum()) for b in range(Bz)]},
        "method": f"median of {args.iters} runs (conv: {args.conv_iters} samples of {args.conv_reps} calls issued "
                  f"back to back, divided by {args.conv_reps}) after warm-up runs, CUDA events; conv rows 'CUDA graph': "
                  f"{args.conv_iters} replays of a graph of {args.graph_reps} calls, divided by {args.graph_reps}; "
                  "'kernels alone': the sum of the kernels' durations under torch.profiler, 20 calls",
        "rows": rows, "summary": summary,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
