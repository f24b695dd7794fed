"""Train a tiny Mamba language model on packed batches from PackedDataLoader.

One process (CPU by default, or a GPU)::

    python examples/train_packed_mamba.py                     # the embedded GSM8K demo corpus, 20 steps
    python examples/train_packed_mamba.py --data 'tokens/shard-*.arrow' --steps 200   # `packloader prepare` output
    python examples/train_packed_mamba.py --data packed/      # a directory written by `packloader pack`

Several processes (DistributedDataParallel; gloo on CPU, NCCL on GPUs)::

    torchrun --nproc_per_node 2 examples/train_packed_mamba.py --steps 10

What to look at:

* the loader replaces a ``DataLoader``: every batch is a dict of ``[batch_size, capacity]`` tensors
  (``input_ids``, ``labels``, ``position_ids``, ...; see ``packloader/batch.py``);
* the model gets ``position_ids``, which restart at 0 at every sequence start: ``ops.PackedMamba``
  resets its convolution and scan there, so packed sequences never see each other;
* the loss is summed over tokens and divided by the number of loss tokens of the whole step, across
  ranks (a rank can receive a batch of padding rows with no loss tokens; it still takes the step);
* ``--save`` / ``--resume`` checkpoint the model, the optimizer and the loader: the resumed run sees
  exactly the batches the uninterrupted one would have. ``--steps`` counts from the start of training,
  not from the checkpoint: resuming a checkpoint of step 20 with ``--steps 20`` (or fewer) has nothing to
  do, says so and exits with status 0.

Bad input stops with a message and exit status 1: a token id >= ``--vocab-size``, a sequence longer than
``--capacity`` with ``--overflow error`` (the default; ``split``, ``truncate`` or ``drop`` change it).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from packloader import PackedDataLoader  # noqa: E402

from ops import PackedMamba  # noqa: E402  (the packing-safe Mamba mixer of this project; runs on a CPU)


class TinyMambaLM(nn.Module):
    """Embedding -> n pre-norm residual mixer blocks -> norm; the LM head is the tied embedding."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.mixers = nn.ModuleList(PackedMamba(d_model, d_state=8, layer_idx=i) for i in range(n_layers))
        self.norm_f = nn.LayerNorm(d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # as Mamba LMs: small tied logits at the start

    def forward(self, input_ids, position_ids):
        h = self.embed(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), position_ids=position_ids)
        return self.norm_f(h)  # hidden states [B, L, d_model]


