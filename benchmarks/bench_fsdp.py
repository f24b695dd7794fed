"""Packed training on several GPUs with FSDP2: tokens/s per GPU on 1, 2 and 4 GPUs, packed against dense, and
the loss of the first steps against one GPU's with the same global batch (issue 35).

Every launch (``torchrun --nproc_per_node N``) trains, per width, a Mamba-1 language model sharded per block with
``fully_shard`` (bf16 ``MixedPrecisionPolicy``: bf16 parameters in forward and backward, float32 gradient
reduction and AdamW on float32 shards), fed by ``PackedDataLoader`` (every global step of ``N * rows`` packed
rows split over the ranks, token-balanced), in two modes:

    packed   ``ops.enable_packing``: every sequence starts from a zero state (position_ids)
    dense    the same rows without boundaries (mamba-ssm's own model; with the transformers fallback, the
             converted model called without position_ids): the ceiling packing approaches, not a valid way
             to train

The model is mamba-ssm's ``MambaLMHeadModel`` when mamba_ssm imports, else transformers' ``MambaForCausalLM``
(the JSON says which). Data: synthetic token shards with lognormal(5.5, 0.9) lengths clipped to [8, 2048]
(bench_train.py's), written once by rank 0. Tokens/s count real (non-padding) tokens of all ranks, divided by
the GPU count. The loss check: the N-GPU run's global mean loss of the first ``--loss-steps`` steps; the
one-GPU launch computes, for every other N of ``--ref-worlds``, the same steps with the global batch of N
GPUs (N micro-batches of ``rows`` rows, gradients accumulated: the rows rank r would get are micro-batch r);
they differ only by the order of the reductions (and bf16 rounding that follows from it).

    for n in 1 2 4; do torchrun --standalone --nproc_per_node $n benchmarks/bench_fsdp.py; done
    python benchmarks/bench_fsdp.py --report            # the table, benchmarks/results/fsdp/fsdp.json
    python benchmarks/bench_fsdp.py --smoke             # CPU, gloo, 1 and 2 processes, a tiny model: seconds

``--layers`` / ``--d-model`` shrink the model (``--widths`` still names the rows of the table).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import os
import platform
import socket
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

WIDTHS = {"1.4b": (2048, 48, 4), "2.8b": (2560, 64, 2)}  # d_model, layers, packed rows per GPU (bench_train's)
IGNORE_INDEX = -100
DEFAULT_OUT = os.path.join(HERE, "results", "fsdp")


# ------------------------------------------------------------------------------------------------------------
# data

def write_data(directory: str, n_tokens: int, vocab: int, seed: int) -> str:
    """Synthetic token shards (lognormal lengths, random ids), written once; returns their pattern."""
    from _synthetic import write_arrow_shard

    pattern = os.path.join(directory, "shard-*.arrow")
    done = os.path.join(directory, f"done-{n_tokens}-{vocab}-{seed}")
    if os.path.exists(done):
        return pattern
    os.makedirs(directory, exist_ok=True)
    for old in glob.glob(pattern):
        os.remove(old)
    rng = np.random.default_rng(seed)
    lens = np.clip(np.exp(rng.normal(5.5, 0.9, int(n_tokens / 330) + 16)), 8, 2048).astype(np.int64)
    per = -(-len(lens) // 4)
    for k in range(4):
        part = lens[k * per:(k + 1) * per]
        off = np.concatenate([[0], np.cumsum(part)])
        write_arrow_shard(os.path.join(directory, f"shard-{k:03d}.arrow"), off,
                          rng.integers(2, vocab, int(off[-1]), dtype=np.int32))
    open(done, "w").close()
    return pattern


def make_loader(pattern, capacity, rows, seed, rank=None, world=None):
    from packloader import PackedDataLoader

    return PackedDataLoader(pattern, capacity=capacity, batch_size=rows, seed=seed, rank=rank, world_size=world,
                            overflow="split", return_ids=True, algorithm="bfd")


def real_tokens(batch) -> int:
    return int(batch["sample_ids"][:, 4].sum())


# ------------------------------------------------------------------------------------------------------------
# model

def model_kind(device) -> str:
    if device.type != "cuda":
        return "hf"
    try:
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # noqa: F401
    except Exception:
        return "hf"
    return "mamba_ssm"


def build(kind, mode, d_model, layers, vocab, seed, device, mesh, compile_blocks, reshard_after_forward=True):
    """A float32 model on ``device``, converted for packing (mode packed; and the transformers fallback's
    dense mode, which then gets no position_ids), sharded per block with a bf16 MixedPrecisionPolicy;
    ``reshard_after_forward=False``: the blocks keep their gathered parameters from the forward to the
    backward (no all-gather in the backward; gradients and optimizer states stay sharded)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ops

    torch.manual_seed(seed)
    if kind == "mamba_ssm":
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        cfg = MambaConfig(d_model=d_model, n_layer=layers, vocab_size=vocab, ssm_cfg={"layer": "Mamba1"},
                          rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8)
        model = MambaLMHeadModel(cfg, device=device, dtype=torch.float32)
        if mode == "packed":
            ops.enable_packing(model)
    else:
        import transformers

        cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                                       state_size=16, pad_token_id=1, use_cache=False)
        model = ops.enable_packing(transformers.MambaForCausalLM(cfg).to(device))
    model.train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.backbone.layers:
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
    return model, opt


