"""Long documents: ``overflow="carry"`` (the Mamba state carried across the pieces of a document) against
``overflow="split"`` (every piece from a zero state), what it costs and whether it helps.

Three parts, each printed as a table and written to the JSON (``--parts``):

``kernels``   the packed scan, forward + backward, at the bench_ops shape (B=8, D=4096, L=4096, bf16): the plain
              kernels, the states variant with no state used (a batch without continuations that still passes the
              state arguments), and with one carried piece per row. GPU only.
``cost``      tokens/s of training steps (forward, loss, backward, AdamW) of a residual stack of ``ops.PackedMamba``
              layers (embedding, RMS norms, tied head) at the 1.4B width on documents of 16k-64k tokens packed at
              capacity 4096 by ``PackedDataLoader`` with ``overflow="carry"``: the same batches run with the carry
              keys (``ops.StateCache``) and without them (= ``overflow="split"``: the same rows, every piece from
              zero), and the split rows through the unfused mixer the carry path composes (``split_composed``: what
              the composition costs before any state is carried). GPU only.
``learning``  a small model trained on a synthetic recall task whose answer lies beyond the first row: each document
              is ``[key k, filler ..., QUERY, k]``; only a model that carries the state across the cut can know ``k``
              at the end. The same rows and initial weights in both modes; held-out documents are then run whole,
              and the loss by position in the document is compared (PNG). Runs on the CPU (reference kernels) at a
              small size, on the GPU at a larger one.

    python benchmarks/bench_long_context.py --out benchmarks/results/long_context/long_context.json \\
        --plot benchmarks/results/long_context/loss_by_position.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ops  # noqa: E402
from ops.carry import CARRY_KEYS  # noqa: E402

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------------------------
# the model: embedding, residual PackedMamba blocks with RMS norms, tied head

class LM(nn.Module):
    def __init__(self, vocab, d_model, n_layer, d_state=16, dtype=None, device=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model, device=device, dtype=dtype)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, device=device, dtype=dtype) for _ in range(n_layer))
        self.mixers = nn.ModuleList(ops.PackedMamba(d_model, d_state=d_state, layer_idx=i, device=device, dtype=dtype)
                                    for i in range(n_layer))
        self.norm_f = nn.RMSNorm(d_model, device=device, dtype=dtype)

    def forward(self, ids, position_ids, carry=None):
        h = self.emb(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), position_ids=position_ids, carry=carry)
        return F.linear(self.norm_f(h), self.emb.weight)


def token_losses(logits, labels):
    """Per-token loss of predicting ``labels[t + 1]`` from ``logits[t]`` (the loader's labels are the inputs, the
    model shifts; -100 at every segment start, so no row predicts across a boundary); (batch, L - 1)."""
    lab = labels[:, 1:]
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), lab.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(lab.shape)


# --------------------------------------------------------------------------------------------------------------
# data: documents in an Arrow shard, served by PackedDataLoader(overflow="carry")

def write_shard(path, docs):
    import pyarrow as pa
    arr = pa.ListArray.from_arrays(pa.array(np.cumsum([0] + [len(d) for d in docs]), pa.int32()),
                                   pa.array(np.concatenate(docs).astype(np.int32)))
    table = pa.table({"input_ids": arr})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    return path


def carry_loader(path, capacity, batch_size, seed, one_piece_per_step=False):
    from packloader import PackedDataLoader
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the "cut into chains" notice
        return PackedDataLoader(path, capacity=capacity, batch_size=batch_size, shuffle=True, seed=seed,
                                algorithm="bfd", overflow="carry", carry_one_piece_per_step=one_piece_per_step)


def to_device(batch, device):
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in CARRY_KEYS else v)
            for k, v in batch.items()}


# --------------------------------------------------------------------------------------------------------------
# part 1: the scan kernels with and without states

def kernel_cases(device, b=8, d=4096, n=16, L=4096):
    """The scan's inputs at the bench_ops shape (bf16, z, two sequences a row) and the three cases: ``{name:
    (forward extra args, backward extra args)}`` after ``(u, delta, A, B, C, D, z, delta_bias, pos, True)``
    (forward) and ``(..., saved, dout, False)`` (backward). Also what ``benchmarks/gpu/profile_states.sh`` profiles.
    Returns ``(args, dout, cases)``."""
    from ops.states import state_slots
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    u = torch.randn(b, d, L, device=device, generator=g).to(dt)
    delta = (0.5 * torch.randn(b, d, L, device=device, generator=g) - 1).to(dt)
    A = -torch.exp(0.5 * torch.randn(d, n, device=device, generator=g))
    B = torch.randn(b, n, L, device=device, generator=g).to(dt)
    C = torch.randn(b, n, L, device=device, generator=g).to(dt)
    D, z, db = torch.randn(d, device=device), torch.randn(b, d, L, device=device).to(dt), torch.randn(d, device=device)
    pos = torch.arange(L, device=device, dtype=torch.int32).repeat(b, 1)
    pos[:, 1000] = 0   # two sequences a row; the second continues in the next step
    pos[:, 1000:] = torch.arange(L - 1000, device=device)
    count = int((pos == 0).sum())
    h0 = torch.randn(count, d, n, device=device)
    none = state_slots(pos, torch.zeros(count, dtype=torch.bool, device=device), False)
    one = state_slots(pos, torch.arange(count, device=device) % 2 == 0, True)   # each row's first piece continues
    dout = torch.randn_like(u)
    cases = {
        "plain": ((), ()),
        "states, none used": ((none, h0, 0), (none, h0, None)),
        "states, a carried piece a row": ((one, h0, count), (one, h0, torch.randn(count, d, n, device=device))),
    }
    return (u, delta, A, B, C, D, z, db, pos, True), dout, cases


def part_kernels(args, device):
    args_, dout, cases = kernel_cases(device)

    def fwd_bwd(extra, bwd_extra):
        out, saved, _ = torch.ops.packloader.selective_scan_fwd(*args_, *extra)
        torch.ops.packloader.selective_scan_bwd(*args_, saved, dout, False, *bwd_extra)

    rows = []
    for name, (extra, bwd_extra) in cases.items():
        for _ in range(3):
            fwd_bwd(extra, bwd_extra)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.kernel_reps):
            t = time.perf_counter()
            fwd_bwd(extra, bwd_extra)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rows.append({"case": name, "ms": 1e3 * float(np.median(times))})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_plain"] = r["ms"] / base
    print("\nscan forward + backward, B=8 D=4096 L=4096 bf16 (median of %d)" % args.kernel_reps)
    print(f"{'case':32s} {'ms':>8s} {'x plain':>8s}")
    for r in rows:
        print(f"{r['case']:32s} {r['ms']:8.3f} {r['vs_plain']:8.3f}")
    return rows


# --------------------------------------------------------------------------------------------------------------
# part 2: training-step throughput, carry against split

def part_cost(args, device):
    rng = np.random.default_rng(0)
    lens = rng.integers(16384, 65537, args.cost_docs)
    docs = [rng.integers(0, args.vocab, int(k)).astype(np.int32) for k in lens]
    tmp = tempfile.mkdtemp()
    path = write_shard(os.path.join(tmp, "docs.arrow"), docs)
    schedules = {}
    for one in (False, True):   # pieces chained inside a step (default) / one piece of a document a step
        schedules[one] = []
        for batch in carry_loader(path, args.capacity, args.rows, 0, one_piece_per_step=one):
            schedules[one].append(batch)
            if len(schedules[one]) >= args.cost_steps + args.warmup:
                break
    torch.manual_seed(0)
    model = LM(args.vocab, args.d_model, args.layers, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    results = {}
    # "_1": the batches of carry_one_piece_per_step=True (every continuation from the cache: truncated backprop)
    modes = ("split", "split_composed", "carry", "split_1", "carry_1")
    for mode in modes:
        for mixer in model.mixers:   # split_composed: the split rows through the unfused mixer the carry path uses
            mixer.use_fast_path = mode != "split_composed"
        try:
            results[mode] = _time_mode(mode.removesuffix("_1"), model, opt, schedules[mode.endswith("_1")], args,
                                       device, trace_label=f"cost_{mode}" if args.trace_dir else None)
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            results[mode] = {"tokens_per_s": float("nan"), "steps": 0, "peak_gb": float("nan"),
                             "batches_with_continuations": 0, "oom": True}
    results["carry_over_split"] = results["carry"]["tokens_per_s"] / results["split"]["tokens_per_s"]
    results["carry_1_over_split_1"] = results["carry_1"]["tokens_per_s"] / results["split_1"]["tokens_per_s"]
    print(f"\ntraining steps, d_model {args.d_model}, {args.layers} layers, {args.rows} rows of {args.capacity}, "
          f"documents of 16k-64k tokens")
    print(f"{'mode':14s} {'tokens/s':>10s} {'peak GB':>8s} {'steps':>6s} {'carried':>8s}")
    for mode in modes:
        r = results[mode]
        print(f"{mode:14s} {r['tokens_per_s']:10.0f} {r['peak_gb']:8.1f} {r['steps']:6d} "
              f"{r['batches_with_continuations']:8d}" + ("  (out of memory)" if r.get("oom") else ""))
    print(f"carry / split: {results['carry_over_split']:.3f} (pieces chained in a step); "
          f"{results['carry_1_over_split_1']:.3f} (one piece of a document a step, state from the cache)")
    return results


def _time_mode(mode, model, opt, batches, args, device, trace_label=None):
    """Timed training steps over ``batches``, with the carry keys (``carry``) or without (``split``)."""
    cache = ops.StateCache()
    torch.cuda.reset_peak_memory_stats()
    tokens, elapsed = 0, 0.0
    carried, summary = 0, None
    for i, batch in enumerate(batches):
        bd = to_device(batch, device)
        carry = cache.step(batch) if mode == "carry" else None
        carried += int(carry.has_continuations) if carry is not None else 0
        def train_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(bd["input_ids"], bd["position_ids"], carry=carry)
            loss = token_losses(logits, bd["labels"]).sum() / max(int(batch["num_loss_tokens"]), 1)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if trace_label and i == args.warmup - 1:   # the last warm-up step, profiled (not timed)
            from _trace import trace_call
            summary = trace_call(train_step, os.path.join(args.trace_dir, trace_label + ".json.gz"), trace_label,
                                 top=args.trace_top, cpu_top=args.trace_top)
            print("  trace " + ", ".join(f"{k} {v}" for k, v in summary.items()
                                         if k not in ("top_kernels", "top_host_ops")), flush=True)
            for name, ms, n in summary.get("top_kernels", []) + summary.get("top_host_ops", []):
                print(f"    {ms:9.3f} ms {n:6d}  {name}")
            continue
        torch.cuda.synchronize()
        t = time.perf_counter()
        train_step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            elapsed += time.perf_counter() - t
            tokens += int(bd["input_ids"].numel())
    return {**({"trace": summary} if trace_label else {}),
            "tokens_per_s": tokens / elapsed, "steps": len(batches) - args.warmup,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "batches_with_continuations": carried}


# --------------------------------------------------------------------------------------------------------------
# part 3: does carrying help? a recall task whose answer lies beyond the first row

RECALL_KEYS = 4   # key tokens a document starts with and ends by recalling


def recall_docs(n, rng, vocab, min_len, max_len, n_keys):
    """``[k1 .. k4, filler ..., QUERY, k1 .. k4]``: keys drawn from tokens 2 .. n_keys + 1, QUERY is token 1, the
    filler a counting cycle over the other tokens from a random offset (learnt quickly, so the training signal left is
    the recall, which needs the document's start)."""
    docs = []
    span = vocab - n_keys - 2
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        keys = rng.integers(2, n_keys + 2, RECALL_KEYS)
        filler = n_keys + 2 + (int(rng.integers(span)) + np.arange(length - 2 * RECALL_KEYS - 1)) % span
        docs.append(np.concatenate([keys, filler, [1], keys]).astype(np.int32))
    return docs


def part_learning(args, device):
    dtype = torch.float32
    rng = np.random.default_rng(args.seed)
    train = recall_docs(args.train_docs, rng, args.l_vocab, args.l_min, args.l_max, args.n_keys)
    held = recall_docs(args.eval_docs, rng, args.l_vocab, args.l_min, args.l_max, args.n_keys)
    tmp = tempfile.mkdtemp()
    path = write_shard(os.path.join(tmp, "recall.arrow"), train)
    torch.manual_seed(args.seed)
    init = LM(args.l_vocab, args.l_d_model, args.l_layers, d_state=16, device=device, dtype=dtype).state_dict()
    out = {}
    for mode in ("split", "carry"):
        model = LM(args.l_vocab, args.l_d_model, args.l_layers, d_state=16, device=device, dtype=dtype)
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        cache = ops.StateCache()
        steps, losses = 0, []
        t0 = time.perf_counter()
        while steps < args.l_steps:
            for batch in carry_loader(path, args.l_capacity, args.l_rows, steps):
                bd = to_device(batch, device)
                carry = cache.step(batch) if mode == "carry" else None
                loss = token_losses(model(bd["input_ids"], bd["position_ids"], carry=carry), bd["labels"]).sum()
                loss = loss / max(int(batch["num_loss_tokens"]), 1)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                steps += 1
                if steps >= args.l_steps:
                    break
        train_s = time.perf_counter() - t0
        # held-out documents, each run whole (one sequence a row): the loss at every position
        by_pos = np.zeros(args.l_max)
        count = np.zeros(args.l_max)
        answer = []
        model.eval()
        with torch.no_grad():
            for d in held:
                ids = torch.as_tensor(d, dtype=torch.long, device=device)[None]
                logits = model(ids, torch.arange(len(d), device=device)[None])
                tl = token_losses(logits, ids)[0].cpu().numpy()   # tl[t]: predicting token t + 1
                by_pos[:len(tl)] += tl
                count[:len(tl)] += 1
                answer.append(float(tl[-RECALL_KEYS:].mean()))   # predicting k1 .. k4 after QUERY
        cap = args.l_capacity
        beyond = by_pos[cap:].sum() / max(count[cap:].sum(), 1)
        first = by_pos[:cap].sum() / max(count[:cap].sum(), 1)
        out[mode] = {"train_loss_last20": float(np.mean(losses[-20:])), "heldout_answer_loss": float(np.mean(answer)),
                     "heldout_answer_acc_proxy": float(np.mean(np.exp(-np.array(answer)))),
                     "heldout_loss_first_row": float(first), "heldout_loss_beyond_first_row": float(beyond),
                     "loss_by_position": (by_pos / np.maximum(count, 1)).tolist(), "train_s": train_s,
                     "steps": steps}
    out["chance_answer_loss"] = math.log(args.n_keys)
    print(f"\nrecall task: documents of {args.l_min}-{args.l_max} tokens, rows of {args.l_capacity}, {args.n_keys} keys, "
          f"{args.l_steps} steps of {args.l_rows} rows, held-out {args.eval_docs} documents run whole")
    print(f"{'mode':6s} {'train (last 20)':>15s} {'answer loss':>12s} {'loss row 1':>11s} {'loss beyond':>12s}")
    for mode in ("split", "carry"):
        r = out[mode]
        print(f"{mode:6s} {r['train_loss_last20']:15.4f} {r['heldout_answer_loss']:12.4f} "
              f"{r['heldout_loss_first_row']:11.4f} {r['heldout_loss_beyond_first_row']:12.4f}")
    print(f"chance answer loss: log({args.n_keys}) = {out['chance_answer_loss']:.4f}")
    return out


def plot(learning, capacity, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in (("split", "tab:red"), ("carry", "tab:blue")):
        y = np.array(learning[mode]["loss_by_position"])
        k = 16
        ys = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(ys)) + k // 2, ys, color=color, label=f"overflow='{mode}'")
    ax.axvline(capacity, color="gray", ls="--", lw=1, label="row capacity (first cut)")
    ax.set_xlabel("position in the document")
    ax.set_ylabel("held-out loss (16-token mean)")
    ax.set_title("recall task: the answer needs the start of the document")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--parts", default="kernels,cost,learning")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--trace-dir", default=None, help="cost: profile each mode's last warm-up step (Chrome traces "
                    "there; the summaries printed and in the JSON)")
    ap.add_argument("--trace-top", type=int, default=0, help="with --trace-dir: list the kernels and the host-side operators with the most time")
    ap.add_argument("--plot", default=None, help="PNG of the held-out loss by position")
    ap.add_argument("--kernel-reps", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=2048, help="cost: model width (1.4B: 2048)")
    ap.add_argument("--layers", type=int, default=48, help="cost: depth (1.4B: 48)")
    ap.add_argument("--vocab", type=int, default=50280)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4, help="cost: rows per step")
    ap.add_argument("--cost-docs", type=int, default=16)
    ap.add_argument("--cost-steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--l-vocab", type=int, default=64)
    ap.add_argument("--n-keys", type=int, default=8)
    ap.add_argument("--l-d-model", type=int, default=64)
    ap.add_argument("--l-layers", type=int, default=2)
    ap.add_argument("--l-capacity", type=int, default=64)
    ap.add_argument("--l-min", type=int, default=100)
    ap.add_argument("--l-max", type=int, default=240)
    ap.add_argument("--l-rows", type=int, default=8)
    ap.add_argument("--l-steps", type=int, default=300)
    ap.add_argument("--train-docs", type=int, default=2000)
    ap.add_argument("--eval-docs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = [p for p in args.parts.split(",") if p]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "args": vars(args), "date": time.strftime("%Y-%m-%d")}
    if "kernels" in parts and device.type == "cuda":
        result["kernels"] = part_kernels(args, device)
    if "cost" in parts and device.type == "cuda":
        result["cost"] = part_cost(args, device)
    if "learning" in parts:
        result["learning"] = part_learning(args, device)
        if args.plot:
            plot(result["learning"], args.l_capacity, args.plot)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
