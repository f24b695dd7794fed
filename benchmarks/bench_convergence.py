"""Proof of learning: does a packed model learn what a padded one learns?

The same model, from the same initial weights, trained on the same examples in every step, in four modes:

``padded``   each example its own row, right-padded to the longest of the step, loss masked on the padding (the
             usual way to batch variable-length data; the yardstick)
``packed``   the step's examples packed best-fit (``packer_algos``) into rows of ``--capacity`` tokens and collated
             by ``packloader.collate_packed``; the model converted by ``ops.enable_packing`` resets its conv and
             scan at every ``position_ids == 0`` (packloader)
``naive``    the same packed rows WITHOUT boundaries: one sequence per row, so every example sees the examples
             packed before it (what packing without packloader does; the loss is still masked at each start)
``hf``       the Hugging Face path: ``packloader.hf.PackedTrainer`` (transformers ``Trainer``) on a converted
             ``MambaForCausalLM``, fed by a ``PackedDataLoader`` over a pre-packed directory holding the packed
             mode's rows step by step (``packloader pack``); the same optimizer and schedule objects

How "the same examples per step" is kept: the list of examples of every step is fixed first (per seed), then each
mode lays those examples out its own way. Every mode records which examples each step held (for ``hf``: the rows the
Trainer was handed, matched against the packed rows), and the run checks they agree. The loss of a step is the mean
over the step's label tokens (summed token losses / label tokens, the same count in every mode); the Trainer's loss
is the same quantity (``num_items_in_batch``).

Seeds: each seed draws its own initial weights and its own order of examples; all modes of one seed share both.
The padded mode's seed-to-seed spread (the standard deviation over seeds of its windowed mean loss) is the yardstick
for the differences between modes. Held-out loss: ``--heldout`` examples (the same for every seed, never trained
on), each evaluated alone (its own row, right padding).

Model: mamba-ssm's ``MambaLMHeadModel`` (Mamba-1 mixers, RMS norms, residual in fp32, tied head) converted with
``ops.enable_packing`` when ``mamba_ssm`` imports; otherwise transformers' ``MambaForCausalLM`` with the same
configuration (12 layers, d_model 768 at ``--size gpu``). The ``hf`` mode always trains a ``MambaForCausalLM``;
with mamba-ssm it starts from mamba-ssm's initial weights (the names map one to one). Without mamba-ssm, every
mode passes ``position_ids`` (``padded``: 0..L-1 per row, ``naive``: 0..capacity-1 per row, the whole row one
sequence) so that all modes run the same kernels (transformers' own path loops over tokens in Python); with
mamba-ssm, ``padded`` and ``naive`` run mamba-ssm's own forward (no boundaries). AdamW (no weight decay on
``A_log``, ``D``, biases and norms), linear warm-up then cosine decay to 10 %, gradient clipping at 1.0, bf16
autocast on a GPU (float32 on the CPU).

Data: GSM8K (question + "\\n" + answer + end-of-text) tokenized with the GPT-NeoX-20B tokenizer, from
``--data-dir`` (``gsm8k_train.jsonl`` and ``gpt-neox-20b-tokenizer.json``; default ``../shared/data`` when present),
else the 4,000-problem sample and the tokenizer embedded in ``packloader/data``.

Sizes:

``--size gpu``   84M parameters (12 layers, d_model 768, the full 50,280-token vocabulary), 32 examples a step, rows
                 of 2,048 tokens (3 rows a step), 80 steps, 3 seeds, 500 held-out examples: estimated at 3-4 minutes
                 on one H100 (printed before the run; a measured estimate is printed after the first seed)
``--size toy``   (``--smoke``) the first 200 problems, d_model 16, 2 layers, the 255 most frequent tokens (others
                 mapped to one), examples truncated to 64 tokens, 4 a step, rows of 128, 16 steps, 3 seeds: about
                 10-20 s on a CPU

Outputs (``--out-dir``; default ``benchmarks/results/convergence`` at ``--size gpu``, a temporary folder at
``--size toy``): ``convergence.json`` (settings, per mode and seed the loss of every step, the held-out loss, wall
time, the examples of every step; the comparison with the yardstick) and ``loss_curves.png`` (top: windowed loss
per mode, mean over seeds, with the padded seed band; bottom: each mode minus padded, same seed, against the band).

    python benchmarks/bench_convergence.py                      # the GPU run (prints its expected runtime)
    python benchmarks/bench_convergence.py --smoke              # the toy, on the CPU
    python benchmarks/bench_convergence.py --data-dir .bench_data/gsm8k   # where ../shared is not available
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IGNORE_INDEX = -100
MODES = ("padded", "packed", "naive", "hf")
MODE_TITLES = {
    "padded": "padded to the longest, one example a row",
    "packed": "packed (packloader, boundaries respected)",
    "naive": "packed without boundaries (neighbours seen)",
    "hf": "Hugging Face PackedTrainer (converted MambaForCausalLM)",
}
SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
GSM8K_FILE = "gsm8k_train.jsonl"
TOKENIZER_FILE = "gpt-neox-20b-tokenizer.json"
HELDOUT_SEED = 12345  # the held-out examples do not depend on the run's seeds

SIZES = {
    # model, data layout, optimisation; every entry is a command-line option of the same name (dashes)
    "gpu": dict(d_model=768, layers=12, d_state=16, vocab=50280, limit=0, max_len=0, examples_per_step=32,
                capacity=2048, steps=80, seeds="0,1,2", heldout=500, lr=1e-3, warmup=8, weight_decay=0.1, last_k=20,
                window=10, eval_batch=32),
    "toy": dict(d_model=16, layers=2, d_state=8, vocab=256, limit=200, max_len=64, examples_per_step=4, capacity=128,
                steps=16, seeds="0,1,2", heldout=16, lr=1e-2, warmup=2, weight_decay=0.1, last_k=5, window=4,
                eval_batch=16),
}
# seconds per step of each mode measured on 2026-11-26 (H200, mamba-ssm, 16 examples a step, rows of 1024),
# scaled to --examples-per-step: the prior of the runtime estimate printed before the run
PRIOR_S_PER_EXAMPLE_STEP = {"padded": 0.246 / 16, "packed": 0.065 / 16, "naive": 0.051 / 16, "hf": 0.09 / 16}


# --------------------------------------------------------------------------------------------------------------
# data: GSM8K examples, held-out set, the examples of every step

def data_files(data_dir):
    """``(jsonl, tokenizer, description)``: from ``data_dir`` (both files required), else ``../shared/data`` when it
    holds both, else the sample and the tokenizer embedded in ``packloader/data``."""
    from packloader.demo import CORPUS, TOKENIZER, data_path

    if data_dir is not None:
        paths = [os.path.join(data_dir, n) for n in (GSM8K_FILE, TOKENIZER_FILE)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise SystemExit(f"--data-dir {data_dir!r}: missing {', '.join(missing)} (copy {GSM8K_FILE} and "
                             f"{TOKENIZER_FILE} from ../shared/data)")
        return paths[0], paths[1], f"GSM8K train ({data_dir})"
    shared = [os.path.join(SHARED_DATA, n) for n in (GSM8K_FILE, TOKENIZER_FILE)]
    if all(os.path.isfile(p) for p in shared):
        return shared[0], shared[1], "GSM8K train (../shared/data)"
    return data_path(CORPUS), data_path(TOKENIZER), "GSM8K sample of 4,000 problems (packloader/data)"


def load_examples(jsonl, tokenizer, *, mask_prompt=False, max_len=0, limit=0):
    """GSM8K records tokenized as ``packloader prepare`` does (``question + "\\n" + answer + EOS``).

    Args:
        jsonl: GSM8K JSONL (optionally ``.gz``) with ``question`` and ``answer``.
        tokenizer: a ``tokenizer.json`` (optionally ``.gz``).
        mask_prompt: label the question -100 (loss on the answer only). Default: loss on every token.
        max_len: truncate every example to its first ``max_len`` tokens (0: keep them whole).
        limit: read only the first ``limit`` records (0: all).

    Returns:
        a list of ``(input_ids, labels)`` int64 arrays, one pair per record, in file order.
    """
    from packloader.prepare import find_eos_id, load_tokenizer, tokenize_records

    opener = gzip.open if jsonl.endswith(".gz") else open
    with opener(jsonl, "rt", encoding="utf-8") as f:
        records = []
        for line in f:
            if line.strip():
                records.append(json.loads(line))
                if limit and len(records) >= limit:
                    break
    tok = load_tokenizer(tokenizer)
    offsets, tokens, labels = tokenize_records(tok, [[r["question"], r["answer"]] for r in records],
                                               eos_id=find_eos_id(tok), mask_prompt=mask_prompt)
    labels = tokens if labels is None else labels
    out = []
    for i in range(len(records)):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if max_len:
            hi = min(hi, lo + max_len)
        out.append((tokens[lo:hi].astype(np.int64), labels[lo:hi].astype(np.int64)))
    return out


def compact_vocab(examples, vocab):
    """Map token ids to a vocabulary of ``vocab`` entries (toy size): the ``vocab - 1`` most frequent tokens keep
    an id of their own (by rank: 0 the most frequent), every other token becomes ``vocab - 1``. Labels -100 stay.

    Example: tokens ``[7, 7, 9, 9, 9, 3]`` with ``vocab=3`` -> ``[1, 1, 0, 0, 0, 2]`` (9 and 7 ranked, 3 mapped to
    the shared id; ties go to the smaller id).

    Args:
        examples: ``(input_ids, labels)`` int64 array pairs.
        vocab: the size of the compact vocabulary (>= 2)."""
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2 to compact a vocabulary, got {vocab}")
    ids = np.concatenate([x for x, _ in examples])
    uniq, counts = np.unique(ids, return_counts=True)
    ranked = uniq[np.lexsort((uniq, -counts))]
    table = np.full(int(ids.max()) + 1, vocab - 1, np.int64)
    keep = ranked[:vocab - 1]
    table[keep] = np.arange(len(keep))
    out = []
    for x, y in examples:
        y2 = np.where(y == IGNORE_INDEX, IGNORE_INDEX, table[np.where(y == IGNORE_INDEX, 0, y)])
        out.append((table[x], y2))
    return out


def step_examples(n_examples, *, heldout, steps, per_step, seed):
    """The held-out examples (the same for every seed) and the examples of every training step of ``seed``.

    Args:
        n_examples: examples available.
        heldout: examples set aside for the held-out loss (drawn with a fixed generator, not ``seed``).
        steps: training steps.
        per_step: examples per step.
        seed: draws the order of the remaining examples; no example repeats within a run.

    Returns:
        ``(heldout_ids int64 [heldout], steps list of int64 arrays [per_step])``.
    """
    need = heldout + steps * per_step
    if need > n_examples:
        raise SystemExit(f"--steps {steps} x --examples-per-step {per_step} + --heldout {heldout} = {need} examples, "
                         f"but the data holds {n_examples}; lower one of them")
    perm = np.random.default_rng(HELDOUT_SEED).permutation(n_examples)
    held, pool = np.sort(perm[:heldout]), np.sort(perm[heldout:])
    order = np.random.default_rng(seed).permutation(pool)[:steps * per_step]
    return held, [order[i * per_step:(i + 1) * per_step] for i in range(steps)]


# --------------------------------------------------------------------------------------------------------------
# layouts: the same examples, three ways (labels are the inputs, -100 at every sequence start; the model shifts)

def padded_batch(examples, ids):
    """One example per row, right-padded (id 0, label -100) to the longest: ``input_ids``, ``labels``,
    ``position_ids`` (0..L-1 in every row: right padding follows the example, which never sees it) int64 [n, L]."""
    seqs = [examples[i] for i in ids]
    longest = max(len(x) for x, _ in seqs)
    inp = np.zeros((len(seqs), longest), np.int64)
    lab = np.full((len(seqs), longest), IGNORE_INDEX, np.int64)
    for r, (x, y) in enumerate(seqs):
        inp[r, :len(x)] = x
        lab[r, 1:len(x)] = y[1:]   # the first token predicts nothing here, as in a packed row
    pos = np.broadcast_to(np.arange(longest), inp.shape).copy()
    return {"input_ids": torch.from_numpy(inp), "labels": torch.from_numpy(lab), "position_ids": torch.from_numpy(pos)}


def packed_rows(examples, ids, capacity):
    """The examples packed best-fit (``packer_algos.pack(..., "bfd")``, as ``packloader pack`` plans a shard) into
    rows of ``capacity`` tokens and collated by :func:`packloader.collate_packed`.

    Returns:
        ``(batch, row_examples)``: the batch dict (``input_ids``, ``labels``, ``position_ids``, ... int64
        [rows, capacity]) and, per row, the example ids it holds in order."""
    from packer_algos import pack
    from packloader import collate_packed

    lengths = np.array([len(examples[i][0]) for i in ids], np.int64)
    if lengths.max() > capacity:
        raise SystemExit(f"--capacity {capacity} is shorter than an example of {int(lengths.max())} tokens; raise it "
                         "or truncate the examples (--max-len)")
    plan = pack(lengths, capacity, "bfd")
    inp = np.zeros((plan.n_bins, capacity), np.int32)
    lab = np.full((plan.n_bins, capacity), IGNORE_INDEX, np.int32)
    seq_lens, offsets, row_examples = [], [0], []
    for r in range(plan.n_bins):
        items, _, lens = plan.bin(r)
        col, row = 0, []
        for k, n in zip(items.tolist(), lens.tolist()):
            x, y = examples[ids[k]]
            inp[r, col:col + n], lab[r, col:col + n] = x, y
            col += n
            row.append(int(ids[k]))
            seq_lens.append(n)
        offsets.append(len(seq_lens))
        row_examples.append(row)
    batch = collate_packed(inp, lab, np.array(offsets, np.int64), np.array(seq_lens, np.int32))
    return batch, row_examples


def row_key(input_ids, labels, position_ids):
    """A digest of one row (the three tensors' values): how the rows the Trainer was handed are matched."""
    h = hashlib.blake2b(digest_size=12)
    for t in (input_ids, labels, position_ids):
        h.update(np.ascontiguousarray(t.cpu().numpy().astype(np.int64)).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# models

def have_mamba_ssm():
    try:
        import mamba_ssm  # noqa: F401
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # noqa: F401
        return True
    except Exception:
        return False


def have_transformers():
    try:
        import accelerate  # noqa: F401  (Trainer needs it)
        import transformers  # noqa: F401
        return True
    except Exception:
        return False


def choose_backend(requested, device):
    """``auto``: mamba-ssm's model on a GPU where it imports, else transformers' ``MambaForCausalLM`` where
    transformers (and accelerate) import, else the project's own modules (:class:`OpsLM`)."""
    if requested == "auto":
        if device.type == "cuda" and have_mamba_ssm():
            return "mamba_ssm"
        return "hf" if have_transformers() else "ops"
    if requested == "mamba_ssm" and not have_mamba_ssm():
        raise SystemExit("--backend mamba_ssm: mamba_ssm does not import here")
    if requested == "hf" and not have_transformers():
        raise SystemExit("--backend hf: transformers (and accelerate) do not import here")
    return requested


class OpsLM(nn.Module):
    """The project's own Mamba LM (``--backend ops``, or when neither mamba-ssm nor transformers imports):
    embedding, pre-norm residual ``ops.PackedMamba`` blocks with RMS norms, a final norm and the tied head.

    Example::

        model = OpsLM(vocab=256, d_model=16, n_layer=2, d_state=8)
        logits = model(input_ids, position_ids=position_ids).logits     # [B, L, vocab]

    Args:
        vocab: vocabulary size.
        d_model: width.
        n_layer: Mamba blocks.
        d_state: SSM state size.
        device: where the parameters are made.
    """

    def __init__(self, vocab, d_model, n_layer, d_state, device=None):
        import ops

        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model, device=device)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=1e-5, device=device) for _ in range(n_layer))
        self.mixers = nn.ModuleList(ops.PackedMamba(d_model, d_state=d_state, layer_idx=i, device=device)
                                    for i in range(n_layer))
        self.norm_f = nn.RMSNorm(d_model, eps=1e-5, device=device)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, input_ids, position_ids=None):
        h = self.embedding(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), position_ids=position_ids)

        class Out:
            pass

        out = Out()
        out.logits = F.linear(self.norm_f(h), self.embedding.weight)
        return out


