"""Training throughput of a Mamba-1 language model on variable-length data: the PackMamba paper's table, ours.

A mamba-ssm ``MambaLMHeadModel`` (Mamba-1 mixers, full depth) takes training steps (forward, cross-entropy loss,
backward, fused AdamW step; bf16 autocast, float32 weights) in four modes over the same sequences:

    single   one sequence per step (batch 1, its own length): the paper's baseline
    padded   batches of --pad-batch sequences, right-padded to their longest
    packed   rows of --capacity tokens packed best-fit (``packer_algos``), boundaries reset by
             ``ops.enable_packing`` (ours)
    dense    the same packed rows fed to mamba-ssm's own model without boundaries: the ceiling
             packing approaches (sequences leak into each other; not a valid way to train)
    compiled packed, the model and its loss under ``torch.compile(fullgraph=True)`` (inductor; dense cannot
             compile: mamba-ssm's kernels are opaque autograd Functions); the first step's compile is untimed

    packed row (capacity 16):   [ a a a a a | b b b | c c c c c c | pad ]
    position_ids:               [ 0 1 2 3 4 | 0 1 2 | 0 1 2 3 4 5 | 0 ]

Real tokens per second count every sequence's tokens once (padding is not counted). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (model, gradients and optimizer state included).
A mode that runs out of memory is retried with fewer rows per step (packed, dense) or with gradient accumulation
over smaller micro-batches (padded); the table says so.

Lengths: GSM8K question + answer tokenized with the GPT-NeoX-20B tokenizer (``../shared/data``; or a ``.npy`` of
lengths via --gsm8k-lengths, written by --write-gsm8k-lengths where ``tokenizers`` is installed), and
lognormal(5.5, 0.9) clipped to [8, 2048].

    python benchmarks/bench_train.py --out benchmarks/results/train/train_h200.json \\
        --plot benchmarks/results/train/train_h200.png

``--profile-steps N`` runs N more steps of each mode under ``torch.profiler`` and adds, per mode, the GPU time per step
by kernel and by kind (GEMM, scan forward/backward, conv, norm, loss, optimizer, elementwise): where packed and dense
differ.

``--saved-tensors`` adds, per width, what one training step keeps for the backward pass (tensors saved by
autograd, unique storages) in the packed and dense modes, largest first: where a memory difference comes from.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WIDTHS = {  # the published Mamba-1 sizes (d_model, n_layer) and the packed rows per step on an 80-140 GB GPU
    "1.4b": (2048, 48, 4),
    "2.8b": (2560, 64, 2),
}
MODES = ("single", "padded", "packed", "dense", "compiled")
ROW_MODES = ("packed", "dense", "compiled")  # the modes that train on packed rows
IGNORE_INDEX = -100
SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")


# --------------------------------------------------------------------------------------------------------------
# lengths and steps (plain numpy: also used on the CPU by the tests)

def lognormal_lengths(n: int, seed: int, mu: float = 5.5, sigma: float = 0.9, lo: int = 8, hi: int = 2048):
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(mu, sigma, n)), lo, hi).astype(np.int64)


def gsm8k_lengths(jsonl: str, tokenizer_json: str) -> np.ndarray:
    """Tokens of ``question + "\\n" + answer`` plus an end-of-text token, per GSM8K example."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    texts = []
    with open(jsonl) as f:
        for line in f:
            ex = json.loads(line)
            texts.append(ex["question"] + "\n" + ex["answer"])
    return np.array([len(e.ids) + 1 for e in tok.encode_batch(texts)], dtype=np.int64)


def packed_steps(lengths: np.ndarray, capacity: int, rows_per_step: int, seed: int) -> list[list[list[int]]]:
    """Rows packed best-fit, in random order, grouped ``rows_per_step`` at a time: steps -> rows -> lengths."""
    from packer_algos import pack

    plan = pack(lengths, capacity, "bfd")
    rows = [[int(n) for n in plan.bin(b)[2]] for b in range(plan.n_bins)]
    np.random.default_rng(seed).shuffle(rows)
    n = len(rows) // rows_per_step
    return [rows[i * rows_per_step:(i + 1) * rows_per_step] for i in range(n)]


