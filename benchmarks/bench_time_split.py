"""The scan on rows of one sequence on small grids: cut along time (``ops/time_split.py``) against uncut.

For each shape (batch x dim x seqlen, bf16, dstate 16, with z, D, delta_bias, softplus; every row one sequence)
times the scan ops' CUDA implementation (``ops.selective_scan_interface._scan_fwd_cuda`` / ``_scan_bwd_cuda``, no
dispatch) with the cut the plan makes and with it switched off, and mamba-ssm's ``selective_scan_fn`` (when
installed) on the same tensors. ``fwd``: the forward; ``bwd``: the backward alone (from the forward's saved states);
``fwd+bwd`` for upstream (its backward cannot run alone). Two timings of each: eager (CUDA events around one call:
host time included where the call is host-bound) and replayed from a CUDA graph (the GPU's work alone).

    python3 benchmarks/bench_time_split.py --out benchmarks/results/scan_segments/time_split_h100.json

``--reductions``: instead, the segment reductions alone (``time_split.segment_sums``, the CUDA kernel of
``ops/csrc/segment_sums.cu``; one segment a row over the whole row, both directions), replayed from CUDA graphs,
against the floor their exponentials set (16 a multiprocessor and clock at the GPU's maximum SM clock).

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import bench, bench_graph  # noqa: E402
from bench_scan_segments import scan_inputs  # noqa: E402

SHAPES = "1x1536x4096,1x2048x4096,1x2048x16384,2x2048x4096,1x4096x4096,1x4096x16384,2x4096x4096,1x5120x8192"


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="comma list of BATCHxDIMxSEQLEN")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="calls per graph replay")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reductions", action="store_true", help="time the segment reductions alone (see above)")
    args = ap.parse_args(argv)
    if args.reductions:
        return reductions(args, argv)

    import ops
    from ops import selective_scan_interface as ssi, time_split

    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as e:  # noqa: BLE001
        selective_scan_fn = None
        print(f"(mamba-ssm unavailable: {type(e).__name__}: {e})")
    plan = time_split.split_plan
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    dt, N = torch.bfloat16, 16
    results = []
    head = f"{'shape':<14} {'pieces f/b':>10} | {'fwd cut':>8} {'uncut':>8} {'up':>8} | {'bwd cut':>8} {'uncut':>8} | " \
           f"{'f+b cut':>8} {'uncut':>8} {'up':>8} | graphs: {'fwd cut':>8} {'uncut':>8} {'up':>8}"
    print(head)
    for shape in args.shapes.split(","):
        Bz, D, L = (int(v) for v in shape.split("x"))
        u, delta, A, Bm, Cm, Dp, z, dbias, dout = scan_inputs(Bz, D, L, N, dt)
        pos = ops.boundaries.shared_row_positions(Bz, L, u.device)
        entry = {"shape": [Bz, D, L], "pieces": {"fwd": plan("fwd", Bz, D, L, sm), "bwd": plan("bwd", Bz, D, L, sm)},
                 "ms": {}, "graph_ms": {}}

        def fwd():
            return ssi._scan_fwd_cuda(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True)

        def fb():
            out, saved, _ = fwd()
            return ssi._scan_bwd_cuda(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout, True)

        for mode in ("cut", "uncut"):
            time_split.split_plan = plan if mode == "cut" else (lambda *a: None)
            try:
                _, saved, _ = fwd()
                entry["ms"][f"fwd {mode}"] = bench(fwd, args.warmup, args.iters)
                entry["ms"][f"bwd {mode}"] = bench(
                    lambda: ssi._scan_bwd_cuda(u, delta, A, Bm, Cm, Dp, z, dbias, pos, True, saved, dout, True),
                    args.warmup, args.iters)
                entry["ms"][f"fwd+bwd {mode}"] = bench(fb, args.warmup, args.iters)
                entry["graph_ms"][f"fwd {mode}"] = bench_graph(fwd, args.reps)
                entry["graph_ms"][f"fwd+bwd {mode}"] = bench_graph(fb, args.reps)
            finally:
                time_split.split_plan = plan
        if selective_scan_fn is not None:
            B3, C3 = Bm[:, 0].contiguous(), Cm[:, 0].contiguous()
            uq = u.detach().clone().requires_grad_(True)

            def up_f():
                return selective_scan_fn(u, delta, A, B3, C3, Dp, z, dbias, True)

            def up_fb():
                selective_scan_fn(uq, delta, A, B3, C3, Dp, z, dbias, True).backward(dout)

            entry["ms"]["fwd upstream"] = bench(up_f, args.warmup, args.iters)
            entry["ms"]["fwd+bwd upstream"] = bench(up_fb, args.warmup, args.iters)
            entry["graph_ms"]["fwd upstream"] = bench_graph(up_f, args.reps)
        for d in (entry["ms"], entry["graph_ms"]):
            for k in d:
                d[k] = round(d[k], 4)
        ms, g = entry["ms"], entry["graph_ms"]
        f = lambda d, k: f"{d[k]:8.3f}" if k in d else f"{'-':>8}"  # noqa: E731
        pc = "/".join(str(p[0]) if p else "1" for p in (entry["pieces"]["fwd"], entry["pieces"]["bwd"]))
        print(f"{shape:<14} {pc:>10} | {f(ms, 'fwd cut')} {f(ms, 'fwd uncut')} {f(ms, 'fwd upstream')} | "
              f"{f(ms, 'bwd cut')} {f(ms, 'bwd uncut')} | {f(ms, 'fwd+bwd cut')} {f(ms, 'fwd+bwd uncut')} "
              f"{f(ms, 'fwd+bwd upstream')} | graphs: {f(g, 'fwd cut')} {f(g, 'fwd uncut')} {f(g, 'fwd upstream')}",
              flush=True)
        results.append(entry)
    doc = {"benchmark": "bench_time_split", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "python": platform.python_version(), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _commit(), "command": " ".join(["python3", "benchmarks/bench_time_split.py"] + (argv or sys.argv[1:])),
           "dtype": "bf16", "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print("wrote", args.out)


REDUCTION_SHAPES = "1x4096x4096,2x4096x4096,1x2048x16384,1x1536x4096"


def reductions(args, argv):
    from ops import time_split
    shapes = args.shapes if args.shapes != SHAPES else REDUCTION_SHAPES
    props = torch.cuda.get_device_properties(0)
    sm = props.multi_processor_count
    try:   # the maximum SM clock (MHz)
        clock_ghz = float(subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=30).stdout.split()[0]) / 1e3
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        clock_ghz = 1.98   # an H100 SXM's
    dt, N = torch.bfloat16, 16
    results = []
    print(f"{'shape':<14} {'direction':>9} | {'ms':>8} {'floor ms':>8} | / floor")
    for shape in shapes.split(","):
        Bz, D, L = (int(v) for v in shape.split("x"))
        u, delta, A, Bm, Cm, Dp, z, dbias, dout = scan_inputs(Bz, D, L, N, dt)
        start = torch.arange(Bz, device=u.device, dtype=torch.int64) * L
        length = torch.full((Bz,), L, device=u.device, dtype=torch.int64)
        floor_ms = Bz * D * L * N / (16 * sm * clock_ghz * 1e9) * 1e3
        for forward in (True, False):
            x, zz, bc = (u, None, Bm) if forward else (dout, z, Cm)
            ms = bench_graph(lambda: time_split.segment_sums(forward, delta, dbias, A, x, zz, bc, True, start,
                                                             length, L), args.reps)
            name = "forward" if forward else "backward"
            results.append({"shape": [Bz, D, L], "direction": name, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4)})
            print(f"{shape:<14} {name:>9} | {ms:8.3f} {floor_ms:8.3f} | {ms / floor_ms:7.2f}", flush=True)
    doc = {"benchmark": "bench_time_split --reductions", "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "sm_clock_ghz": clock_ghz,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code_commit": _commit(),
           "command": " ".join(["python3", "benchmarks/bench_time_split.py"] + (argv or sys.argv[1:])),
           "method": "graph replay (bench_ops.bench_graph), bf16 inputs, dstate 16, delta_bias, softplus, one segment a "
                     "row; floor: B*D*L*16 exponentials at 16 a multiprocessor and clock", "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print("wrote", args.out)
    return doc


if __name__ == "__main__":
    main()
