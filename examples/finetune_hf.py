"""Fine-tune a Hugging Face transformers Mamba model on GSM8K with transformers' Trainer: packed vs unpacked.

::

    python examples/finetune_hf.py --steps 2 --limit 32 --capacity 128 --batch-size 2 --d-model 32 --layers 1
                                                                   # the smallest setting: seconds on a CPU
    python examples/finetune_hf.py                                 # defaults (see --help)
    python examples/finetune_hf.py --model mamba2 --trainer sft    # Mamba-2 mixers, TRL's SFTTrainer

Both runs start from the same randomly initialised model (a small ``MambaConfig``: no weights can be
downloaded here) and the same GSM8K records (``../shared/data/gsm8k_train.jsonl`` when present, else the
sample embedded in packloader), tokenized with the GPT-NeoX tokenizer, question masked from the loss:

The records are tokenized with the GPT-NeoX-20B tokenizer (``../shared/data`` or the embedded copy).

* **packed**: ``ops.enable_packing(model)``, then :class:`packloader.hf.PackedTrainer` on a
  ``PackedDataLoader``: rows of ``--capacity`` tokens holding several sequences each, ``position_ids``
  restarting at every sequence, the loader's state in every checkpoint (``trainer.train(
  resume_from_checkpoint=True)`` continues exactly);
* **unpacked**: transformers' usual path: ``Trainer`` on the sequences, ``--batch-size`` per step, padded
  to the longest of the batch with an ``attention_mask``.

The table gives each run's tokens with a loss per second (the useful work: same data, same model), the
share of padding over one epoch of batches, the batches per epoch and the last logged loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
SHARED_GSM8K = os.path.join(SHARED_DATA, "gsm8k_train.jsonl")
SHARED_TOKENIZER = os.path.join(SHARED_DATA, "gpt-neox-20b-tokenizer.json")
VOCAB = 50280  # GPT-NeoX-20B's tokenizer, rounded as the Mamba checkpoints do
PAD_ID = 1     # "<|padding|>" in GPT-NeoX-20B's tokenizer


def make_model(kind: str, d_model: int, layers: int, d_state: int, seed: int):
    import transformers

    torch.manual_seed(seed)
    if kind == "mamba":
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers,
                                       state_size=d_state, pad_token_id=PAD_ID)
        return transformers.MambaForCausalLM(cfg)
    if kind == "falcon_mamba":
        cfg = transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers,
                                             state_size=d_state, pad_token_id=PAD_ID)
        return transformers.FalconMambaForCausalLM(cfg)
    head_dim = 16
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers,
                                    state_size=d_state, head_dim=head_dim, num_heads=2 * d_model // head_dim,
                                    n_groups=1, expand=2, chunk_size=64, pad_token_id=PAD_ID)
    return transformers.Mamba2ForCausalLM(cfg)


def tokenizer_path(args) -> str:
    from packloader.demo import TOKENIZER, data_path

    if args.tokenizer:
        return args.tokenizer
    return SHARED_TOKENIZER if os.path.exists(SHARED_TOKENIZER) else data_path(TOKENIZER)


def tokenize(args, workdir: str) -> list:
    from packloader import prepare_jsonl
    from packloader.demo import CORPUS, data_path

    source = args.data or (SHARED_GSM8K if os.path.exists(SHARED_GSM8K) else data_path(CORPUS))
    out = os.path.join(workdir, "tokens")
    res = prepare_jsonl(source, out, tokenizer=tokenizer_path(args), mask_prompt=True,
                        limit=args.limit, quiet=True, overwrite=True)
    print(f"data: {res.sequences} records of {source} -> {res.tokens} tokens ({res.loss_tokens} with a loss)")
    return list(res.paths)


class SequenceDataset(torch.utils.data.Dataset):
    """The token shards as single sequences (transformers' usual, unpacked input)."""

    def __init__(self, paths):
        from packloader.sources import open_shard

        self.items = []
        for path in paths:
            for b in open_shard(path).iter_batches():
                for i in range(len(b.offsets) - 1):
                    lo, hi = b.offsets[i], b.offsets[i + 1]
                    ids = b.tokens[lo:hi].astype(np.int64)
                    lab = (b.labels[lo:hi] if b.labels is not None else b.tokens[lo:hi]).astype(np.int64)
                    lab = lab.copy()
                    lab[0] = -100  # as the packed rows: a sequence's first token has no prediction
                    self.items.append((ids, lab))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, lab = self.items[i]
        return {"input_ids": ids, "labels": lab}


def pad_collate(features):
    """Right-pad to the longest sequence of the batch, with an attention_mask (transformers' usual batches)."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), n), PAD_ID, dtype=torch.long)
    lab = torch.full((len(features), n), -100, dtype=torch.long)
    mask = torch.zeros((len(features), n), dtype=torch.long)
    for r, f in enumerate(features):
        k = len(f["input_ids"])
        ids[r, :k], lab[r, :k], mask[r, :k] = torch.from_numpy(f["input_ids"]), torch.from_numpy(f["labels"]), 1
    return {"input_ids": ids, "labels": lab, "attention_mask": mask}


class TokenCounter:
    """Tokens a run trained on: all positions, and the positions with a loss (label not -100)."""

    def __init__(self):
        self.loss_tokens = self.total = 0

    def add(self, batch):
        self.total += batch["input_ids"].numel()
        self.loss_tokens += int((batch["labels"] != -100).sum())


def training_args(args, out: str, **kw):
    import transformers

    cfg_cls = transformers.TrainingArguments
    if args.trainer == "sft":
        import trl

        cfg_cls = trl.SFTConfig
    return cfg_cls(output_dir=out, max_steps=args.steps, learning_rate=args.lr, logging_steps=1,
                   save_steps=args.save_steps, report_to=[], seed=args.seed, disable_tqdm=True,
                   use_cpu=args.device == "cpu", per_device_train_batch_size=args.batch_size,
                   dataloader_drop_last=False, save_only_model=False, **kw)


class _Log:
    def __init__(self):
        import transformers

        class CB(transformers.TrainerCallback):
            def __init__(cb):
                cb.losses = []

            def on_log(cb, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    cb.losses.append(float(logs["loss"]))

        self.cb = CB()


def tokenizer_object(args):
    """TRL's SFTTrainer wants a tokenizer object (never used to tokenize here: the data is)."""
    import gzip

    import transformers

    path = tokenizer_path(args)
    if path.endswith(".gz"):
        tmp = os.path.join(tempfile.mkdtemp(prefix="tok-"), "tokenizer.json")
        with gzip.open(path, "rb") as f, open(tmp, "wb") as g:
            g.write(f.read())
        path = tmp
    return transformers.PreTrainedTokenizerFast(tokenizer_file=path, pad_token="<|padding|>")


def run_packed(args, paths, out):
    import ops
    from packloader import PackedDataLoader
    from packloader.hf import PackedTrainer, packed_trainer_class

    model = ops.enable_packing(make_model(args.model, args.d_model, args.layers, args.d_state, args.seed))
    # overflow="split": a problem longer than --capacity is trained on in pieces (counted, warned once)
    loader = PackedDataLoader(paths, capacity=args.capacity, batch_size=args.batch_size, shuffle=True,
                              seed=args.seed, hf_compat=True, overflow="split")
    counter = TokenCounter()

    class Counted(PackedTrainer if args.trainer == "trainer" else packed_trainer_class(_sft())):
        def compute_loss(self, model, inputs, *a, **kw):
            counter.add(inputs)
            return super().compute_loss(model, inputs, *a, **kw)

    log = _Log()
    extra = {"processing_class": tokenizer_object(args)} if args.trainer == "sft" else {}
    trainer = Counted(model=model, args=training_args(args, out), train_loader=loader, callbacks=[log.cb], **extra)
    t0 = time.perf_counter()
    trainer.train()
    padding = 1 - sum(len(ids) for ids, _ in SequenceDataset(paths).items) / (len(loader) * args.batch_size * args.capacity)
    return time.perf_counter() - t0, counter, log.cb.losses, len(loader), padding


def _sft():
    import trl

    return trl.SFTTrainer


def run_unpacked(args, paths, out):
    import transformers

    model = make_model(args.model, args.d_model, args.layers, args.d_state, args.seed)
    counter = TokenCounter()

    def collate(features):
        batch = pad_collate(features)
        counter.add(batch)
        return batch

    log = _Log()
    base = transformers.Trainer if args.trainer == "trainer" else _sft()
    extra = {"processing_class": tokenizer_object(args)} if args.trainer == "sft" else {}
    targs = training_args(args, out, remove_unused_columns=False,
                          **({"dataset_kwargs": {"skip_prepare_dataset": True}} if args.trainer == "sft" else {}))
    dataset = SequenceDataset(paths)
    if args.trainer == "sft":
        import datasets

        dataset = datasets.Dataset.from_list([dict(input_ids=i.tolist(), labels=l.tolist()) for i, l in dataset.items])
        inner = collate
        collate = lambda feats: inner([{k: np.asarray(v) for k, v in f.items()} for f in feats])  # noqa: E731
    trainer = base(model=model, args=targs, train_dataset=dataset, data_collator=collate, callbacks=[log.cb],
                   **extra)
    t0 = time.perf_counter()
    trainer.train()
    seqs = SequenceDataset(paths)  # padding of one epoch in order (Trainer shuffles; about the same)
    batches = [pad_collate([seqs[i] for i in range(k, min(k + args.batch_size, len(seqs)))])
               for k in range(0, len(seqs), args.batch_size)]
    padding = 1 - sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["input_ids"].numel() for b in batches)
    return time.perf_counter() - t0, counter, log.cb.losses, len(trainer.get_train_dataloader()), padding


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="GSM8K-style JSONL (question, answer); default: "
                   "../shared/data/gsm8k_train.jsonl if present, else packloader's embedded sample")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json(.gz); default: GPT-NeoX-20B's from "
                   "../shared/data if present, else the one embedded in packloader")
    p.add_argument("--limit", type=int, default=1000, help="records to tokenize")
    p.add_argument("--model", choices=["mamba", "falcon_mamba", "mamba2"], default="mamba",
                   help="MambaForCausalLM, FalconMambaForCausalLM or Mamba2ForCausalLM (random init)")
    p.add_argument("--trainer", choices=["trainer", "sft"], default="trainer",
                   help="transformers.Trainer or TRL's SFTTrainer")
    p.add_argument("--mode", choices=["both", "packed", "unpacked"], default="both", help="which runs")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--capacity", type=int, default=512, help="tokens per packed row")
    p.add_argument("--batch-size", type=int, default=4, help="packed rows (packed) or sequences (unpacked) per step")
    p.add_argument("--d-model", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="Mamba layers")
    p.add_argument("--d-state", type=int, default=16, help="SSM state size")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--save-steps", type=int, default=10, help="checkpoint every N steps (loader state included)")
    p.add_argument("--seed", type=int, default=0, help="model init and loader shuffling seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    workdir = args.out or tempfile.mkdtemp(prefix="finetune_hf-")
    paths = tokenize(args, workdir)
    results = {}
    for mode in (["packed", "unpacked"] if args.mode == "both" else [args.mode]):
        run = run_packed if mode == "packed" else run_unpacked
        seconds, counter, losses, epoch_batches, padding = run(args, paths, os.path.join(workdir, mode))
        results[mode] = {"seconds": seconds, "loss_tokens": counter.loss_tokens, "positions": counter.total,
                         "loss_tokens_per_s": counter.loss_tokens / seconds, "padding_per_epoch": padding,
                         "last_loss": losses[-1] if losses else None, "batches_per_epoch": epoch_batches}
    print(f"\n{args.model} d_model={args.d_model} layers={args.layers}, {args.steps} steps of batch {args.batch_size}"
          f" ({args.trainer}, {args.device})")
    print(f"{'run':10s} {'seconds':>8s} {'loss tok':>9s} {'loss tok/s':>11s} {'padding/epoch':>14s} "
          f"{'batches/epoch':>14s} {'last loss':>10s}")
    for mode, r in results.items():
        loss = f"{r['last_loss']:.3f}" if r["last_loss"] is not None else "-"
        print(f"{mode:10s} {r['seconds']:8.2f} {r['loss_tokens']:9d} {r['loss_tokens_per_s']:11.0f} "
              f"{100 * r['padding_per_epoch']:13.1f}% {r['batches_per_epoch']:14d} {loss:>10s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