def padded_steps(lengths: np.ndarray, pad_batch: int, seed: int) -> list[list[int]]:
    """Sequences in random order, ``pad_batch`` per step (each step padded to its longest)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    n = len(order) // pad_batch
    return [[int(lengths[i]) for i in order[k * pad_batch:(k + 1) * pad_batch]] for k in range(n)]


def single_steps(lengths: np.ndarray, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(len(lengths))
    return [[int(lengths[i])] for i in order]


def real_tokens(step) -> int:
    """Sequence tokens in one step (a list of rows of lengths, or a list of lengths)."""
    return int(sum(sum(x) if isinstance(x, list) else x for x in step))


# --------------------------------------------------------------------------------------------------------------
# tensors and models (CUDA)

def packed_batch(rows, capacity, vocab, gen, device):
    """input_ids, position_ids (padding tail: its own segment) and next-token labels of packed rows."""
    import torch

    ids = torch.randint(2, vocab, (len(rows), capacity), generator=gen)
    pos = torch.zeros(len(rows), capacity, dtype=torch.int32)
    labels = torch.full((len(rows), capacity), IGNORE_INDEX, dtype=torch.long)
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            pos[r, s:s + n] = torch.arange(n, dtype=torch.int32)
            labels[r, s:s + n - 1] = ids[r, s + 1:s + n]
            s += n
        ids[r, s:] = 0
        pos[r, s:] = torch.arange(capacity - s, dtype=torch.int32)
    return ids.to(device), pos.to(device), labels.to(device)


def padded_batch(lens, vocab, gen, device):
    import torch

    longest = max(lens)
    ids = torch.zeros(len(lens), longest, dtype=torch.long)
    labels = torch.full((len(lens), longest), IGNORE_INDEX, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=gen)
        labels[i, :n - 1] = ids[i, 1:n]
    return ids.to(device), labels.to(device)


def build_model(d_model, n_layer, vocab, seed, device):
    import torch
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab, ssm_cfg={"layer": "Mamba1"},
                      rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8)
    return MambaLMHeadModel(cfg, device=device, dtype=torch.float32).train()


def loss_sum(model, ids, labels, pos=None):
    import torch.nn.functional as F

    logits = (model(ids, position_ids=pos) if pos is not None else model(ids)).logits
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def loss_of(model, ids, labels, pos=None, loss_fn=loss_sum):
    """Mean next-token loss of a batch under bf16 autocast (``loss_fn``: :func:`loss_sum` or its compiled form)."""
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16):
        return loss_fn(model, ids, labels, pos) / max(1, int((labels != IGNORE_INDEX).sum()))


class Mode:
    """One mode's model, optimizer and batches; ``step(i)`` runs training step i."""

    def __init__(self, mode, width, lengths, args, device):
        import torch

        import ops

        d_model, n_layer, rows = WIDTHS[width]
        self.mode, self.rows, self.accum = mode, (args.rows or rows), 1
        self.model = build_model(d_model, args.layers or n_layer, args.vocab, args.seed, device)
        self.loss_fn = loss_sum
        if mode in ("packed", "compiled"):
            ops.enable_packing(self.model)
        if mode == "compiled":
            self.loss_fn = torch.compile(loss_sum, fullgraph=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        self.lengths, self.args, self.device = lengths, args, device
        self.gen = torch.Generator().manual_seed(args.seed)
        self.plan()

    def plan(self):
        a = self.args
        if self.mode in ROW_MODES:
            self.steps = packed_steps(self.lengths, a.capacity, self.rows, a.seed)
        elif self.mode == "padded":
            self.steps = padded_steps(self.lengths, a.pad_batch, a.seed)
        else:
            self.steps = single_steps(self.lengths, a.seed)

    def step(self, i):
        a, s = self.args, self.steps[i % len(self.steps)]
        if self.mode in ROW_MODES:
            ids, pos, labels = packed_batch(s, a.capacity, a.vocab, self.gen, self.device)
            loss_of(self.model, ids, labels, pos if self.mode != "dense" else None, self.loss_fn).backward()
        else:
            k = math.ceil(len(s) / self.accum)
            for j in range(0, len(s), k):
                ids, labels = padded_batch(s[j:j + k], a.vocab, self.gen, self.device)
                (loss_of(self.model, ids, labels) / self.accum).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return real_tokens(s)

    def shrink(self) -> bool:
        """After an out-of-memory error: fewer rows per step, or more micro-batches. False when nothing is left."""
        if self.mode in ROW_MODES and self.rows > 1:
            self.rows //= 2
            self.plan()
            return True
        if self.mode == "padded" and self.accum < self.args.pad_batch:
            self.accum *= 2
            return True
        return False

    def close(self):
        del self.model, self.opt


def run_mode(mode, width, lengths, args, device):
    """Warm-up and timed steps of one mode; retries smaller after an out-of-memory error."""
    import torch

    m = Mode(mode, width, lengths, args, device)
    n_steps = args.single_steps if mode == "single" else args.steps
    try:
        while True:
            try:
                t0 = time.perf_counter()
                for i in range(args.warmup):
                    m.step(i)
                torch.cuda.synchronize()
                warmup_s = time.perf_counter() - t0
                torch.cuda.reset_peak_memory_stats()
                tokens, t0 = 0, time.perf_counter()
                for i in range(args.warmup, args.warmup + n_steps):
                    tokens += m.step(i)
                torch.cuda.synchronize()
                sec = time.perf_counter() - t0
                break
            except torch.OutOfMemoryError:
                m.opt.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                if not m.shrink():
                    return {"mode": mode, "oom": True}
        prof = (profile_mode(m, args, args.warmup + n_steps)
                if args.profile_steps and mode in ROW_MODES else None)
        return {"mode": mode, "profile": prof, "tokens": tokens, "seconds": sec, "tokens_per_s": tokens / sec,
                "ms_per_step": 1e3 * sec / n_steps, "steps": n_steps, "warmup_s": warmup_s,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "rows_per_step": m.rows if mode in ROW_MODES else None,
                "micro_batches": m.accum if mode == "padded" else None}
    finally:
        m.close()
        del m
        gc.collect()
        torch.cuda.empty_cache()


KERNEL_KINDS = (  # (kind, substrings of a kernel's name, lower case); the first match wins
    ("scan fwd", ("scan_fwd", "selective_scan_fwd")),
    ("scan bwd", ("scan_bwd", "selective_scan_bwd")),
    ("conv", ("conv1d", "conv_fwd", "conv_bwd", "conv_runmask", "conv_dw_sum", "causal_conv")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "sm90_xmma", "nvjet", "xmma")),
    ("norm", ("rms", "layer_norm", "layernorm", "_norm_")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("reduce", ("reduce_kernel",)),
    ("copy / cast", ("copy", "cat", "fill", "memset", "memcpy")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise / other"


def profile_mode(m, args, first_step):
    """GPU time per step by kernel and by kind, over ``args.profile_steps`` steps under ``torch.profiler``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(first_step, first_step + args.profile_steps):
            m.step(i)
        torch.cuda.synchronize()
    kernels, kinds = {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        k = kernels.setdefault(e.name, [0.0, 0])
        k[0] += us
        k[1] += 1
    n = args.profile_steps
    table = sorted(([name, us / n / 1e3, calls // n] for name, (us, calls) in kernels.items()), key=lambda r: -r[1])
    for name, ms, _ in table:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"kernel_ms_per_step": sum(kinds.values()), "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": name[:160], "ms": ms, "calls": c} for name, ms, c in table[:40]]}


def print_profiles(results):
    rows = [r for r in results if r.get("profile")]
    if not rows:
        return
    kinds = sorted({k for r in rows for k in r["profile"]["kinds_ms"]},
                   key=lambda k: -max(r["profile"]["kinds_ms"].get(k, 0) for r in rows))
    print("\nGPU ms per step by kernel kind (torch.profiler)")
    print(f"{'kind':20s}" + "".join(f" {r['width'] + ' ' + r['lengths'][:4] + ' ' + r['mode']:>20s}" for r in rows))
    for k in kinds + ["total"]:
        vals = [r["profile"]["kernel_ms_per_step"] if k == "total" else r["profile"]["kinds_ms"].get(k, 0.0)
                for r in rows]
        print(f"{k:20s}" + "".join(f" {v:20.2f}" for v in vals))
    for r in rows:
        print(f"\nlargest kernels, {r['width']} {r['lengths']} {r['mode']} (ms/step, calls/step)")
        for e in r["profile"]["kernels"][:20]:
            print(f"  {e['ms']:8.2f} {e['calls']:5d}  {e['name'][:110]}")


def saved_tensors(mode, width, lengths, args, device):
    """What the packed or dense model keeps for the backward of one step: unique storages saved by autograd."""
    import torch

    m = Mode(mode, width, lengths, args, device)
    try:
        s = m.steps[0]
        ids, pos, labels = packed_batch(s, args.capacity, args.vocab, m.gen, device)
        seen = {}

        def pack_hook(t):
            st = t.untyped_storage()
            key = st.data_ptr()
            if t.device.type == "cuda" and key not in seen and not isinstance(t, torch.nn.Parameter):
                seen[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes())
            return t

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            loss = loss_of(m.model, ids, labels, pos if mode == "packed" else None)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        groups = {}
        for shape, dtype, nbytes in seen.values():
            g = groups.setdefault((shape, dtype), [0, 0])
            g[0] += 1
            g[1] += nbytes
        table = sorted(([list(k[0]), k[1], v[0], v[1] / 2**20] for k, v in groups.items()), key=lambda r: -r[3])
        return {"mode": mode, "rows": len(s), "held_after_forward_gib": held / 2**30,
                "saved_unique_gib": sum(v[2] for v in seen.values()) / 2**30,
                "saved": [{"shape": r[0], "dtype": r[1], "count": r[2], "mib": r[3]} for r in table]}
    finally:
        m.close()
        del m
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------

def load_lengths(args):
    out = {}
    if "gsm8k" in args.lengths:
        if args.gsm8k_lengths and os.path.exists(args.gsm8k_lengths):
            out["gsm8k"] = np.load(args.gsm8k_lengths)
        else:
            out["gsm8k"] = gsm8k_lengths(os.path.join(SHARED, "gsm8k_train.jsonl"),
                                         os.path.join(SHARED, "gpt-neox-20b-tokenizer.json"))
    if "lognormal" in args.lengths:
        out["lognormal"] = lognormal_lengths(args.lognormal_n, args.seed)
    return out


def add_ratios(results):
    """Per result: ``packed_is`` (packed tok/s over this mode's) and ``over_dense`` (this mode's over dense's), where
    both runs of its width and lengths finished."""
    def find(r, mode):
        return next((q for q in results if (q["width"], q["lengths"], q["mode"]) == (r["width"], r["lengths"], mode)
                     and not q.get("oom")), None)

    for r in results:
        if r.get("oom"):
            continue
        p, d = find(r, "packed"), find(r, "dense")
        if p is not None:
            r["packed_is"] = p["tokens_per_s"] / r["tokens_per_s"]
        if d is not None:
            r["over_dense"] = r["tokens_per_s"] / d["tokens_per_s"]


def print_table(results):
    print(f"\n{'width':6s} {'lengths':10s} {'mode':8s} {'rows':>4s} {'ms/step':>9s} {'real tok/s':>11s} "
          f"{'peak GiB':>9s} {'packed is':>10s} {'/ dense':>8s}")
    for r in results:
        if r.get("oom"):
            print(f"{r['width']:6s} {r['lengths']:10s} {r['mode']:8s} out of memory")
            continue
        rows = r["rows_per_step"] or (f"/{r['micro_batches']}" if r["micro_batches"] and r["micro_batches"] > 1
                                      else "")
        print(f"{r['width']:6s} {r['lengths']:10s} {r['mode']:8s} {str(rows):>4s} {r['ms_per_step']:9.1f} "
              f"{r['tokens_per_s']:11,.0f} {r['peak_gib']:9.2f} {r.get('packed_is', float('nan')):9.3f}x "
              f"{r.get('over_dense', float('nan')):7.3f}x")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["width"], r["lengths"]) for r in results})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / len(MODES)
    for k, mode in enumerate(MODES):
        xs, tps, mem = [], [], []
        for g, (width, lens) in enumerate(groups):
            r = next((r for r in results if (r["width"], r["lengths"], r["mode"]) == (width, lens, mode)), None)
            if r is None or r.get("oom"):
                continue
            xs.append(g + (k - (len(MODES) - 1) / 2) * w)
            tps.append(r["tokens_per_s"])
            mem.append(r["peak_gib"])
        ax1.bar(xs, tps, w, label=mode)
        ax2.bar(xs, mem, w, label=mode)
    for ax, title in ((ax1, "real tokens / s (log)"), (ax2, "peak memory (GiB)")):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{a}\n{b}" for a, b in groups])
        ax.set_title(title)
    ax1.set_yscale("log")
    fig.legend(MODES, loc="upper center", ncol=len(MODES), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--widths", default="1.4b,2.8b", help=f"comma list of {sorted(WIDTHS)}")
    ap.add_argument("--lengths", default="gsm8k,lognormal", help="comma list of gsm8k, lognormal")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--capacity", type=int, default=4096, help="tokens per packed row")
    ap.add_argument("--rows", type=int, default=0, help="packed rows per step (0: 4 at 1.4B, 2 at 2.8B)")
    ap.add_argument("--pad-batch", type=int, default=16, help="sequences per padded batch")
    ap.add_argument("--layers", type=int, default=0, help="override the depth (0: the width's own)")
    ap.add_argument("--vocab", type=int, default=50277, help="vocabulary (GPT-NeoX-20B; padded to 50280)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (packed, dense, padded)")
    ap.add_argument("--single-steps", type=int, default=40, help="timed steps of the single mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    ap.add_argument("--lognormal-n", type=int, default=20000, help="lognormal sequences drawn")
    ap.add_argument("--gsm8k-lengths", default=None, help=".npy of GSM8K lengths (else tokenized from ../shared)")
    ap.add_argument("--write-gsm8k-lengths", default=None, help="tokenize GSM8K, write the lengths here, exit")
    ap.add_argument("--saved-tensors", action="store_true", help="also list what packed/dense keep for backward")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then profile this many steps of packed and dense: GPU time by kernel and kind")
    ap.add_argument("--seed", type=int, default=0, help="data and init seed")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="draw the table as a bar chart (PNG) here")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: merge these result files (one device), print the table, write --out / --plot")
    args = ap.parse_args(argv)
    args.lengths = args.lengths.split(",")
    if args.merge:
        parts = [json.load(open(f)) for f in args.merge]
        if len({p["device_name"] for p in parts}) != 1:
            raise SystemExit("--merge: the files come from different devices: " + ", ".join(args.merge))
        out = dict(parts[0], results=[r for p in parts for r in p["results"]],
                   saved_tensors=[s for p in parts for s in p.get("saved_tensors", [])], merged_from=args.merge)
        print(f"{out['device_name']}, torch {out['torch']}, {out['date']}")
        print_table(out["results"])
        print_profiles(out["results"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=2)
        if args.plot:
            plot(out["results"], args.plot)
        return out
    if args.write_gsm8k_lengths:
        lens = gsm8k_lengths(os.path.join(SHARED, "gsm8k_train.jsonl"),
                             os.path.join(SHARED, "gpt-neox-20b-tokenizer.json"))
        np.save(args.write_gsm8k_lengths, lens)
        print(f"GSM8K: {len(lens)} sequences, {int(lens.sum())} tokens, mean {lens.mean():.1f}, max {lens.max()}")
        return None

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (mamba-ssm's model and kernels)")
    device = torch.device("cuda")
    all_lengths = load_lengths(args)
    results, saved = [], []
    for width in args.widths.split(","):
        for name, lengths in all_lengths.items():
            for mode in args.modes.split(","):
                r = run_mode(mode, width, lengths, args, device)
                r.update(width=width, lengths=name)
                results.append(r)
                print(f"  {width} {name} {mode}: " + (
                    "out of memory" if r.get("oom") else
                    f"{r['tokens_per_s']:,.0f} tok/s, peak {r['peak_gib']:.2f} GiB"), flush=True)
        if args.saved_tensors:
            name = next(iter(all_lengths))
            for mode in ("packed", "dense"):
                s = saved_tensors(mode, width, all_lengths[name], args, device)
                s.update(width=width, lengths=name)
                saved.append(s)
                print(f"  saved for backward, {width} {mode}: {s['saved_unique_gib']:.2f} GiB unique "
                      f"({s['held_after_forward_gib']:.2f} GiB held after the forward); largest:")
                for e in s["saved"][:12]:
                    print(f"    {e['count']:4d} x {str(e['shape']):24s} {e['dtype']:9s} {e['mib']:10.1f} MiB")
    add_ratios(results)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, capacity {args.capacity}, "
          f"padded batches of {args.pad_batch}; 'packed is' = packed tok/s / this mode's tok/s; '/ dense' = this "
          "mode's tok/s / dense's")
    print_table(results)
    print_profiles(results)
    lens_info = {k: {"n": int(len(v)), "tokens": int(v.sum()), "mean": float(v.mean()), "max": int(v.max())}
                 for k, v in all_lengths.items()}
    out = {"bench": "bench_train", "args": vars(args), "device_name": torch.cuda.get_device_name(),
           "torch": torch.__version__, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
           "lengths": lens_info, "results": results, "saved_tensors": saved}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return out


if __name__ == "__main__":
    main()
