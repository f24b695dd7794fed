"""Context parallelism on the GPUs of one node: exactness, scaling and reach (``ops.context_parallel``).

One launch covers 1, 2 and 4 GPUs (sub-groups of the world)::

    torchrun --nproc_per_node 4 benchmarks/bench_context_parallel.py --out benchmarks/results/context_parallel

Parts (``--parts``, default all):

- ``exact``: a smaller stack (fp32 and bf16) on one row of packed sequences (one crossing every cut): the chunks'
  outputs, the input gradients and every weight gradient against one GPU's run of the whole row; in bf16 next to one
  GPU's own bf16 error (both against the fp32 run).
- ``scaling``: a residual stack of ``PackedMamba`` layers with RMS norms (``--layers``, ``--d-model``; 48 x 2048 is
  the 1.4B width) on one sequence of ``N x L`` tokens over ``N`` GPUs, forward + backward (bf16 autocast, fp32
  weights): tokens/s per GPU against one GPU at ``L`` tokens with the plain (non-CP) packed model.
- ``reach``: the longest sequence that trains (forward + backward) on 1 and on 4 GPUs (2 on a 2-GPU machine) at the
  same width: peak memory measured at two lengths, the longest length predicted from it, then run to confirm (and
  stepped down until it does).

Writes ``context_parallel.json`` into ``--out`` and prints the tables. Needs ``N`` GPUs for the ``N``-GPU rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ops  # noqa: E402


class RMSNorm(torch.nn.Module):
    def __init__(self, d, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d, device=device))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)


class Stack(torch.nn.Module):
    """Pre-norm residual Mamba-1 blocks (what MambaLMHeadModel's backbone is, without the embedding and head)."""

    def __init__(self, d_model, layers, device):
        super().__init__()
        self.norms = torch.nn.ModuleList(RMSNorm(d_model, device=device) for _ in range(layers))
        self.mixers = torch.nn.ModuleList(ops.PackedMamba(d_model, layer_idx=i, device=device) for i in range(layers))

    def forward(self, h, position_ids):
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), position_ids=position_ids)
        return h


def _model(args, d_model, layers, seed=0):
    torch.manual_seed(seed)
    return Stack(d_model, layers, "cuda")


def _set_cp(model, group, recompute=False):
    """Context-parallel over ``group`` (None: the plain packed model), as ops.context_parallel sets it."""
    for m in model.mixers:
        if group is None:
            m.__dict__.pop("_packloader_cp_group", None)
        else:
            m._packloader_cp_group = group
            m._packloader_cp_recompute = recompute


def _step(model, h, pos, dtype, total=None):
    """Forward + backward of a mean-square loss normalised by ``total`` elements (the whole row's, not the chunk's:
    summed over the ranks it is the unsplit row's loss)."""
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = model(h, pos)
    (out.float().pow(2).sum() / (total or out.numel())).backward()
    return out


def _chunk(t, rank, world, dim=1):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