def build_ops(args, device):
    return OpsLM(args.vocab, args.d_model, args.layers, args.d_state, device=device)


def build_mamba_ssm(args, device):
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    cfg = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=args.vocab,
                      ssm_cfg={"layer": "Mamba1", "d_state": args.d_state}, rms_norm=True, residual_in_fp32=True,
                      fused_add_norm=True, pad_vocab_size_multiple=8)
    return MambaLMHeadModel(cfg, device=device, dtype=torch.float32)


def build_hf(args, device):
    import transformers

    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
                                   state_size=args.d_state, expand=2, conv_kernel=4, use_bias=False,
                                   use_conv_bias=True, residual_in_fp32=True, layer_norm_epsilon=1e-5,
                                   tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    with torch.device(device):   # initialised where it runs (the weights are replaced by the run's anyway)
        return transformers.MambaForCausalLM(cfg)


def hf_state_from_mamba_ssm(state):
    """mamba-ssm ``MambaLMHeadModel`` weights under transformers' ``MambaForCausalLM`` names (only the embedding
    differs: ``backbone.embedding`` -> ``backbone.embeddings``)."""
    return {("backbone.embeddings." + k[len("backbone.embedding."):] if k.startswith("backbone.embedding.") else k): v
            for k, v in state.items()}


def new_model(kind, args, init, device):
    """A converted model (``ops.enable_packing``) of ``kind`` (``"mamba_ssm"``, ``"hf"`` or ``"ops"``, whose
    ``PackedMamba`` layers need no conversion) holding ``init``."""
    import ops

    model = BUILDERS[kind](args, device)
    missing, unexpected = model.load_state_dict(init, strict=False)
    tied = {"lm_head.weight"}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"initial weights do not fit the {kind} model: missing {missing}, unexpected {unexpected}")
    return (model if kind == "ops" else ops.enable_packing(model)).train()


