"""Training throughput of Hugging Face ``MambaForCausalLM`` converted by ``ops.enable_packing``, on packed rows.

    python benchmarks/bench_hf.py --out benchmarks/results/hf/hf_mamba_h200.json        # GPU: the 1.4B width
    python benchmarks/bench_hf.py --layers 8 --out /tmp/hf8.json                # fewer layers, same width
    python benchmarks/bench_hf.py --quick                                       # CPU smoke run, any machine

Model: transformers' ``MambaForCausalLM`` at the Mamba-1.4B width (d_model 2048, 48 layers, d_state 16,
d_conv 4, expand 2, vocab 50280), random init, ``--dtype`` parameters (bf16 by default); one step is
forward + loss (transformers' own, from ``labels``) + backward, no optimizer. Data: lognormal sequence
lengths (``--median``, max ``--seqlen``) packed best-fit into ``--batch`` rows of ``--seqlen`` tokens.
Three variants, on the same sequences and the same weights:

- ``packed``: the converted model on the packed rows, ``position_ids`` given: every sequence isolated
  (our packed conv + scan, fused);
- ``hf rows, no boundaries``: the unconverted model on the same packed rows without boundaries, through
  transformers' own training path (``mamba_inner_fn`` of mamba-ssm + causal-conv1d on a GPU with both
  installed; the PyTorch loop otherwise). It leaks across sequences: it is the speed to match
  (target: packed >= 0.97x);
- ``hf padded``: transformers' usual batches: the same sequences in random order, ``--pad-batch`` per
  batch, right-padded to the longest with an ``attention_mask`` (target: packed >= 2.5x).

Throughput counts real tokens (no padding) per second; each time is the median of ``--iters`` runs
after ``--warmup`` (for ``hf padded`` one run is all its batches). Peak memory is
``torch.cuda.max_memory_allocated`` per variant. Table on stdout, JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TARGET_VS_HF_ROWS = 0.97
TARGET_VS_PADDED = 2.5


def make_rows(n_rows: int, capacity: int, median: float, seed: int):
    """Lognormal lengths packed best-fit into ``n_rows`` rows; returns (per-row length lists, all lengths)."""
    from packer_algos import pack

    rng = np.random.default_rng(seed)
    lens = np.clip(np.exp(rng.normal(np.log(median), 1.0, n_rows * capacity // max(1, int(median)) * 3)),
                   1, capacity).astype(np.int64)
    plan = pack(lens, capacity, "bfd")
    # the fullest rows first (a training run's rows are nearly full; the plan's last ones are leftovers)
    fill = [int(plan.bin(b)[2].sum()) for b in range(plan.n_bins)]
    order = np.argsort(fill)[::-1][:n_rows]
    rows = [[int(n) for n in plan.bin(int(b))[2]] for b in order]
    if len(rows) < n_rows:
        raise SystemExit(f"only {len(rows)} rows could be made; lower --batch")
    return rows


def packed_tensors(rows, capacity, vocab, device, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (len(rows), capacity), generator=g)
    pos = torch.zeros(len(rows), capacity, dtype=torch.long)
    labels = ids.clone()
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            pos[r, s:s + n] = torch.arange(n)
            labels[r, s] = -100
            s += n
        ids[r, s:], labels[r, s:] = 0, -100  # the padding tail: its own segment (position_ids from 0)
        pos[r, s:] = torch.arange(capacity - s)
    return ids.to(device), pos.to(device), labels.to(device)


def padded_batches(rows, ids, pad_batch, seed):
    """The packed rows' sequences as transformers' usual right-padded batches, in random order."""
    seqs = []
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            seqs.append(ids[r, s:s + n])
            s += n
    random.Random(seed).shuffle(seqs)
    out = []
    for k in range(0, len(seqs), pad_batch):
        chunk = seqs[k:k + pad_batch]
        n = max(len(x) for x in chunk)
        b = torch.zeros(len(chunk), n, dtype=torch.long, device=ids.device)
        m = torch.zeros_like(b)
        for i, x in enumerate(chunk):
            b[i, :len(x)], m[i, :len(x)] = x, 1
        lab = b.masked_fill(m == 0, -100)
        lab[:, 0] = -100
        out.append((b, m, lab))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model and rows, 1 iteration")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--d-model", type=int, default=2048, help="hidden size (Mamba-1.4B: 2048)")
    ap.add_argument("--layers", type=int, default=48, help="layers (Mamba-1.4B: 48)")
    ap.add_argument("--d-state", type=int, default=16, help="SSM state size")
    ap.add_argument("--vocab", type=int, default=50280, help="vocabulary (GPT-NeoX-20B, padded)")
    ap.add_argument("--batch", type=int, default=2, help="packed rows per step")
    ap.add_argument("--seqlen", type=int, default=4096, help="tokens per packed row (and longest sequence)")
    ap.add_argument("--median", type=float, default=200.0, help="median sequence length")
    ap.add_argument("--pad-batch", type=int, default=8, help="sequences per padded batch (hf padded)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="parameter dtype")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on every layer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per variant")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per variant (median)")
    ap.add_argument("--seed", type=int, default=0, help="data and init seed")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.d_model, args.layers, args.vocab = "cpu", 32, 2, 256
        args.batch, args.seqlen, args.median, args.pad_batch = 2, 128, 20, 4
        args.dtype, args.warmup, args.iters = "fp32", 0, 1

    import transformers

    import ops

    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
                                   state_size=args.d_state, conv_kernel=4, expand=2, use_cache=False)
    with torch.device(device):
        model = transformers.MambaForCausalLM(cfg)
    model.to(dtype).train()
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    kernels = importlib.util.find_spec("mamba_ssm") is not None and importlib.util.find_spec("causal_conv1d") is not None
    hf_path = "mamba_inner_fn (mamba-ssm)" if (kernels and device.type == "cuda") else "PyTorch loop (no mamba-ssm)"

    rows = make_rows(args.batch, args.seqlen, args.median, args.seed)
    ids, pos, labels = packed_tensors(rows, args.seqlen, args.vocab, device, args.seed)
    real_tokens = sum(sum(r) for r in rows)
    n_seqs = sum(len(r) for r in rows)
    padded = padded_batches(rows, ids, args.pad_batch, args.seed)
    padded_positions = sum(b.numel() for b, _, _ in padded)

    def zero():
        for p in model.parameters():
            p.grad = None

    def step_hf_rows():
        zero()
        model(ids, labels=labels).loss.backward()

    def step_padded():
        for b, m, lab in padded:
            zero()
            model(b, attention_mask=m, labels=lab).loss.backward()

    def step_packed():
        zero()
        model(ids, position_ids=pos, labels=labels).loss.backward()

    results = []
    for name, fn, convert, positions in (("hf rows, no boundaries", step_hf_rows, False, ids.numel()),
                                         ("hf padded", step_padded, False, padded_positions),
                                         ("packed", step_packed, True, ids.numel())):
        if convert:
            ops.enable_packing(model)
        sec, peak = measure(fn, device, args.warmup, args.iters)
        results.append({"variant": name, "ms": 1e3 * sec, "real_tokens_per_s": real_tokens / sec,
                        "positions": positions, "padding": 1 - real_tokens / positions, "peak_gib": peak})
    by = {r["variant"]: r for r in results}
    packed = by["packed"]["real_tokens_per_s"]
    for r in results:
        r["packed_speedup"] = packed / r["real_tokens_per_s"]

    print(f"\nHF MambaForCausalLM d_model={args.d_model} layers={args.layers} ({n_params / 1e9:.2f}B params), "
          f"{args.dtype}, {args.device}; {args.batch} rows x {args.seqlen} tokens, {n_seqs} sequences, "
          f"{real_tokens} real tokens; hf path: {hf_path}")
    print(f"{'variant':24s} {'ms/step':>9s} {'real tok/s':>11s} {'padding':>8s} {'peak GiB':>9s} {'packed is':>10s}")
    for r in results:
        print(f"{r['variant']:24s} {r['ms']:9.1f} {r['real_tokens_per_s']:11.0f} {100 * r['padding']:7.1f}% "
              f"{r['peak_gib']:9.2f} {r['packed_speedup']:9.3f}x")
    vs_rows, vs_padded = by["hf rows, no boundaries"]["packed_speedup"], by["hf padded"]["packed_speedup"]
    print(f"packed vs hf rows without boundaries: {vs_rows:.3f}x (target >= {TARGET_VS_HF_ROWS}); "
          f"vs hf padded: {vs_padded:.2f}x (target >= {TARGET_VS_PADDED})")
    out = {
        "bench": "bench_hf", "args": vars(args), "params": n_params, "hf_path": hf_path,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "rows": rows, "real_tokens": real_tokens, "sequences": n_seqs, "results": results,
        "packed_vs_hf_rows": vs_rows, "packed_vs_hf_padded": vs_padded,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
