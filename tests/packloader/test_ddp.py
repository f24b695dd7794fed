"""PackedDataLoader under real ``torch.distributed``: gloo on CPU, 2 and 3 processes.

Each rank builds its loader with no rank arguments (rank and world size come from
``torch.distributed``; the ``RANK`` / ``WORLD_SIZE`` variables are set to wrong values to prove it), and
trains a tiny DistributedDataParallel model for the whole epoch. Checked:

* every rank yields the same number of batches (``all_gather``), equal to ``len(loader)``;
* across ranks every sequence is covered exactly once (pieces gathered to rank 0);
* the data is made so that the epoch's row count is 1 modulo ``world_size * batch_size`` for both world
  sizes: the last global step has a single real row, so ``world_size - 1`` ranks get a batch of padding
  rows only (``num_loss_tokens == 0``), and still run their forward / backward / all-reduce;
* after the epoch the DDP replicas are identical (the steps stayed in lock-step);
* a state saved by rank 0 mid-epoch, broadcast and loaded into fresh loaders on every rank, gives every
  rank the rest of its epoch exactly.

Processes are forked (fast: no re-import of torch) and the whole run has a deadline, so a hang fails
the test instead of blocking CI. Gloo collectives have their own 30 s timeout.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np
import pytest
import torch

from packloader import PackedDataLoader
from tests.packloader.conftest import random_sequences, write_arrow
from tests.packloader.loader_fixtures import assert_exact_cover, batch_fingerprint

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(sys.platform != "linux", reason="uses the fork start method"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

CAPACITY = 64
BATCH = 2
VOCAB = 97
DEADLINE_S = 120  # the whole multi-process run; a few seconds normally
MOD = 12          # lcm of world * batch for world 2 and 3


def make_corpus(root, seed: int):
    """Uneven shards (an empty sequence, one longer than capacity) plus a shard of full-capacity
    sequences, grown until the epoch has 1 (mod 12) rows."""
    seqs = [random_sequences(n, seed=seed + k, min_len=2, max_len=100, vocab=VOCAB) for k, n in
            enumerate([17, 29, 6])]
    seqs[1][4] = np.zeros(0, np.int32)
    seqs[2][1] = np.random.default_rng(seed).integers(0, VOCAB, 150, dtype=np.int32)  # split in 3 pieces
    paths = [write_arrow(root / f"part-{k}.arrow", s, batch_rows=8) for k, s in enumerate(seqs)]
    rng = np.random.default_rng(seed + 99)
    fill = []
    for _ in range(3 * MOD):
        fill.append(rng.integers(0, VOCAB, CAPACITY, dtype=np.int32))
        fill_path = write_arrow(root / "fill.arrow", fill)
        # one rank, batch 1: one batch per row of the epoch
        n_rows = len(PackedDataLoader(paths + [fill_path], capacity=CAPACITY, overflow="split", batch_size=1, seed=seed,
                                      rank=0, world_size=1))
        if n_rows % MOD == 1:
            return paths + [fill_path], seqs + [fill], n_rows
    raise AssertionError("could not make an epoch of 1 (mod 12) rows")


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int = 16):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(CAPACITY, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):
        return self.out(torch.tanh(self.tok(input_ids) + self.pos(position_ids)))


def _rank_main(rank: int, world: int, init_file: str, paths, seed: int, workers: int, out_dir: str):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    # wrong on purpose: the loader must take rank and world size from torch.distributed
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        loader = PackedDataLoader(paths, capacity=CAPACITY, overflow="split", batch_size=BATCH, seed=seed, num_workers=workers,
                                  return_ids=True)
        assert (loader.rank, loader.world_size) == (rank, world), (loader.rank, loader.world_size)
        torch.manual_seed(0)
        model = DDP(TinyLM(VOCAB))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        pieces, fps, losses = [], [], []
        pad_rows = empty_batches = 0
        cut, saved = len(loader) // 2, None
        for step, batch in enumerate(loader):
            if step == cut:
                saved = loader.state_dict()  # batches 0..cut handed out so far
                assert saved["batches_consumed"] == cut + 1, saved
            fps.append(batch_fingerprint(batch))
            sid = batch["sample_ids"]
            pieces += [tuple(x) for x in sid[:, 1:].tolist()]
            pad_rows += BATCH - len(set(sid[:, 0].tolist()))
            labels = batch["labels"]
            assert (labels[:, 0] == -100).all()  # every row starts a segment
            assert int((labels[:, 1:] != -100).sum()) == batch["num_loss_tokens"]
            empty_batches += batch["num_loss_tokens"] == 0
            n_tok = torch.tensor([batch["num_loss_tokens"]], dtype=torch.float64)
            dist.all_reduce(n_tok)  # the global count: a padding-only batch contributes 0, not NaN
            logits = model(batch["input_ids"], batch["position_ids"])
            loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                       ignore_index=-100, reduction="sum")
            loss = loss_sum * world / n_tok.clamp(min=1).item()  # DDP averages gradients over ranks
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            assert torch.isfinite(loss), (step, loss)
            global_sum = loss_sum.detach().double().reshape(1)
            dist.all_reduce(global_sum)
            losses.append(float(global_sum / n_tok.clamp(min=1)))
        counts = [None] * world
        dist.all_gather_object(counts, (len(fps), len(loader)))
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        replicas = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(replicas, flat)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(pieces, gathered, dst=0)

        # resume: rank 0's state, loaded by a fresh loader on every rank, continues every rank exactly
        box = [saved]
        dist.broadcast_object_list(box, src=0)
        fresh = PackedDataLoader(paths, capacity=CAPACITY, overflow="split", batch_size=BATCH, seed=seed, num_workers=0,
                                 return_ids=True)
        fresh.load_state_dict(json.loads(json.dumps(box[0])))
        rest = [batch_fingerprint(b) for b in fresh]
        result.update(
            n_batches=len(fps), counts=counts, pad_rows=pad_rows, empty_batches=int(empty_batches),
            losses=losses, replicas_equal=all(torch.equal(r, replicas[0]) for r in replicas),
            resume_ok=rest == fps[cut + 1:], cut=cut,
            pieces=[p for part in gathered for p in part] if rank == 0 else None,
        )
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in result else 1)


def run_world(tmp_path, world: int, paths, seed: int, workers: int, target=None, extra=()) -> list[dict]:
    ctx = mp.get_context("fork")
    init_file = str(tmp_path / f"store-{world}")
    out_dir = tmp_path / f"out-{world}"
    out_dir.mkdir()
    procs = [ctx.Process(target=target or _rank_main,
                         args=(r, world, init_file, paths, seed, workers, str(out_dir), *extra))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for r in range(world):
        f = out_dir / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "error": "no result written"})
    errors = [f"rank {x['rank']}:\n{x['error']}" for x in results if "error" in x]
    assert not hung, f"ranks {hung} still running after {DEADLINE_S} s (hang?)\n" + "\n".join(errors)
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world
    return results


@pytest.mark.parametrize("world, workers", [(2, 1), (3, 0)])
def test_ddp_gloo_equal_batches_full_coverage_training(tmp_path, world, workers):
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    paths, seqs, n_rows = make_corpus(tmp_path, seed)
    print(f"rows={n_rows} world={world} workers={workers}")
    results = run_world(tmp_path, world, paths, seed, workers)

    n_batches = -(-n_rows // (world * BATCH))
    for res in results:
        assert res["n_batches"] == n_batches, (res["rank"], res["n_batches"], n_batches)
        assert res["counts"] == [[n_batches, n_batches]] * world
        assert res["replicas_equal"], f"rank {res['rank']}: DDP replicas differ after the epoch"
        assert res["resume_ok"], f"rank {res['rank']}: resumed batches differ (cut {res['cut']})"
        assert len(res["losses"]) == n_batches and all(np.isfinite(res["losses"]))
    # the remainder: the last global step holds one real row, the rest are padding rows
    assert sum(r["pad_rows"] for r in results) == n_batches * world * BATCH - n_rows
    assert sum(r["empty_batches"] for r in results) == world - 1
    # every rank computed the same global loss at every step
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert_exact_cover([tuple(p) for p in results[0]["pieces"]], seqs)


def _elastic_rank_main(rank: int, world: int, init_file: str, paths, seed: int, workers: int, out_dir: str,
                       cut: int | None, state_file: str):
    """Elastic resume under torch.distributed. With ``cut``: train ``cut`` steps, then every rank saves
    its state (all equal, checked by all_gather) and rank 0 writes it. Without: load that state into a
    fresh loader (rank and world size from torch.distributed, another world size than the saving run)
    and train the rest of the epoch."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        loader = PackedDataLoader(paths, capacity=CAPACITY, overflow="split", batch_size=BATCH, seed=seed, num_workers=workers,
                                  return_ids=True)
        if cut is None:
            with open(state_file) as f:
                loader.load_state_dict(json.load(f))
        torch.manual_seed(0)
        model = DDP(TinyLM(VOCAB))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pieces, steps = [], 0
        for batch in loader:  # each step all-reduces gradients: unequal batch counts would hang
            pieces += [tuple(x) for x in batch["sample_ids"][:, 1:].tolist()]
            logits = model(batch["input_ids"], batch["position_ids"])
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100, reduction="sum")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            if steps == cut:  # (a batch taken from the iterator counts as consumed: stop after it)
                break
        states = [None] * world
        dist.all_gather_object(states, json.loads(json.dumps(loader.state_dict())))
        counts = [None] * world
        dist.all_gather_object(counts, steps)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(pieces, gathered, dst=0)
        if cut is not None and rank == 0:
            with open(state_file, "w") as f:
                json.dump(states[0], f)
        result.update(states_equal=all(x == states[0] for x in states), counts=counts, state=states[0],
                      pieces=[p for part in gathered for p in part] if rank == 0 else None)
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in result else 1)