BUILDERS = {"mamba_ssm": build_mamba_ssm, "hf": build_hf, "ops": build_ops}


def make_optimizer(model, args):
    """AdamW, weight decay on the matrices except ``A_log`` (mamba-ssm's rule), and a schedule: linear warm-up over
    ``--warmup`` steps, then cosine down to 10 % of ``--lr`` at ``--steps``."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith("A_log") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def factor(step):
        if step < args.warmup:
            return (step + 1) / (args.warmup + 1)
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def summed_loss(logits, labels):
    """Summed cross-entropy of predicting ``labels[:, t + 1]`` from ``logits[:, t]`` (float32)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def forward_logits(model, batch, boundaries):
    """``boundaries``: pass ``position_ids`` (the packed path); else the model's own forward (mamba-ssm)."""
    if boundaries:
        return model(batch["input_ids"], position_ids=batch["position_ids"]).logits
    return model(batch["input_ids"]).logits


# --------------------------------------------------------------------------------------------------------------
# the modes

def layouts(examples, steps, capacity, backend):
    """CPU batches of every step for the three modes trained by our own loop, and what each step holds.

    Returns ``{mode: [(batch, boundaries, step_example_ids), ...]}``, plus ``"rows"``: the packed rows of each step
    (for the ``hf`` mode) and ``"label_tokens"`` per step."""
    out = {"padded": [], "packed": [], "naive": [], "rows": [], "label_tokens": []}
    own = backend != "mamba_ssm"   # without mamba-ssm every mode passes position_ids (the same kernels everywhere)
    for ids in steps:
        pad = padded_batch(examples, ids)
        packed, row_examples = packed_rows(examples, ids, capacity)
        n_pad, n_packed = int((pad["labels"][:, 1:] != IGNORE_INDEX).sum()), int(packed["num_loss_tokens"])
        if n_pad != n_packed:
            raise AssertionError(f"label tokens differ between layouts: padded {n_pad}, packed {n_packed}")
        naive = {k: packed[k] for k in ("input_ids", "labels")}
        naive["position_ids"] = torch.arange(capacity).expand_as(packed["input_ids"]).contiguous()
        out["padded"].append((pad, own, sorted(int(i) for i in ids)))
        out["packed"].append((packed, True, sorted(x for row in row_examples for x in row)))
        out["naive"].append((naive, own, sorted(x for row in row_examples for x in row)))
        out["rows"].append((packed, row_examples))
        out["label_tokens"].append(n_packed)
    return out