# ---------------------------------------------------------------------------------------------------------------
def part_exact(args, rank, world, groups):
    """fp32 / bf16 on 2 and 4 GPUs against one GPU's whole row."""
    rows = []
    d_model, layers, L = args.exact_d_model, args.exact_layers, args.exact_length
    lengths = [L // 2 + 5, 1, 2, L // 4 - 10, L - (L // 2 + 5) - 3 - (L // 4 - 10)]
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    torch.manual_seed(1)
    h = torch.randn(1, L, d_model, device="cuda")

    def run(model, hh, pp, dtype):
        hh = hh.clone().requires_grad_(True)
        out = _step(model, hh, pp, dtype, total=h.numel())
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out.detach().float(), hh.grad.float(), grads

    model = _model(args, d_model, layers, seed=3)
    ref = {dt: run(model, h, pos, dt) for dt in (torch.float32, torch.bfloat16)}
    for n in (2, 4):
        if n > world:
            continue
        if rank < n:
            _set_cp(model, groups[n])
            for dt in (torch.float32, torch.bfloat16):
                out, dh, grads = run(model, _chunk(h, rank, n), _chunk(pos, rank, n), dt)
                for p in grads.values():
                    dist.all_reduce(p, group=groups[n])
                want_out, want_dh, want_g = ref[torch.float32]
                own_out, own_dh, own_g = ref[dt]

                def rel(a, b):
                    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                err = {"out": rel(out, _chunk(want_out, rank, n)), "dinput": rel(dh, _chunk(want_dh, rank, n)),
                       "dweights": max(rel(grads[k], want_g[k]) for k in grads)}
                own = {"out": rel(_chunk(own_out, rank, n), _chunk(want_out, rank, n)),
                       "dinput": rel(_chunk(own_dh, rank, n), _chunk(want_dh, rank, n)),
                       "dweights": max(rel(own_g[k], want_g[k]) for k in own_g)}
                t = torch.tensor([err["out"], err["dinput"], err["dweights"]], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups[n])
                err = dict(zip(err, t.tolist()))
                rows.append({"gpus": n, "dtype": str(dt).split(".")[-1], "cp_vs_one_gpu_fp32": err,
                             "one_gpu_vs_one_gpu_fp32": own})
            _set_cp(model, None)
        dist.barrier()
    return {"d_model": d_model, "layers": layers, "length": L, "sequence_lengths": lengths, "rows": rows}


def _timed(model, h, pos, iters, warmup):
    for _ in range(warmup):
        _step(model, h, pos, torch.bfloat16)
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        _step(model, h, pos, torch.bfloat16)
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, torch.cuda.max_memory_allocated() / 2**30


def _profile(model, h, pos):
    """The CUDA kernels of one context-parallel step on one GPU against the plain model's (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile
    for label, group in (("plain", None), ("context-parallel over 1", model.mixers[0].__dict__.get("_packloader_cp_group"))):
        _set_cp(model, group)
        _step(model, h, pos, torch.bfloat16)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _step(model, h, pos, torch.bfloat16)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(f"--- {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def _trace_step(args, model, h, pos, label, n, rank, group):
    """One step profiled on every rank of ``group`` (Chrome traces into --trace-dir); the ranks' summaries, gathered."""
    from _trace import trace_call

    dist.barrier(group=group)
    slug = "plain" if label.startswith("one GPU") else f"cp{n}"
    path = os.path.join(args.trace_dir, f"{slug}_rank{rank}.json.gz")

    def step():
        _step(model, h, pos, torch.bfloat16)
        model.zero_grad(set_to_none=True)

    summary = trace_call(step, path, label)
    summary["rank"] = rank
    got = [None] * n
    dist.all_gather_object(got, summary, group=group)
    if rank == 0:
        for s in got:
            print(f"  trace {label}, rank {s['rank']}: " + ", ".join(f"{k} {v}" for k, v in s.items()
                                                                    if k not in ("label", "rank")), flush=True)
    return got


def part_scaling(args, rank, world, groups):
    rows, traces = [], []
    model = _model(args, args.d_model, args.layers)
    L = args.length_per_gpu
    for n in (1, 2, 4):
        if n > world:
            continue
        if rank < n:
            torch.manual_seed(2)
            h = torch.randn(1, n * L, args.d_model, device="cuda")
            pos = torch.arange(n * L, device="cuda")[None]
            if n == 1:   # the plain packed model on one GPU: the baseline
                _set_cp(model, None)
                sec, mem = _timed(model, h, pos, args.iters, args.warmup)
                rows.append({"gpus": 1, "mode": "one GPU (no CP)", "tokens": L, "step_s": sec, "peak_gib": mem,
                             "tokens_per_s_per_gpu": L / sec})
                if args.trace_dir:
                    traces.append(_trace_step(args, model, h, pos, "one GPU (no CP)", 1, rank, groups[1]))
            if args.profile and n == 1:
                _set_cp(model, groups[n])
                _profile(model, h, pos)
            for recompute in (False, True) if args.scaling_recompute else (False,):
                _set_cp(model, groups[n], recompute)
                sec, mem = _timed(model, _chunk(h, rank, n).contiguous(), _chunk(pos, rank, n).contiguous(),
                                  args.iters, args.warmup)
                t = torch.tensor([sec, mem], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups[n])
                sec, mem = t.tolist()
                rows.append({"gpus": n, "mode": f"context-parallel over {n}" + (", recompute" if recompute else ""),
                             "tokens": n * L, "step_s": sec, "peak_gib": mem, "tokens_per_s_per_gpu": L / sec})
                if rank == 0:   # (as it goes: a run cut short keeps what it measured)
                    print(f"  {rows[-1]['mode']}: {sec:.4f} s a step, against one GPU {rows[0]['step_s'] / sec:.3f}",
                          flush=True)
                if args.trace_dir and not recompute:
                    traces.append(_trace_step(args, model, _chunk(h, rank, n).contiguous(),
                                              _chunk(pos, rank, n).contiguous(), f"context-parallel over {n}", n,
                                              rank, groups[n]))
            _set_cp(model, None)
            del h
            torch.cuda.empty_cache()
        dist.barrier()
    base = rows[0]["tokens_per_s_per_gpu"] if rows else None
    for r in rows:
        r["per_gpu_vs_one_gpu"] = r["tokens_per_s_per_gpu"] / base if base else None
    return {"d_model": args.d_model, "layers": args.layers, "length_per_gpu": L, "rows": rows,
            **({"traces": traces} if traces else {})}


def _peak(model, n, rank, group, total):
    """Peak GiB of one forward + backward of a ``total``-token sequence over ``n`` GPUs (None: out of memory)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ok = torch.ones(1, device="cuda")
    try:
        h = torch.randn(1, total // n, model.norms[0].weight.shape[0], device="cuda")
        pos = (torch.arange(total // n, device="cuda") + rank * (total // n))[None]
        _step(model, h, pos, torch.bfloat16)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        ok.zero_()
        model.zero_grad(set_to_none=True)
    h = pos = None
    if n > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.empty_cache()
    return peak if bool(ok.item()) else None


def part_reach(args, rank, world, groups):
    rows = []
    model = _model(args, args.d_model, args.layers)
    cap = torch.cuda.get_device_properties(0).total_memory / 2**30
    top = 4 if world >= 4 else 2   # the most GPUs measured: 4, or 2 where the machine has 2 or 3
    configs = [(1, "one GPU (no CP)", None, False), (1, "CP over 1, recompute", 1, True),
               (top, f"CP over {top}", top, False), (top, f"CP over {top}, recompute", top, True)]
    for n, label, cp, recompute in configs:
        if n > world:
            continue
        if rank < n:
            _set_cp(model, groups[cp] if cp else None, recompute)
            step = 1024 * n
            a, b = args.reach_probe * n, 2 * args.reach_probe * n
            pa, pb = _peak(model, n, rank, groups[n], a), _peak(model, n, rank, groups[n], b)
            per_token = (pb - pa) / (b - a)
            fixed = pa - per_token * a
            guess = int((cap * args.reach_fraction - fixed) / per_token) // step * step
            got, tried = None, []
            while guess > b and got is None:
                peak = _peak(model, n, rank, groups[n], guess)
                tried.append({"tokens": guess, "peak_gib": peak})
                if peak is not None:
                    got = guess
                else:
                    guess = int(guess * 0.95) // step * step
            rows.append({"gpus": n, "mode": label, "probe_peaks_gib": [pa, pb], "gib_per_1k_tokens": per_token * 1024,
                         "predicted_tokens": int((cap * args.reach_fraction - fixed) / per_token), "tried": tried,
                         "longest_trained_tokens": got})
            _set_cp(model, None)
        dist.barrier()
    best = {n: max((r["longest_trained_tokens"] or 0 for r in rows if r["gpus"] == n), default=0) for n in (1, top)}
    plain = next((r["longest_trained_tokens"] for r in rows if r["mode"] == "one GPU (no CP)"), None)
    return {"d_model": args.d_model, "layers": args.layers, "gpu_gib": cap, "rows": rows, "gpus": top,
            "most_over_one_best": best[top] / best[1] if best[1] and best[top] else None,
            "most_over_one_plain": best[top] / plain if plain and best[top] else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/context_parallel")
    ap.add_argument("--parts", default="exact,scaling,reach")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--length-per-gpu", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace-dir", default=None, help="scaling: profile one step on every rank (plain, and CP over "
                    "each N without recompute): Chrome traces there, the summaries printed and in the JSON")
    ap.add_argument("--scaling-recompute", type=int, default=1, help="scaling: also the rows with recompute=True")
    ap.add_argument("--profile", action="store_true", help="print the CUDA kernels of one step, plain and CP over 1")
    ap.add_argument("--exact-d-model", type=int, default=512)
    ap.add_argument("--exact-layers", type=int, default=4)
    ap.add_argument("--exact-length", type=int, default=8192)
    ap.add_argument("--reach-probe", type=int, default=4096, help="tokens per GPU of the first memory probe")
    ap.add_argument("--reach-fraction", type=float, default=0.92, help="of the GPU's memory the prediction aims at")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 4) if n <= world}
    res = {"gpu": torch.cuda.get_device_name(0), "world": world, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    for part in args.parts.split(","):
        t0 = time.time()
        res[part] = {"exact": part_exact, "scaling": part_scaling, "reach": part_reach}[part](args, rank, world, groups)
        if rank == 0:
            print(f"[{part}: {time.time() - t0:.0f} s]", flush=True)
    if rank == 0:
        _print(res)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


def _print(res):
    print(f"GPU: {res['gpu']} x {res['world']}")
    if "exact" in res:
        e = res["exact"]
        print(f"\nexactness (d_model {e['d_model']}, {e['layers']} layers, {e['length']} tokens; max |diff| / max |ref| "
              "against one GPU's fp32 run)")
        print("| GPUs | dtype | out | d input | d weights | one GPU's own: out | d input | d weights |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in e["rows"]:
            c, o = r["cp_vs_one_gpu_fp32"], r["one_gpu_vs_one_gpu_fp32"]
            print(f"| {r['gpus']} | {r['dtype']} | {c['out']:.1e} | {c['dinput']:.1e} | {c['dweights']:.1e} | "
                  f"{o['out']:.1e} | {o['dinput']:.1e} | {o['dweights']:.1e} |")
    if "scaling" in res:
        s = res["scaling"]
        print(f"\nscaling (d_model {s['d_model']}, {s['layers']} layers, {s['length_per_gpu']} tokens per GPU, "
              "fwd+bwd bf16)")
        print("| GPUs | mode | tokens | step (s) | peak GiB | tokens/s per GPU | vs one GPU |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in s["rows"]:
            print(f"| {r['gpus']} | {r['mode']} | {r['tokens']} | {r['step_s']:.3f} | {r['peak_gib']:.1f} | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {r['per_gpu_vs_one_gpu']:.3f} |")
    if "reach" in res:
        r = res["reach"]
        print(f"\nreach (d_model {r['d_model']}, {r['layers']} layers, {r['gpu_gib']:.0f} GiB GPUs)")
        print("| GPUs | mode | GiB per 1k tokens (per GPU) | longest trained (tokens) |")
        print("| ---: | --- | ---: | ---: |")
        for row in r["rows"]:
            print(f"| {row['gpus']} | {row['mode']} | {row['gib_per_1k_tokens']:.3f} | {row['longest_trained_tokens']} |")
        print(f"{r['gpus']} GPUs over 1: {r['most_over_one_best']} (best of each), {r['most_over_one_plain']} (over "
              "the plain one-GPU model)")


if __name__ == "__main__":
    main()
