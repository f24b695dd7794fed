"""Train a packing-safe Mamba language model sharded with FSDP2 (``fully_shard``) on packed batches.

::

    torchrun --nproc_per_node 4 examples/train_fsdp.py --d-model 2048 --layers 48 --capacity 4096 --batch-size 4
    torchrun --nproc_per_node 2 examples/train_fsdp.py --device cpu --d-model 32 --layers 2 --steps 4   # gloo, CPU
    torchrun --nproc_per_node 4 examples/train_fsdp.py --save ckpt/ --save-at 100 --steps 200
    torchrun --nproc_per_node 4 examples/train_fsdp.py --resume ckpt/ --steps 200     # continues exactly
    python examples/train_fsdp.py --device cpu --steps 2                                 # one process works too

What it shows:

* the model: a mamba-ssm ``MambaLMHeadModel`` when mamba_ssm imports and the device is a GPU, else a Hugging
  Face ``MambaForCausalLM`` (random weights from a config; ``--model`` picks), converted in place by
  ``ops.enable_packing`` so that packed sequences never see each other (the forward takes ``position_ids``);
* sharding: ``fully_shard`` on every block, then on the whole model (embedding, final norm, tied head), with a
  ``MixedPrecisionPolicy`` (``--mixed-precision bf16``: bf16 parameters in the forward and backward, gradients
  reduced and kept in float32, the optimizer on float32 shards); ``--compile`` compiles every block first;
  ``--no-reshard`` keeps the gathered parameters from the forward to the backward (one all-gather a block and
  step instead of two);
* data: ``PackedDataLoader`` splits every global step of ``world_size * batch_size`` packed rows over the
  ranks (rank and world size from ``torch.distributed``), the same number of batches on every rank;
* the loss: summed over the step's loss tokens on every rank and divided by the global count (one
  ``all_reduce``), times the world size because FSDP averages gradients over ranks; so a step is the same
  as one process taking all ``world_size * batch_size`` rows (``--batch-size`` times the world size) up to
  the order of the reductions;
* checkpoints with ``torch.distributed.checkpoint`` (each rank writes its shards of the model and of the
  optimizer state; ``get_state_dict`` / ``set_state_dict``) plus the loader's state (the same on every rank;
  rank 0 writes it as ``train_state.json``): ``--resume`` continues exactly, also on another number of
  processes (the loader resumes elastically then; DCP reshards).

Each step prints ``step N loss L`` with ``L`` the global mean loss as Python's ``repr`` of the float, so two
runs can be compared to the bit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from packloader import PackedDataLoader  # noqa: E402
from train_packed_mamba import demo_source  # noqa: E402  (the demo shards, shared with the other examples)

IGNORE_INDEX = -100


def have_mamba_ssm() -> bool:
    try:
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA extension
        return False
    return True


def build_model(kind: str, d_model: int, layers: int, vocab: int, d_state: int, seed: int, device):
    """A packing-safe Mamba LM in float32 on ``device`` and its list of blocks (what ``fully_shard`` wraps).

    ``kind``: ``"mamba_ssm"`` (``MambaLMHeadModel``, Mamba-1 mixers) or ``"hf"`` (transformers'
    ``MambaForCausalLM``). Same seed, same weights on every rank."""
    import ops

    torch.manual_seed(seed)
    if kind == "mamba_ssm":
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        cfg = MambaConfig(d_model=d_model, n_layer=layers, vocab_size=vocab,
                          ssm_cfg={"layer": "Mamba1", "d_state": d_state}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8)
        model = MambaLMHeadModel(cfg, device=device, dtype=torch.float32)
    else:
        import transformers

        cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                                       state_size=d_state, pad_token_id=1, use_cache=False)
        model = transformers.MambaForCausalLM(cfg).to(device)
    ops.enable_packing(model)
    return model.train(), list(model.backbone.layers)


def shard(model, blocks, mesh, mixed_precision: str, compile_blocks: bool, reshard_after_forward: bool = True):
    """``fully_shard`` every block, then the root (embedding, final norm and the tied head stay together).
    ``reshard_after_forward=False`` keeps each block's gathered parameters from its forward to its backward:
    no all-gather in the backward, for the memory of the unsharded bf16 parameters (gradients and the optimizer
    state stay sharded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision == "bf16" else MixedPrecisionPolicy())
    for block in blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def summed_loss(model, batch, device):
    """Cross-entropy summed over the batch's loss tokens (labels are not shifted in a packloader batch:
    position ``t`` predicts ``labels[t + 1]``; -100 at every sequence start and on padding)."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    pos = batch["position_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    logits = model(ids, position_ids=pos).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def save_checkpoint(path: str, model, opt, loader, step: int, rank: int) -> None:
    """Model and optimizer shards through DCP (every rank), the loader's position (rank 0, JSON)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    if rank == 0:
        tmp = os.path.join(path, "train_state.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "loader": loader.state_dict()}, f)
        os.replace(tmp, os.path.join(path, "train_state.json"))
    dist.barrier()


def load_checkpoint(path: str, model, opt, loader) -> int:
    """Restore what :func:`save_checkpoint` wrote (on any number of ranks); returns the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "train_state.json")) as f:
        saved = json.load(f)
    loader.load_state_dict(saved["loader"])
    return int(saved["step"])


def init_distributed(device_arg: str):
    """torchrun's process group (or a one-process group without torchrun); returns (rank, world, device)."""
    if "cuda" in device_arg and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no GPU is visible; pass --device cpu")
    if device_arg.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device(device_arg)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="token shards (pattern) or a pre-packed directory; None: the "
                   "embedded GSM8K demo corpus, tokenized into --workdir")
    p.add_argument("--workdir", default="demo_out/train_fsdp", help="where the demo corpus is tokenized")
    p.add_argument("--model", choices=["auto", "mamba_ssm", "hf"], default="auto",
                   help="auto: mamba_ssm's MambaLMHeadModel on a GPU when it imports, else transformers' "
                   "MambaForCausalLM")
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="Mamba blocks")
    p.add_argument("--d-state", type=int, default=16, help="SSM state size")
    p.add_argument("--vocab-size", type=int, default=50280, help="embedding rows (GPT-NeoX-20B tokenizer: 50280)")
    p.add_argument("--capacity", type=int, default=512, help="tokens per packed row (ignored for a pre-packed dir)")
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per step and rank")
    p.add_argument("--num-workers", type=int, default=0, help="loader worker processes")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all, counted from the start")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--mixed-precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: bf16 parameters in forward/backward, float32 reductions and optimizer")
    p.add_argument("--compile", action="store_true", help="torch.compile every block before sharding")
    p.add_argument("--no-reshard", action="store_true",
                   help="reshard_after_forward=False: no all-gather in the backward, more memory (faster on 4 GPUs "
                        "in benchmarks/bench_fsdp.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    p.add_argument("--save", default=None, help="checkpoint directory (DCP shards + train_state.json)")
    p.add_argument("--save-at", type=int, default=None, help="write --save after this step (default: the last)")
    p.add_argument("--resume", default=None, help="continue from a checkpoint directory written by --save")
    args = p.parse_args(argv)
    for name in ("d_model", "layers", "d_state", "vocab_size", "capacity", "batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = init_distributed(args.device)
    kind = args.model
    if kind == "auto":
        kind = "mamba_ssm" if device.type == "cuda" and have_mamba_ssm() else "hf"

    source = args.data
    if source is None:
        source = demo_source(args.workdir, rank, dist.barrier)
    prepacked = os.path.isfile(os.path.join(source, "index.json"))
    loader = PackedDataLoader(source, capacity=None if prepacked else args.capacity, batch_size=args.batch_size,
                              seed=args.seed, num_workers=args.num_workers, pin_memory=device.type == "cuda",
                              overflow=None if prepacked else "split")

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    model, blocks = build_model(kind, args.d_model, args.layers, args.vocab_size, args.d_state, args.seed, device)
    n_params = sum(q.numel() for q in model.parameters())
    shard(model, blocks, mesh, args.mixed_precision, args.compile, not args.no_reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step, epoch = 0, 0
    if args.resume:
        step = load_checkpoint(args.resume, model, opt, loader)
        epoch = loader.epoch
    if rank == 0:
        print(f"{kind} model, {n_params:,} parameters, {args.layers} blocks fully_shard-ed over {world} rank(s), "
              f"{args.mixed_precision}; {len(loader)} batches of {args.batch_size} x {loader.capacity} tokens per "
              f"rank and epoch; device {device.type}", flush=True)

    t0, tokens = time.perf_counter(), 0
    while step < args.steps:
        loader.set_epoch(epoch)  # keeps a resumed position in the saved epoch
        for batch in loader:
            n_loss = torch.tensor(float(batch["num_loss_tokens"]), device=device, dtype=torch.float64)
            dist.all_reduce(n_loss)  # the step's loss tokens over all ranks
            loss_sum = summed_loss(model, batch, device)
            # FSDP averages gradients over ranks: times the world size gives sum / global count
            (loss_sum * (world / n_loss.clamp(min=1))).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += int(batch["input_ids"].numel()) * world
            report = loss_sum.detach().double().reshape(1)
            dist.all_reduce(report)
            mean = float(report / n_loss.clamp(min=1))
            if rank == 0:
                print(f"step {step} loss {mean!r} loss_tokens {int(n_loss.item())} "
                      f"tok/s {tokens / (time.perf_counter() - t0):.0f}", flush=True)
            if args.save and step == (args.save_at or args.steps):
                save_checkpoint(args.save, model, opt, loader, step, rank)
                if rank == 0:
                    print(f"saved {args.save} at step {step}", flush=True)
            if step >= args.steps:
                break
        else:
            epoch += 1
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