def train_own(model, batches, args, device):
    """Our training loop over ``batches`` (one per step); returns (losses per step, wall seconds, positions)."""
    opt, sched = make_optimizer(model, args)
    losses, positions = [], 0
    sync(device)
    t0 = time.perf_counter()
    for batch, boundaries, _ in batches:
        b = {k: batch[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "position_ids")}
        n = max(1, int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
        with autocast(device):
            logits = forward_logits(model, b, boundaries)
        loss = summed_loss(logits, b["labels"]) / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        positions += batch["input_ids"].numel()
    sync(device)
    wall = time.perf_counter() - t0
    return [float(x) for x in torch.stack(losses).cpu()], wall, positions


def write_step_shards(directory, rows_per_step, capacity):
    """Arrow token shards for the ``hf`` mode's pre-packed directory: per step, its examples in packed-row order
    (``step-NNNNN-a.arrow``; ``packloader pack`` plans each shard alone, best-fit, into the packed mode's rows), then
    ``step-NNNNN-b.arrow`` with filler rows (one full-length sequence each, every label -100: no loss) up to the
    steps' most rows, so that every step of the loader (fixed ``batch_size``) holds exactly one step."""
    import pyarrow as pa

    most = max(len(rows) for rows in rows_per_step)
    paths = []

    def write(path, seqs):
        off = np.cumsum([0] + [len(x) for x, _ in seqs]).astype(np.int32)
        ids = pa.ListArray.from_arrays(pa.array(off), pa.array(np.concatenate([x for x, _ in seqs]).astype(np.int32)))
        lab = pa.ListArray.from_arrays(pa.array(off), pa.array(np.concatenate([y for _, y in seqs]).astype(np.int32)))
        table = pa.table({"input_ids": ids, "labels": lab})
        with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
        paths.append(path)

    for s, rows in enumerate(rows_per_step):
        write(os.path.join(directory, f"step-{s:05d}-a.arrow"), [seq for row in rows for seq in row])
        if len(rows) < most:
            filler = (np.zeros(capacity, np.int64), np.full(capacity, IGNORE_INDEX, np.int64))
            write(os.path.join(directory, f"step-{s:05d}-b.arrow"), [filler] * (most - len(rows)))
    return paths, most


def hf_loader(lay, examples, capacity, seed, workdir):
    """The ``hf`` mode's data: the packed mode's rows written step by step as token shards
    (:func:`write_step_shards`), packed by ``packloader pack`` (``pack_dataset``) and read back by a
    ``PackedDataLoader`` (``shuffle=False``, one step of rows per batch).

    Args:
        lay: :func:`layouts`' output (its ``"rows"``: the packed batch and the examples of each row, per step).
        examples: the ``(input_ids, labels)`` pairs the rows' example ids index.
        capacity: tokens per row.
        seed: the loader's seed (unused without shuffling; recorded in its state).
        workdir: an empty folder for the shards and the pre-packed directory.

    Returns:
        ``(loader, expected, rows)``: the loader, ``{row digest (row_key): example ids of the row}`` for every
        packed row and the filler row (``[]``), and the rows per step."""
    from packloader import PackedDataLoader, collate_packed, pack_dataset

    filler = collate_packed(np.zeros((1, capacity), np.int32), np.full((1, capacity), IGNORE_INDEX, np.int32),
                            np.array([0, 1]), np.array([capacity], np.int32))
    # a filler row as the loader collates it: one sequence without a label
    expected = {row_key(filler["input_ids"][0], filler["labels"][0], filler["position_ids"][0]): []}
    rows_per_step = []
    for batch, row_examples in lay["rows"]:
        for r, ex in enumerate(row_examples):
            expected[row_key(batch["input_ids"][r], batch["labels"][r], batch["position_ids"][r])] = ex
        rows_per_step.append([[examples[i] for i in ex] for ex in row_examples])
    shards = os.path.join(workdir, "tokens")
    os.makedirs(shards)
    paths, rows = write_step_shards(shards, rows_per_step, capacity)
    packed_dir = os.path.join(workdir, "packed")
    pack_dataset(paths, packed_dir, capacity=capacity, algorithm="bfd", quiet=True, progress=False)
    loader = PackedDataLoader(packed_dir, batch_size=rows, shuffle=False, seed=seed, num_workers=0)
    if len(loader) != len(rows_per_step):
        raise AssertionError(f"the pre-packed directory gives {len(loader)} steps, not {len(rows_per_step)}")
    return loader, expected, rows


def train_hf(model, lay, examples, args, device, seed, workdir):
    """The ``hf`` mode: ``PackedTrainer`` on ``model`` (a converted ``MambaForCausalLM``), fed by
    :func:`hf_loader`. Returns (losses, wall seconds, positions, per step the sorted example ids of the rows the
    Trainer was handed (None for a step with a row that is none of the packed rows), checks)."""
    import transformers

    from packloader.hf import PackedTrainer

    transformers.logging.set_verbosity_error()
    loader, expected, rows = hf_loader(lay, examples, args.capacity, seed, workdir)
    seen, losses = [], []

    class Recording(PackedTrainer):
        def get_train_dataloader(self):
            inner = super().get_train_dataloader()

            class Batches:
                def __len__(self):
                    return len(inner)

                def set_epoch(self, epoch):
                    inner.set_epoch(epoch)

                def __iter__(self):
                    for b in inner:
                        ids = []
                        for r in range(b["input_ids"].shape[0]):
                            key = row_key(b["input_ids"][r], b["labels"][r], b["position_ids"][r])
                            row = expected.get(key)
                            ids.append(None if row is None else row)
                        seen.append(ids)
                        yield b
            return Batches()

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            losses.append((out[0] if return_outputs else out).detach())
            return out

    opt, sched = make_optimizer(model, args)
    targs = transformers.TrainingArguments(
        output_dir=os.path.join(workdir, "trainer"), max_steps=args.steps, per_device_train_batch_size=rows,
        learning_rate=args.lr, max_grad_norm=args.clip, logging_strategy="no", save_strategy="no", report_to=[],
        seed=seed, disable_tqdm=True, use_cpu=device.type != "cuda", bf16=device.type == "cuda",
        dataloader_num_workers=0)
    trainer = Recording(model=model, args=targs, train_loader=loader, optimizers=(opt, sched))
    trainer.remove_callback(transformers.PrinterCallback)   # its end-of-training line would break the table
    sync(device)
    t0 = time.perf_counter()
    trainer.train()
    sync(device)
    wall = time.perf_counter() - t0
    if len(seen) != args.steps or len(losses) != args.steps:
        raise AssertionError(f"the Trainer ran {len(losses)} losses over {len(seen)} batches, not {args.steps} steps")
    unknown = sum(row is None for step in seen for row in step)
    step_ids = [None if any(r is None for r in step) else sorted(x for r in step for x in r) for step in seen]
    fillers = sum(1 for step in seen for r in step if r == [])
    return ([float(x) for x in torch.stack(losses).float().cpu()], wall, args.steps * rows * args.capacity,
            step_ids, {"filler_rows": fillers, "unmatched_rows": unknown, "rows_per_step": rows})


@torch.no_grad()
def heldout_loss(model, examples, held, args, device, boundaries):
    """Mean loss over the held-out examples' label tokens, each example alone in its row (right padding)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(held), args.eval_batch):
        batch = padded_batch(examples, held[i:i + args.eval_batch])
        b = {k: v.to(device) for k, v in batch.items()}
        with autocast(device):
            logits = forward_logits(model, b, boundaries)
        total += float(summed_loss(logits, b["labels"]))
        count += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model.train()
    return total / count


def warm_up(args, init, device, lay, backend):
    """One forward and backward of each layout on a scratch model: kernel builds and autotuning stay out of the
    timed runs (GPU only)."""
    if device.type != "cuda":
        return
    for mode in ("padded", "packed", "naive"):
        model = new_model(backend, args, init, device)
        batch, boundaries, _ = lay[mode][0]
        b = {k: batch[k].to(device) for k in ("input_ids", "labels", "position_ids")}
        with autocast(device):
            summed_loss(forward_logits(model, b, boundaries), b["labels"]).backward()
        del model
    if "hf" in args.mode_list:
        hf_init = hf_state_from_mamba_ssm(init) if backend == "mamba_ssm" else init
        model = new_model("hf", args, hf_init, device)
        batch, _ = lay["rows"][0]
        b = {k: batch[k].to(device) for k in ("input_ids", "labels", "position_ids")}
        with autocast(device):
            summed_loss(forward_logits(model, b, True), b["labels"]).backward()
        del model
    sync(device)
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# summaries

def window_means(losses, window):
    """Means of consecutive non-overlapping windows of ``window`` steps (a last partial window dropped)."""
    x = np.asarray(losses, np.float64)
    n = len(x) // window
    return x[:n * window].reshape(n, window).mean(axis=1)


def compare(runs, seeds, modes, window, last_k):
    """Each mode against ``padded`` (same seed), and the padded seed-to-seed spread (the yardstick)."""
    pad = np.stack([window_means(runs["padded"][s]["losses"], window) for s in seeds])
    spread = pad.std(axis=0, ddof=1) if len(seeds) > 1 else np.full(pad.shape[1], np.nan)
    out = {"padded_seed_spread": {"window_std_mean": float(np.mean(spread)), "window_std": spread.tolist(),
                                  f"last_{last_k}_std": float(np.std([runs["padded"][s]["last_k"] for s in seeds],
                                                                     ddof=1)) if len(seeds) > 1 else float("nan"),
                                  "heldout_std": float(np.std([runs["padded"][s]["heldout"] for s in seeds],
                                                              ddof=1)) if len(seeds) > 1 else float("nan")}}
    for mode in modes:
        if mode == "padded":
            continue
        diffs = np.stack([window_means(runs[mode][s]["losses"], window) - pad[i] for i, s in enumerate(seeds)])
        step = np.stack([np.asarray(runs[mode][s]["losses"]) - np.asarray(runs["padded"][s]["losses"])
                         for s in seeds])
        out[mode] = {
            "max_abs_window_diff": float(np.abs(diffs).max()),
            "mean_window_diff": float(diffs.mean()),
            "max_abs_window_diff_over_spread": float(np.abs(diffs).max() / np.mean(spread)),
            "max_abs_step_diff": float(np.abs(step).max()),
            "first_step_diff": [float(d) for d in step[:, 0]],
            f"last_{last_k}_diff": [runs[mode][s]["last_k"] - runs["padded"][s]["last_k"] for s in seeds],
            "heldout_diff": [runs[mode][s]["heldout"] - runs["padded"][s]["heldout"] for s in seeds],
            "window_diff_mean_over_seeds": diffs.mean(axis=0).tolist(),
        }
    return out


def print_table(runs, seeds, modes, last_k, comparison, stream=sys.stdout):
    """The table: per mode, one line per seed and one of mean ± std over seeds; then each mode against padded."""
    w = max(len(MODE_TITLES[m]) for m in modes)
    sd = (lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"))
    print(f"\n{'mode':{w}s} {'seed':>5s} {f'loss, last {last_k} steps':>19s} {'held-out loss':>17s} {'wall s':>12s} "
          f"{'positions':>10s}", file=stream)
    for mode in modes:
        for s in seeds:
            r = runs[mode][s]
            print(f"{MODE_TITLES[mode]:{w}s} {s:5d} {r['last_k']:19.4f} {r['heldout']:17.4f} {r['wall_s']:12.1f} "
                  f"{r['positions']:10d}", file=stream)
        lk, ho, wall = ([runs[mode][s][k] for s in seeds] for k in ("last_k", "heldout", "wall_s"))
        print(f"{'':{w}s} {'mean':>5s} {np.mean(lk):10.4f} ± {sd(lk):6.4f} {np.mean(ho):8.4f} ± {sd(ho):6.4f} "
              f"{np.mean(wall):6.1f} ± {sd(wall):3.1f}", file=stream)
    sp = comparison["padded_seed_spread"]
    print(f"\nyardstick: the padded run's seed-to-seed spread (std over {len(seeds)} seeds): of its windowed mean loss "
          f"{sp['window_std_mean']:.4f} (mean over windows), of its held-out loss {sp['heldout_std']:.4f}", file=stream)
    print(f"{'mode - padded, same seed':{w}s} {'max |window diff|':>18s} {'/ spread':>9s} {'max |step diff|':>16s} "
          f"{'held-out diff':>14s}", file=stream)
    for mode in modes:
        if mode == "padded":
            continue
        c = comparison[mode]
        print(f"{MODE_TITLES[mode]:{w}s} {c['max_abs_window_diff']:18.5f} {c['max_abs_window_diff_over_spread']:9.3f} "
              f"{c['max_abs_step_diff']:16.2e} {np.mean(c['heldout_diff']):+14.4f}", file=stream)


def plot(runs, seeds, modes, window, comparison, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"padded": "black", "packed": "tab:blue", "naive": "tab:red", "hf": "tab:green"}
    styles = {"padded": "-", "packed": "--", "naive": "-", "hf": ":"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    n = len(window_means(runs["padded"][seeds[0]]["losses"], window))
    x = (np.arange(n) + 0.5) * window
    pad = np.stack([window_means(runs["padded"][s]["losses"], window) for s in seeds])
    spread = np.asarray(comparison["padded_seed_spread"]["window_std"])
    top.fill_between(x, pad.mean(0) - spread, pad.mean(0) + spread, color="gray", alpha=0.25,
                     label="padded: ±1 std over seeds")
    for mode in modes:
        y = np.stack([window_means(runs[mode][s]["losses"], window) for s in seeds]).mean(0)
        top.plot(x, y, styles[mode], color=colors[mode], lw=1.6, label=MODE_TITLES[mode])
    top.set_ylabel(f"training loss ({window}-step mean, mean of {len(seeds)} seeds)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    bottom.fill_between(x, -spread, spread, color="gray", alpha=0.25, label="padded seed spread (±1 std)")
    bottom.axhline(0, color="black", lw=0.8)
    for mode in modes:
        if mode == "padded":
            continue
        bottom.plot(x, comparison[mode]["window_diff_mean_over_seeds"], styles[mode], color=colors[mode], lw=1.6,
                    label=f"{mode} - padded")
    bottom.set_ylabel("difference from padded\n(same seed, mean of seeds)")
    bottom.set_xlabel("training step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="preset of model and run sizes (default: gpu with CUDA, else toy)")
    ap.add_argument("--smoke", action="store_true", help="the toy size on the CPU (same as --size toy)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)} "
                    "(padded is required: it is the yardstick)")
    ap.add_argument("--data-dir", default=None, help=f"folder holding {GSM8K_FILE} and {TOKENIZER_FILE} "
                    "(default: ../shared/data if present, else the sample embedded in packloader)")
    ap.add_argument("--mask-prompt", action="store_true", help="loss on the answers only (default: every token)")
    ap.add_argument("--out-dir", default=None, help="where convergence.json and loss_curves.png go (default: "
                    "benchmarks/results/convergence at --size gpu, a temporary folder at --size toy)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--backend", choices=["auto", "mamba_ssm", "hf", "ops"], default="auto",
                    help="the model: mamba-ssm's MambaLMHeadModel, transformers' MambaForCausalLM or the project's "
                         "own ops.PackedMamba stack (auto: the first that imports, mamba-ssm on a GPU only)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping (max norm)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    for key, value in SIZES["gpu"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                        help=f"(preset: gpu {value}, toy {SIZES['toy'][key]})")
    args = ap.parse_args(argv)
    if args.smoke:
        if args.size not in (None, "toy"):
            ap.error("--smoke is --size toy; do not combine it with --size " + args.size)
        args.size = "toy"
    if args.size is None:
        args.size = "gpu" if torch.cuda.is_available() else "toy"
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.seed_list = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(args.seed_list) < 2 or len(set(args.seed_list)) != len(args.seed_list):
        ap.error(f"--seeds needs at least two distinct seeds (their spread is the yardstick), got {args.seeds!r}")
    args.mode_list = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or "padded" not in args.mode_list:
        ap.error(f"--modes must name modes of {MODES} and include padded, got {args.modes!r}")
    for key in ("steps", "examples_per_step", "capacity", "heldout", "layers", "d_model", "d_state", "eval_batch",
                "window", "last_k"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.window > args.steps or args.last_k > args.steps:
        ap.error(f"--window ({args.window}) and --last-k ({args.last_k}) must not exceed --steps ({args.steps})")
    if args.warmup < 0 or args.warmup >= args.steps:
        ap.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    for key in ("max_len", "limit"):
        if getattr(args, key) < 0:
            ap.error(f"--{key.replace('_', '-')} must be >= 0 (0: no limit), got {getattr(args, key)}")
    return args


def expected_seconds(args, device):
    """Rough runtime of the training (prior: the 2026-11-26 H200 measurement; CPU: the toy's own scale)."""
    if device.type != "cuda":
        return None
    per_step = sum(PRIOR_S_PER_EXAMPLE_STEP[m] for m in args.mode_list) * args.examples_per_step
    scale = (args.d_model * args.layers) / (768 * 12)
    return per_step * scale * args.steps * len(args.seed_list)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    backend = choose_backend(args.backend, device)
    skipped = {}
    if "hf" in args.mode_list and (backend == "ops" or not have_transformers()):
        skipped["hf"] = ("transformers / accelerate do not import here" if not have_transformers() else
                         "--backend ops: the Hugging Face mode needs transformers' model, not the project's own")
        args.mode_list = [m for m in args.mode_list if m != "hf"]
        print(f"note: mode hf skipped: {skipped['hf']}")
    jsonl, tok, source = data_files(args.data_dir)
    examples = load_examples(jsonl, tok, mask_prompt=args.mask_prompt, max_len=args.max_len, limit=args.limit)
    if args.vocab < 50280:
        examples = compact_vocab(examples, args.vocab)
    top = max(int(x.max()) for x, _ in examples)
    if top >= args.vocab:
        raise SystemExit(f"--vocab {args.vocab}: the data holds token id {top}")
    print(f"convergence: {source}, {len(examples)} examples; size {args.size}; model {backend} "
          f"(d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}); {args.steps} steps x "
          f"{args.examples_per_step} examples, rows of {args.capacity}; seeds {args.seed_list}; modes "
          f"{','.join(args.mode_list)}; {device}")
    est = expected_seconds(args, device)
    if est is not None:
        print(f"expected runtime: about {est + 30:.0f} s (training {est:.0f} s, from the 2026-11-26 H200 "
              f"measurement; refined after the first seed)")

    out_dir = args.out_dir or (os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "convergence")
                               if args.size == "gpu" else tempfile.mkdtemp(prefix="convergence-smoke-"))
    os.makedirs(out_dir, exist_ok=True)
    workroot = tempfile.mkdtemp(prefix="convergence-work-")
    runs = {m: {} for m in args.mode_list}
    step_sets = {}
    hf_checks = {}
    ctx = {"args": args, "runs": runs, "step_sets": step_sets, "hf_checks": hf_checks, "backend": backend,
           "device": device, "n_params": None, "source": source, "n_examples": len(examples), "skipped": skipped,
           "out_dir": out_dir, "t_start": t_start}
    try:
        for si, seed in enumerate(args.seed_list):
            t_seed = time.perf_counter()
            held, steps = step_examples(len(examples), heldout=args.heldout, steps=args.steps,
                                        per_step=args.examples_per_step, seed=seed)
            lay = layouts(examples, steps, args.capacity, backend)
            step_sets[seed] = [sorted(int(i) for i in ids) for ids in steps]
            torch.manual_seed(seed)
            init_model = BUILDERS[backend](args, "cpu")
            ctx["n_params"] = sum(p.numel() for p in init_model.parameters())
            init = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
            del init_model
            if si == 0:
                warm_up(args, init, device, lay, backend)
                t_seed = time.perf_counter()   # the estimate below leaves the one-time warm-up out
            for mode in args.mode_list:
                if mode == "hf":
                    hf_init = hf_state_from_mamba_ssm(init) if backend == "mamba_ssm" else init
                    model = new_model("hf", args, hf_init, device)
                    work = tempfile.mkdtemp(dir=workroot)
                    losses, wall, positions, ids, check = train_hf(model, lay, examples, args, device, seed, work)
                    hf_checks[seed] = check
                    boundaries = True
                else:
                    model = new_model(backend, args, init, device)
                    losses, wall, positions = train_own(model, lay[mode], args, device)
                    ids = [x[2] for x in lay[mode]]
                    boundaries = lay[mode][0][1]
                ho = heldout_loss(model, examples, held, args, device, boundaries=boundaries or backend != "mamba_ssm")
                runs[mode][seed] = {"losses": losses, "last_k": float(np.mean(losses[-args.last_k:])), "heldout": ho,
                                    "wall_s": wall, "positions": int(positions), "step_examples": ids}
                print(f"  seed {seed} {mode:7s} loss last {args.last_k} {runs[mode][seed]['last_k']:.4f}  held-out "
                      f"{ho:.4f}  {wall:.1f} s", flush=True)
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if si == 0:
                left = (time.perf_counter() - t_seed) * (len(args.seed_list) - 1)
                print(f"expected runtime left: about {left:.0f} s ({len(args.seed_list) - 1} more seeds)", flush=True)
            elif si < len(args.seed_list) - 1:
                write_outputs(ctx, args.seed_list[:si + 1], final=False)   # a run stopped early keeps these
    finally:
        shutil.rmtree(workroot, ignore_errors=True)

    return write_outputs(ctx, args.seed_list, final=True)


def write_outputs(ctx, seeds, *, final):
    """Compare, write ``convergence.json`` and ``loss_curves.png`` for the ``seeds`` done so far (after every seed
    from the second on, so that a run stopped early leaves its finished seeds behind), and at the end print the
    table. Returns the result dict (with ``runs_full``: the runs with their examples per step)."""
    args, runs, step_sets, hf_checks = ctx["args"], ctx["runs"], ctx["step_sets"], ctx["hf_checks"]
    backend, device = ctx["backend"], ctx["device"]
    same = all(runs[m][s]["step_examples"] == step_sets[s] for m in args.mode_list for s in seeds)
    comparison = compare(runs, seeds, args.mode_list, args.window, args.last_k)
    checks = {s: hf_checks[s] for s in seeds if s in hf_checks}
    if final:
        print_table(runs, seeds, args.mode_list, args.last_k, comparison)
        print(f"the same examples in every step of every mode: {same}")
        if checks:
            print("hf: rows the Trainer was handed that are not the packed mode's rows: "
                  f"{sum(c['unmatched_rows'] for c in checks.values())}; filler rows (no loss tokens): "
                  f"{sum(c['filler_rows'] for c in checks.values())} of "
                  f"{sum(c['rows_per_step'] for c in checks.values()) * args.steps}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    result = {
        "benchmark": "convergence", "date": time.strftime("%Y-%m-%d"), "device": device_name,
        "torch": torch.__version__, "model_backend": backend, "parameters": ctx["n_params"], "data": ctx["source"],
        "examples": ctx["n_examples"], "settings": {k: v for k, v in vars(args).items() if k != "seed_list"},
        "seeds": list(seeds), "complete": final, "modes": args.mode_list, "skipped_modes": ctx["skipped"],
        "same_examples_per_step": same, "hf_checks": checks,
        "runs": {m: {str(s): {k: v for k, v in runs[m][s].items() if k != "step_examples"} for s in seeds}
                 for m in args.mode_list},
        "step_examples": {str(s): step_sets[s] for s in seeds},
        "comparison": comparison, "total_s": time.perf_counter() - ctx["t_start"],
    }
    json_path = os.path.join(ctx["out_dir"], "convergence.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    names = {"mamba_ssm": "mamba-ssm MambaLMHeadModel", "hf": "transformers MambaForCausalLM",
             "ops": "ops.PackedMamba LM"}
    title = (f"{names[backend]} (Mamba-1), d_model {args.d_model}, {args.layers} layers; {args.examples_per_step} "
             f"GSM8K examples a step, rows of {args.capacity}; {device_name}")
    png = plot(runs, seeds, args.mode_list, args.window, comparison, os.path.join(ctx["out_dir"], "loss_curves.png"),
               title)
    if final:
        print(f"wrote {json_path} and {png} ({result['total_s']:.0f} s in all)")
    result["json_path"], result["png_path"] = json_path, png
    result["runs_full"] = runs
    return result

if __name__ == "__main__":
    main()