def summed_loss(model, batch, device):
    """Cross-entropy summed over the tokens that have a label. Labels are not shifted in the batch
    (``labels[t] == input_ids[t]``, -100 at every sequence start and on padding): position t predicts t+1."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    hidden = model(input_ids, position_ids)
    targets = labels[:, 1:]
    keep = targets != -100
    embed = model.module.embed if isinstance(model, nn.parallel.DistributedDataParallel) else model.embed
    logits = hidden[:, :-1][keep] @ embed.weight.t()  # only where there is a loss: saves the big matmul
    return F.cross_entropy(logits.float(), targets[keep], reduction="sum")


def demo_shards(workdir: str) -> str:
    """Tokenize the GSM8K sample embedded in packloader (prompt masked) into Arrow shards, once."""
    from packloader import prepare_jsonl
    from packloader.demo import CORPUS, TOKENIZER, data_path

    out = os.path.join(workdir, "tokens")
    prepare_jsonl(data_path(CORPUS), out, tokenizer=data_path(TOKENIZER), mask_prompt=True, shard_size=500,
                  limit=2000, quiet=True)  # re-runs return at once
    return os.path.join(out, "shard-*.arrow")


def demo_source(workdir: str, rank: int = 0, barrier=None) -> str:
    """The demo shards for every rank of a run: rank 0 tokenizes them (:func:`demo_shards`), the others wait at
    ``barrier`` (e.g. ``dist.barrier``; None for one process) and read what rank 0 wrote. Only rank 0 runs the
    preparation: a second run into the same directory at the same time is refused by its lock."""
    if rank == 0:
        demo_shards(workdir)
    if barrier is not None:
        barrier()
    return os.path.join(workdir, "tokens", "shard-*.arrow")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="token shards (pattern) or a pre-packed directory; "
                   "None: the embedded GSM8K demo corpus, tokenized into --workdir")
    p.add_argument("--workdir", default="demo_out/train_example", help="where the demo corpus is tokenized")
    p.add_argument("--steps", type=int, default=20,
                   help="optimizer steps in all, counted from the start of training (also with --resume)")
    p.add_argument("--capacity", type=int, default=512, help="tokens per packed row (ignored for a pre-packed dir)")
    p.add_argument("--overflow", choices=["error", "split", "truncate", "drop"], default="error",
                   help="sequences longer than --capacity (ignored for a pre-packed dir)")
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per step and rank")
    p.add_argument("--num-workers", type=int, default=0, help="loader worker processes")
    p.add_argument("--d-model", type=int, default=32, help="model width")
    p.add_argument("--layers", type=int, default=2, help="Mamba blocks")
    p.add_argument("--vocab-size", type=int, default=50280,
                   help="embedding rows; every token id must be below it (GPT-NeoX-20B tokenizer: 50280)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 helps on a busy machine)")
    p.add_argument("--save", default=None, help="write a checkpoint (model, optimizer, loader) here at the end")
    p.add_argument("--resume", default=None, help="continue from a checkpoint written by --save")
    args = p.parse_args(argv)

    # -- distributed (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) --------------
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)

    # -- data ----------------------------------------------------------------------------------------
    source = args.data
    if source is None:
        source = demo_source(args.workdir, rank, dist.barrier if distributed else None)
    prepacked = os.path.isfile(os.path.join(source, "index.json"))
    loader = PackedDataLoader(
        source,
        capacity=None if prepacked else args.capacity,
        overflow=None if prepacked else args.overflow,
        batch_size=args.batch_size,
        seed=args.seed,
        num_workers=args.num_workers,
        pin_memory=device.type == "cuda",
        # rank and world size: from torch.distributed
    )

    # -- model -----------------------------------------------------------------------------------------
    model = TinyMambaLM(args.vocab_size, args.d_model, args.layers).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step, epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        (model.module if distributed else model).load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # the next iterator continues the saved epoch
        step, epoch = ckpt["step"], ckpt["loader"]["epoch"]
        if step >= args.steps:
            if rank == 0:
                print(f"nothing to do: the checkpoint {args.resume} is at step {step}, and --steps {args.steps} "
                      f"counts from the start of training; pass --steps {step + 1} or more to continue")
            if distributed:
                dist.destroy_process_group()
            return 0
    if rank == 0:
        n_params = sum(q.numel() for q in model.parameters())
        print(f"{n_params:,} parameters, {args.layers} x ops.PackedMamba; {loader.world_size} rank(s) x "
              f"{len(loader)} batches of {loader.batch_size} x {loader.capacity} tokens per epoch; device {device}")

    # -- training ----------------------------------------------------------------------------------------
    t0, tokens_seen = time.perf_counter(), 0
    while step < args.steps:
        loader.set_epoch(epoch)  # reshuffles; keeps a resumed position in the saved epoch
        for batch in loader:
            top = int(batch["input_ids"].max())
            if top >= args.vocab_size:
                raise SystemExit(f"error: token id {top} in the batch of step {step + 1} is >= --vocab-size "
                                 f"{args.vocab_size} (the embedding has {args.vocab_size} rows); pass the "
                                 "tokenizer's vocabulary size")
            n_loss = torch.tensor(float(batch["num_loss_tokens"]), device=device)
            if distributed:
                dist.all_reduce(n_loss)  # loss tokens of the whole step, all ranks
            loss_sum = summed_loss(model, batch, device)
            world = dist.get_world_size() if distributed else 1
            # DDP averages gradients over ranks: scale so that the result is sum / global count
            loss = loss_sum * world / n_loss.clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += batch["input_ids"].numel() * world
            report = loss_sum.detach().reshape(1)
            if distributed:
                dist.all_reduce(report)  # for the log line: the mean loss of the whole step
            mean = (report / n_loss.clamp(min=1)).item()
            if rank == 0:
                print(f"step {step:4d}  epoch {epoch}  loss {mean:7.3f}  ppl {math.exp(min(mean, 20)):9.1f}  "
                      f"loss tokens {int(n_loss.item()):5d}  {tokens_seen / (time.perf_counter() - t0):8.0f} tok/s",
                      flush=True)
            if step >= args.steps:
                break
        else:
            epoch += 1  # the epoch ran to its end

    if args.save and rank == 0:
        torch.save({"model": (model.module if distributed else model).state_dict(), "optimizer": opt.state_dict(),
                    "loader": loader.state_dict(), "step": step}, args.save)
        print(f"saved {args.save} (loader at epoch {loader.epoch}, batch {loader.state_dict()['batches_consumed']})")
    if distributed:
        dist.barrier()  # no rank tears the process group down while another still talks to it
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
