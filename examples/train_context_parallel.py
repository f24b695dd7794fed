"""Train a Mamba language model on rows longer than one GPU holds: context parallelism with ``ops.context_parallel``.

Every packed row is split along its tokens over the ``--cp`` ranks of a context-parallel group; the Mamba mixers
exchange their conv halos and scan states with the ranks before them, so the result is the unsplit row's. With
``torchrun --nproc_per_node W``, the ``W / --cp`` groups are data-parallel: ``PackedDataLoader(context_parallel_size=cp)``
hands every rank of a group the same rows and the groups different rows::

    torchrun --nproc_per_node 2 examples/train_context_parallel.py --cp 2            # 1 group of 2 (CPU: gloo)
    torchrun --nproc_per_node 4 examples/train_context_parallel.py --cp 2 --device cuda --capacity 65536
    python examples/train_context_parallel.py                                         # one process: no CP

What to look at:

* ``ops.shard_batch(cp_group, input_ids, position_ids, labels)``: this rank's chunk of every row, with the labels
  shifted over the whole row first (a chunk's last token predicts the next rank's first);
* the loss: summed over this rank's chunk, divided by the loss tokens of the whole step (all groups), and the
  gradients summed over every rank (``ops.all_reduce_gradients(model, None)``): exactly the gradient of the mean
  loss of the step, as on one process;
* ``--save`` / ``--resume``: model, optimizer and loader; the loader's state counts data-parallel groups.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

import ops  # noqa: E402
from packloader import PackedDataLoader  # noqa: E402

# the model and the demo corpus of the single-GPU example beside this file (its TinyMambaLM: ops.PackedMamba blocks)
from train_packed_mamba import TinyMambaLM, demo_source  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=None, help="ranks per context-parallel group (default: the world)")
    p.add_argument("--data", default=None, help="token shards (pattern); None: the embedded GSM8K demo corpus")
    p.add_argument("--workdir", default="demo_out/train_cp_example")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--capacity", type=int, default=1024, help="tokens per row (divisible by --cp)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per step and data-parallel group")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=50280)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU a rank)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    cp = args.cp or world
    if world % cp:
        raise SystemExit(f"error: --cp {cp} does not divide the world size {world}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cp_group = None
    if world > 1:   # consecutive ranks form a context-parallel group (every rank creates every group)
        for g in range(world // cp):
            grp = dist.new_group(list(range(g * cp, (g + 1) * cp)))
            if rank // cp == g:
                cp_group = grp

    source = args.data
    if source is None:
        source = demo_source(args.workdir, rank, dist.barrier if world > 1 else None)
    loader = PackedDataLoader(source, capacity=args.capacity, overflow="split", batch_size=args.batch_size,
                              seed=args.seed, context_parallel_size=cp if world > 1 else 1)

    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = TinyMambaLM(args.vocab_size, args.d_model, args.layers).to(device)
    if cp_group is not None and cp > 1:
        ops.context_parallel(model, cp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
    if rank == 0:
        print(f"{world} rank(s): {world // cp} data-parallel group(s) of {cp} context-parallel rank(s); rows of "
              f"{args.capacity} tokens, {args.capacity // cp} a rank; device {device}")

    t0 = time.perf_counter()
    epoch = loader.epoch   # a resumed loader continues its saved epoch
    while step < args.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
            if cp > 1 and cp_group is not None:
                ids, pos, labels = ops.shard_batch(cp_group, ids, pos, labels)
            else:   # the same shift on one process
                labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
                labels[:, :-1].masked_fill_(pos[:, 1:] == 0, -100)
            ids, pos, labels = ids.to(device), pos.to(device), labels.to(device)
            hidden = model(ids, pos)
            keep = labels != -100
            logits = hidden[keep] @ model.embed.weight.t()
            loss_sum = F.cross_entropy(logits.float(), labels[keep], reduction="sum")
            n_loss = keep.sum().to(torch.float64).reshape(1)
            report = torch.cat([loss_sum.detach().double().reshape(1), n_loss])
            if world > 1:
                dist.all_reduce(report)   # every rank's chunk: the whole step's loss and loss tokens
            loss = loss_sum / report[1].clamp(min=1).to(loss_sum.dtype)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                ops.all_reduce_gradients(model, None)   # summed over every rank: the step's mean-loss gradient
            opt.step()
            step += 1
            if rank == 0:
                print(f"step {step:4d}  loss {float(report[0] / report[1].clamp(min=1)):.6f}  "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    if args.save and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                    "step": step}, args.save)
    if world > 1:
        dist.barrier()   # every rank done before any tears the group down (gloo aborts a rank still using it)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