@pytest.mark.parametrize("world_before, world_after", [(2, 3)])
def test_ddp_gloo_elastic_resume_on_more_ranks(tmp_path, world_before, world_after):
    """Train a few steps on 2 processes, save, resume on 3 (the loader takes the new world size from
    torch.distributed): the 3 ranks take the same number of steps and, with the 2-rank part, cover every
    sequence of the epoch exactly once."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    paths, seqs, n_rows = make_corpus(tmp_path, seed)
    cut = max(1, n_rows // (world_before * BATCH) // 2)
    state_file = str(tmp_path / "loader_state.json")
    before = run_world(tmp_path, world_before, paths, seed, 1, target=_elastic_rank_main,
                       extra=(cut, state_file))
    assert all(r["states_equal"] for r in before)
    assert before[0]["counts"] == [cut] * world_before
    state = before[0]["state"]
    assert state["rows_consumed"] == cut * world_before * BATCH
    after = run_world(tmp_path, world_after, paths, seed, 0, target=_elastic_rank_main, extra=(None, state_file))
    n_after = -(-(n_rows - state["rows_consumed"]) // (world_after * BATCH))
    assert after[0]["counts"] == [n_after] * world_after
    assert all(r["states_equal"] for r in after) and after[0]["state"]["rows_consumed"] == n_rows
    consumed = [tuple(p) for p in before[0]["pieces"]]
    rest = [tuple(p) for p in after[0]["pieces"]]
    assert consumed and rest and not set(consumed) & set(rest)
    assert_exact_cover(consumed + rest, seqs)