def loss_sum(model, batch, mode, device):
    import torch.nn.functional as F

    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    if mode == "packed":
        logits = model(ids, position_ids=batch["position_ids"].to(device, non_blocking=True)).logits
    else:
        logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def train_step(model, opt, micro_batches, mode, device, world):
    """One optimizer step over ``micro_batches`` (this rank's; gradients accumulated); returns the global
    mean loss. Loss = sum / global loss tokens, times ``world`` (FSDP averages gradients over ranks)."""
    import torch
    import torch.distributed as dist

    n = torch.tensor(float(sum(int(b["num_loss_tokens"]) for b in micro_batches)), device=device,
                     dtype=torch.float64)
    dist.all_reduce(n)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for b in micro_batches:  # (gradients reduced after every micro-batch: accumulated in float32 shards)
        s = loss_sum(model, b, mode, device)
        (s * (world / n.clamp(min=1))).backward()
        total += s.detach().double()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return total / n.clamp(min=1)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(kind, mode, width, args, pattern, device, mesh, rank, world):
    import torch
    import torch.distributed as dist

    d_model, layers, rows = WIDTHS[width]
    d_model, layers, rows = args.d_model or d_model, args.layers or layers, args.rows or rows
    loader = make_loader(pattern, args.capacity, rows, args.seed)
    it = iter(loader)
    losses, tokens = [], 0
    model = opt = None
    try:  # (every rank holds the same amount: an out-of-memory error comes on all of them)
        model, opt = build(kind, mode, d_model, layers, args.vocab, args.seed, device, mesh, args.compile,
                           not args.no_reshard)
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                sync(device)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
            batch = next(it)
            loss = train_step(model, opt, [batch], mode, device, world)
            if i < args.loss_steps:
                losses.append(float(loss))
            if i >= args.warmup:
                tokens += real_tokens(batch)
        sync(device)
        sec = time.perf_counter() - t0
        profile = trace_step(model, opt, next(it), mode, device, world, args, f"{width}-{mode}-{world}gpu") \
            if args.trace_dir and device.type == "cuda" else None
    except torch.OutOfMemoryError:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
        return {"width": width, "mode": mode, "gpus": world, "oom": True}
    all_tokens = torch.tensor(float(tokens), device=device)
    dist.all_reduce(all_tokens)
    slowest = torch.tensor(sec, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, opt
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    sec = float(slowest)
    return {"width": width, "mode": mode, "gpus": world, "kind": kind, "d_model": d_model, "layers": layers,
            "rows_per_gpu": rows, "capacity": args.capacity, "steps": args.steps, "seconds": sec,
            "ms_per_step": 1e3 * sec / args.steps, "tokens": int(all_tokens),
            "tokens_per_s_per_gpu": float(all_tokens) / sec / world, "peak_gib": peak, "losses": losses,
            **({"profile": profile} if profile else {})}


def trace_step(model, opt, batch, mode, device, world, args, label):
    """One more step, profiled on every rank (rank 0 writes its Chrome trace): the host syncs it makes and
    where its time went (benchmarks/_trace.py), per rank."""
    import warnings

    import torch
    import torch.distributed as dist

    from _trace import trace_call

    rank = dist.get_rank()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(model, opt, [batch], mode, device, world)
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    path = os.path.join(args.trace_dir, label + ".json.gz") if rank == 0 else None
    summary = trace_call(lambda: train_step(model, opt, [batch], mode, device, world), path, label, top=12)
    summary["host_syncs"] = syncs
    every = [None] * world
    dist.all_gather_object(every, summary)
    if rank == 0:
        for r, s in enumerate(every):
            print(f"  trace {label} rank {r}: wall {s['wall_ms']:.1f} ms, compute busy {s['compute_busy_ms']:.1f}, "
                  f"nccl {s['nccl_ms']:.1f}, gaps>50us {s['idle_gaps_over_50us_ms']:.1f} "
                  f"(longest {s['longest_gaps_ms'][:3]}), {s['kernels']} kernels, {s['host_syncs']} host syncs",
                  flush=True)
    return every


def reference_losses(kind, width, args, pattern, device, mesh, ref_world):
    """One GPU, the global batch of ``ref_world`` GPUs: micro-batch r = the rows rank r of ``ref_world``
    gets (its own loader); the first ``--loss-steps`` global mean losses."""
    d_model, layers, rows = WIDTHS[width]
    d_model, layers, rows = args.d_model or d_model, args.layers or layers, args.rows or rows
    model, opt = build(kind, "packed", d_model, layers, args.vocab, args.seed, device, mesh, args.compile,
                       not args.no_reshard)
    its = [iter(make_loader(pattern, args.capacity, rows, args.seed, rank=r, world=ref_world))
           for r in range(ref_world)]
    out = [float(train_step(model, opt, [next(i) for i in its], "packed", device, 1)) for _ in range(args.loss_steps)]
    del model, opt
    if device.type == "cuda":
        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return out


def worker(args) -> dict:
    """One rank of a launch: every width, both modes (and on one GPU the reference losses)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from _synthetic import init_distributed
    device, rank, world = init_distributed(args.device)
    mesh = init_device_mesh(device.type, (world,))
    kind = model_kind(device)
    if rank == 0:
        write_data(args.data_dir, args.data_tokens, args.vocab, args.seed)
    dist.barrier()
    pattern = write_data(args.data_dir, args.data_tokens, args.vocab, args.seed)
    results, refs = [], {}
    for width in args.widths.split(","):
        for mode in args.modes.split(","):
            r = run_mode(kind, mode, width, args, pattern, device, mesh, rank, world)
            results.append(r)
            if rank == 0:
                print(f"{world} GPU(s) {width} {mode}: " + (
                    "out of memory" if r.get("oom") else
                    f"{r['ms_per_step']:.1f} ms/step, {r['tokens_per_s_per_gpu']:,.0f} tok/s per GPU, "
                    f"losses {[round(x, 5) for x in r['losses']]}"), flush=True)
        if world == 1:
            for ref_world in [int(x) for x in args.ref_worlds.split(",") if x and int(x) > 1]:
                refs[f"{width}:{ref_world}"] = reference_losses(kind, width, args, pattern, device, mesh, ref_world)
                if rank == 0:
                    print(f"1 GPU {width}, global batch of {ref_world}: losses "
                          f"{[round(x, 5) for x in refs[f'{width}:{ref_world}']]}", flush=True)
    doc = {"gpus": world, "results": results, "reference_losses": refs, "model": kind, "device": str(device),
           "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "args": vars(args)}
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"fsdp_{world}gpu.json"), "w") as f:
            json.dump(doc, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return doc


# ------------------------------------------------------------------------------------------------------------
# report

def report(out_dir: str) -> dict:
    """The table over every ``fsdp_*gpu.json`` in ``out_dir``; writes ``fsdp.json`` there."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "fsdp_*gpu.json"))):
        with open(path) as f:
            doc = json.load(f)
        runs[doc["gpus"]] = doc
    if not runs:
        raise SystemExit(f"error: no fsdp_*gpu.json in {out_dir}: run the torchrun launches first")
    reshard = {n: not doc["args"].get("no_reshard", False) for n, doc in runs.items()}
    if len(set(reshard.values())) > 1:
        raise SystemExit(f"error: the launches in {out_dir} differ in --no-reshard ({reshard}): compare like with like")
    one = runs.get(1)
    base = {(r["width"], r["mode"]): r for r in one["results"]} if one else {}
    rows = []
    for n in sorted(runs):
        by = {(r["width"], r["mode"]): r for r in runs[n]["results"]}
        for (width, mode), r in by.items():
            row = {"gpus": n, "width": width, "mode": mode, "oom": bool(r.get("oom"))}
            if not r.get("oom"):
                b = base.get((width, mode))
                dense = by.get((width, "dense"))
                row.update({k: r[k] for k in ("d_model", "layers", "rows_per_gpu", "capacity", "ms_per_step",
                                              "tokens_per_s_per_gpu", "peak_gib", "losses")})
                row["scaling_vs_1gpu"] = (r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
                                          if b and not b.get("oom") else None)
                row["packed_over_dense"] = (r["tokens_per_s_per_gpu"] / dense["tokens_per_s_per_gpu"]
                                            if mode == "packed" and dense and not dense.get("oom") else None)
                ref = one["reference_losses"].get(f"{width}:{n}") if one and n > 1 else None
                if mode == "packed" and ref:
                    k = min(len(ref), len(r["losses"]))
                    row["loss_vs_1gpu_max_rel"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:k], ref[:k]))
                    row["reference_losses"] = ref[:k]
            rows.append(row)
    lines = ["| width | GPUs | mode | rows/GPU | ms/step | tok/s per GPU | per GPU vs 1 GPU | packed / dense | "
             "peak GiB | first losses vs 1 GPU (max rel. diff) |", "|" + " --- |" * 10]

    def fmt(x, f):
        return "-" if x is None else format(x, f)

    for row in sorted(rows, key=lambda r: (r["width"], r["mode"] != "packed", r["mode"], r["gpus"])):
        if row["oom"]:
            lines.append(f"| {row['width']} | {row['gpus']} | {row['mode']} | out of memory |" + " |" * 6)
            continue
        lines.append(f"| {row['width']} ({row['d_model']} x {row['layers']}) | {row['gpus']} | {row['mode']} | "
                     f"{row['rows_per_gpu']} x {row['capacity']} | {row['ms_per_step']:.1f} | "
                     f"{row['tokens_per_s_per_gpu']:,.0f} | {fmt(row['scaling_vs_1gpu'], '.3f')}x | "
                     f"{fmt(row['packed_over_dense'], '.3f')} | {fmt(row['peak_gib'], '.1f')} | "
                     f"{fmt(row.get('loss_vs_1gpu_max_rel'), '.2e')} |")
    table = "\n".join(lines)
    first = runs[min(runs)]
    doc = {"rows": rows, "table": table, "model": first["model"], "gpu_name": first["gpu_name"],
           "torch": first["torch"], "launches": sorted(runs), "reshard_after_forward": reshard[min(runs)],
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(os.path.join(out_dir, "fsdp.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"model: {doc['model']}; device: {doc['gpu_name']}; torch {doc['torch']}; "
          f"reshard_after_forward={doc['reshard_after_forward']}")
    print(table)
    print(f"wrote {os.path.join(out_dir, 'fsdp.json')}")
    return doc


# ------------------------------------------------------------------------------------------------------------
# smoke (CPU, gloo, forked processes)

def _smoke_child(rank, world, port, argv, log):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    code = 1
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            import torch

            torch.set_num_threads(1)
            worker(parse(argv))
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
    os._exit(code)


def smoke(argv: list, out_dir: str) -> dict:
    """Launch 1 and then 2 processes on the CPU (gloo) with a tiny model, then the report."""
    import multiprocessing as mp

    # imported once here, not in every forked process (most of the smoke's time otherwise)
    import torch.distributed.fsdp  # noqa: F401
    from transformers import MambaConfig, MambaForCausalLM  # noqa: F401

    import ops  # noqa: F401
    import packloader  # noqa: F401

    ctx = mp.get_context("fork")
    for world in (1, 2):
        t0 = time.perf_counter()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        logs = [os.path.join(out_dir, f"smoke-{world}-rank{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_smoke_child, args=(r, world, port, argv, logs[r])) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs):
            text = "\n".join(open(x).read() if os.path.exists(x) else "" for x in logs)
            raise SystemExit(f"error: the smoke launch of {world} process(es) failed:\n{text[-4000:]}")
        print(f"smoke: {world} process(es) in {time.perf_counter() - t0:.1f} s", flush=True)
    return report(out_dir)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--widths", default="1.4b,2.8b", help=f"comma list of {sorted(WIDTHS)}")
    ap.add_argument("--modes", default="packed,dense", help="comma list of packed, dense")
    ap.add_argument("--d-model", type=int, default=0, help="override the width's d_model (0: its own)")
    ap.add_argument("--layers", type=int, default=0, help="override the width's depth (0: its own)")
    ap.add_argument("--rows", type=int, default=0, help="packed rows per GPU and step (0: 4 at 1.4B, 2 at 2.8B)")
    ap.add_argument("--capacity", type=int, default=4096, help="tokens per packed row")
    ap.add_argument("--vocab", type=int, default=50277, help="vocabulary")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (their losses are recorded)")
    ap.add_argument("--loss-steps", type=int, default=3, help="first steps whose loss is compared to one GPU's")
    ap.add_argument("--ref-worlds", default="2,4", help="one-GPU launch: reference losses for these GPU counts")
    ap.add_argument("--compile", action="store_true", help="torch.compile every block")
    ap.add_argument("--no-reshard", action="store_true",
                    help="fully_shard(reshard_after_forward=False): no all-gather in the backward (ZeRO-2-like)")
    ap.add_argument("--trace-dir", default="", help="profile one extra step per mode on every rank: host syncs, "
                    "compute/NCCL time, gaps, top kernels in the JSON; rank 0's Chrome trace here")
    ap.add_argument("--seed", type=int, default=0, help="data and init seed")
    ap.add_argument("--data-dir", default=os.path.join("/tmp", "packloader_bench_fsdp"), help="synthetic shards")
    ap.add_argument("--data-tokens", type=int, default=3_000_000, help="tokens of synthetic data")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL, cpu: gloo")
    ap.add_argument("--out-dir", default=DEFAULT_OUT, help="JSON per launch and fsdp.json")
    ap.add_argument("--report", action="store_true", help="only build the table from the launches' JSON")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 1 and 2 processes, a tiny model, seconds")
    args = ap.parse_args(argv)
    for w in args.widths.split(","):
        if w not in WIDTHS:
            ap.error(f"--widths: unknown width {w!r} (known: {sorted(WIDTHS)})")
    for m in args.modes.split(","):
        if m not in ("packed", "dense"):
            ap.error(f"--modes: unknown mode {m!r} (packed, dense)")
    if args.loss_steps > args.warmup + args.steps:
        ap.error("--loss-steps must be at most --warmup + --steps")
    return args


SMOKE = ["--device", "cpu", "--widths", "1.4b", "--d-model", "32", "--layers", "2", "--rows", "2",
         "--capacity", "128", "--vocab", "512", "--steps", "2", "--warmup", "1", "--loss-steps", "2",
         "--ref-worlds", "2", "--data-tokens", "60000"]


def main(argv=None):
    args = parse(argv)
    if args.smoke:
        argv = list(argv if argv is not None else sys.argv[1:])
        out_dir = args.out_dir if "--out-dir" in argv else os.path.join("/tmp", "packloader_bench_fsdp_smoke")
        os.makedirs(out_dir, exist_ok=True)
        for old in glob.glob(os.path.join(out_dir, "fsdp_*gpu.json")):
            os.remove(old)
        data_dir = os.path.join(out_dir, "data")
        return smoke(SMOKE + ["--out-dir", out_dir, "--data-dir", data_dir] + ["--no-reshard"] * args.no_reshard,
                     out_dir)
    if args.report:
        return report(args.out_dir)
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    return worker(args)


if __name__ == "__main__":
    main()
