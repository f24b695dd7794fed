"""The decode step kernels of ``ops.decode`` alone, over their launch choices, against upstream's (issue 33, part 1).

    python benchmarks/bench_decode_kernels.py                     # GPU; upstream's kernels where they import
    python benchmarks/bench_decode_kernels.py --shapes 64x1536x48,16x5120x160

For each (batch, d_inner, dt_rank) shape (bf16 activations and ``ssm_state`` as mamba-ssm allocates them, d_state
16, conv width 4), the microseconds of one call, replayed from a CUDA graph of ``--calls`` back-to-back calls (what
``generate(cg=True)`` runs; median of ``--repeats`` replays):

- ``selective_state_step`` with the launch ``ops.decode`` picks (``chosen``), every candidate launch (dt projection
  fused into the kernel or one matmul before it, loads before the projection or after, 16 or 64 channels a program,
  2 or 4 warps) and the fastest of them (``best``); against mamba-ssm's ``F.linear`` (dt_proj) + Triton
  ``selective_state_update``, the pair its ``Mamba.step`` runs;
- ``causal_conv1d_step`` the same way (channels a program x warps) against causal-conv1d's ``causal_conv1d_update``.

Table on stdout, JSON to ``--out`` (default ``benchmarks/results/generation/decode_kernels_<gpu>.json``). The
launch rules in ``ops/decode.py`` (``_state_launch``, ``_conv_launch``) come from this table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ops import decode as dec  # noqa: E402

SHAPES = "1x1536x48,16x1536x48,64x1536x48,32x2048x64,16x3072x96,16x4096x128,1x5120x160,16x5120x160,64x5120x160"
D_STATE, WIDTH = 16, 4


def graph_us(fn, calls: int, repeats: int) -> float:
    """Median microseconds of one call of ``fn``, replayed from a CUDA graph of ``calls`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def upstream_kernels():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except ImportError:
        selective_state_update = None
    try:
        from causal_conv1d import causal_conv1d_update
    except ImportError:
        causal_conv1d_update = None
    return selective_state_update, causal_conv1d_update


def measure(batch: int, dim: int, rank: int, args, device) -> dict:
    selective_state_update, causal_conv1d_update = upstream_kernels()
    bf = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    state0 = (0.1 * torch.randn(batch, dim, D_STATE, device=device, generator=g)).to(bf)
    xz = torch.randn(batch, 2 * dim, device=device, dtype=bf, generator=g)      # in_proj's output: x, z are views
    x, z = xz[:, :dim], xz[:, dim:]
    x_dbl = torch.randn(batch, rank + 2 * D_STATE, device=device, dtype=bf, generator=g)   # x_proj's output
    dt, B, C = torch.split(x_dbl, [rank, D_STATE, D_STATE], dim=-1)
    W = torch.randn(dim, rank, device=device, dtype=bf, generator=g) * rank ** -0.5
    dt_bias = torch.randn(dim, device=device, dtype=bf, generator=g)
    A_log = torch.randn(dim, D_STATE, device=device, generator=g)
    D = torch.randn(dim, device=device, generator=g)
    out = torch.empty(batch, dim, device=device, dtype=bf)
    state = state0.clone()
    ref_state = state0.float()
    ref = dec.selective_state_step_ref(ref_state, x.float(), dt.float(), A_log, B.float(), C.float(), D, z.float(),
                                       dt_bias.float(), W.float(), True)
    step_args = (dt, A_log, B, C, D, z, dt_bias, W, True)
    row = {"batch": batch, "dim": dim, "rank": rank, "chosen": dec._state_launch(batch, dim, rank)._asdict()}

    def state_call(launch=None):
        return lambda: dec._state_step_triton(state, x, *step_args, out, launch=launch)

    # every launch first checked against the float32 reference on the same inputs
    worst = 0.0
    candidates = {}
    for fuse, first, block_d, warps in itertools.product((True, False), (True, False), (16, 64), (2, 4)):
        launch = dec.StateLaunch(fuse, first, block_d, warps)
        state.copy_(state0)
        y = state_call(launch)()
        worst = max(worst, ((y.float() - ref).abs() / (1 + ref.abs())).max().item(),
                    ((state.float() - ref_state).abs() / (1 + ref_state.abs())).max().item())
        name = f"{'fused' if fuse else 'matmul'}, {'loads first' if first else 'loads after'}, d{block_d} w{warps}"
        candidates[name] = graph_us(state_call(launch), args.calls, args.repeats)
    row["state_max_rel_error_bf16"] = worst
    row["state_us"] = {"chosen": graph_us(state_call(), args.calls, args.repeats), **candidates}
    row["state_best"] = min(candidates, key=candidates.get)
    if selective_state_update is not None:
        A = -torch.exp(A_log)
        row["state_us"]["upstream"] = graph_us(
            lambda: selective_state_update(state, x, F.linear(dt, W), A, B, C, D=D, z=z, dt_bias=dt_bias,
                                           dt_softplus=True), args.calls, args.repeats)

    conv_state = torch.randn(batch, dim, WIDTH, device=device, dtype=bf, generator=g)
    conv_w = torch.randn(dim, WIDTH, device=device, dtype=bf, generator=g)
    conv_b = torch.randn(dim, device=device, dtype=bf, generator=g)
    conv = {"chosen": graph_us(lambda: dec._conv_step_triton(x, conv_state, conv_w, conv_b, True, out),
                               args.calls, args.repeats)}
    for block, warps in itertools.product((32, 64, 128, 256), (2, 4)):
        conv[f"d{block} w{warps}"] = graph_us(
            lambda block=block, warps=warps: dec._conv_step_triton(x, conv_state, conv_w, conv_b, True, out,
                                                                   launch=(block, warps)), args.calls, args.repeats)
    row["conv_best"] = min((k for k in conv if k != "chosen"), key=conv.get)
    if causal_conv1d_update is not None:
        xc = x.contiguous()
        conv["upstream"] = graph_us(lambda: causal_conv1d_update(xc, conv_state, conv_w, conv_b, "silu"),
                                    args.calls, args.repeats)
    row["conv_us"] = conv
    row["conv_chosen"] = list(dec._conv_launch(batch, dim))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="batch x d_inner x dt_rank, comma-separated")
    ap.add_argument("--calls", type=int, default=100, help="calls per CUDA graph")
    ap.add_argument("--repeats", type=int, default=15, help="graph replays timed (median)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_kernels: needs a CUDA GPU (the kernels are Triton's)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    rows = []
    print(f"# decode step kernels, {gpu}: us a call from CUDA graphs (ours: the launch ops.decode picks)")
    print("| batch x d_inner x rank | state step: ours | best launch | upstream | ours / upstream "
          "| conv step: ours | best | upstream | ours / upstream |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for spec in args.shapes.split(","):
        batch, dim, rank = (int(v) for v in spec.split("x"))
        r = measure(batch, dim, rank, args, device)
        rows.append(r)
        s, c = r["state_us"], r["conv_us"]
        up_s, up_c = s.get("upstream"), c.get("upstream")
        print(f"| {batch} x {dim} x {rank} | {s['chosen']:.2f} | {r['state_best']}: {s[r['state_best']]:.2f} | "
              f"{up_s or float('nan'):.2f} | {s['chosen'] / up_s if up_s else float('nan'):.2f}x | "
              f"{c['chosen']:.2f} | {r['conv_best']}: {c[r['conv_best']]:.2f} | {up_c or float('nan'):.2f} | "
              f"{c['chosen'] / up_c if up_c else float('nan'):.2f}x |", flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generation",
                                   f"decode_kernels_{gpu.split()[1].lower() if len(gpu.split()) > 1 else 'gpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"benchmark": "bench_decode_kernels", "device": gpu, "commit": commit,
                   "torch": torch.__version__, "settings": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
