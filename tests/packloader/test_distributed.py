"""Rank / worker partitioning: every sequence exactly once per epoch, equal batch counts on every rank,
results independent of num_workers."""
import warnings

import numpy as np
import pytest

from packloader import PackedDataLoader
from packloader.distributed import (assign_rows, current_worker, num_batches, resolve_rank_world, resume_point,
                                    rows_consumed, worker_batch_indices)
from tests.packloader.conftest import random_sequences, write_arrow
from tests.packloader.loader_fixtures import assert_exact_cover, batch_fingerprint, check_stream_batch

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# ---- rank / world size resolution ------------------------------------------------------------------

def test_rank_world_from_arguments_env_and_default(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank_world() == (0, 1)
    assert resolve_rank_world(2, 5) == (2, 5)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank_world() == (3, 4)
    assert resolve_rank_world(rank=1) == (1, 4)
    with pytest.raises(ValueError, match="rank must be in"):
        resolve_rank_world(4, 4)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        resolve_rank_world(0, 0)


def test_current_worker_in_main_process():
    assert current_worker() == (0, 1)


# ---- row assignment ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_assign_rows_exact_once_equal_counts_balanced(world, batch, drop_last):
    rng = np.random.default_rng(world * 100 + batch)
    for n in [0, 1, world * batch - 1, world * batch, 5 * world * batch + 2, int(rng.integers(1, 200))]:
        tokens = rng.integers(1, 1000, n)
        a = assign_rows(tokens, world, batch, drop_last)
        nb = num_batches(n, world, batch, drop_last)
        assert a.shape == (world, nb, batch)
        used = a[a >= 0]
        covered = nb * world * batch if drop_last else n
        assert sorted(used.tolist()) == list(range(covered))
        # balanced per global step: the spread of token counts is at most the largest row of the step
        for s in range(nb):
            loads = [tokens[a[w, s][a[w, s] >= 0]].sum() for w in range(world)]
            step_rows = a[:, s][a[:, s] >= 0]
            assert max(loads) - min(loads) <= tokens[step_rows].max()
            # inside a batch, rows keep plan order, padding rows last
            for w in range(world):
                real = a[w, s][a[w, s] >= 0]
                assert (np.diff(real) > 0).all() and (a[w, s][len(real):] == -1).all()


def test_worker_batch_indices_partition():
    for n in range(0, 12):
        for start in range(0, n + 1):
            for nw in range(1, 5):
                parts = [list(worker_batch_indices(n, start, w, nw)) for w in range(nw)]
                merged = sorted(sum(parts, []))
                assert merged == list(range(start, n))
                # round-robin order of the DataLoader restores canonical order
                rr = [p[i] for i in range(max(map(len, parts), default=0)) for p in parts if i < len(p)]
                assert rr == list(range(start, n))
    with pytest.raises(ValueError):
        worker_batch_indices(5, 0, 2, 2)


# ---- coverage through the loader -------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh data each run
    seqs = [random_sequences(int(n), seed=seed + k, max_len=300) for k, n in enumerate([30, 45, 25, 40])]
    seqs[1][3] = np.zeros(0, np.int32)  # an empty sequence: never placed
    seqs[2][0] = np.arange(1, 700, dtype=np.int32)  # longer than capacity: split
    paths = [write_arrow(root / f"s{k}.arrow", s, batch_rows=16) for k, s in enumerate(seqs)]
    return paths, seqs


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_epoch_covers_every_sequence_once(corpus, world, workers):
    paths, seqs = corpus
    counts, pieces, fps = [], [], {}
    for rank in range(world):
        loader = PackedDataLoader(paths, capacity=256, overflow="split", batch_size=2, seed=7, num_workers=workers,
                                  rank=rank, world_size=world, return_ids=True)
        loader.set_epoch(1)
        batches = list(loader)
        counts.append(len(batches))
        assert len(batches) == len(loader)
        for b in batches:
            assert tuple(b["input_ids"].shape) == (2, 256)
            pieces += check_stream_batch(b, seqs, 256)
        fps[rank] = [batch_fingerprint(b) for b in batches]
    assert len(set(counts)) == 1, counts
    assert_exact_cover(pieces, seqs)
    # the same batches as with num_workers=0
    if workers:
        for rank in range(world):
            ref = PackedDataLoader(paths, capacity=256, overflow="split", batch_size=2, seed=7, num_workers=0,
                                   rank=rank, world_size=world, return_ids=True)
            ref.set_epoch(1)
            assert [batch_fingerprint(b) for b in ref] == fps[rank]


def test_drop_last_drops_only_the_incomplete_step(corpus):
    paths, seqs = corpus
    world, B = 3, 2
    full = PackedDataLoader(paths, capacity=256, overflow="split", batch_size=B, rank=0, world_size=world)
    n_rows = len(full.dataset.rows.plan(full.seed, 0, True))
    counts = []
    for rank in range(world):
        dl = PackedDataLoader(paths, capacity=256, overflow="split", batch_size=B, rank=rank, world_size=world, drop_last=True,
                              return_ids=True)
        batches = list(dl)
        counts.append(len(batches))
        for b in batches:
            assert (b["sample_ids"][:, 0].unique().numel() == B)  # no padding rows with drop_last
    assert counts == [n_rows // (world * B)] * world
    assert len(full) == -(-n_rows // (world * B))


def test_rank_without_data_yields_padding_batches(tmp_path):
    """One short shard, 8 ranks: ranks that get no real row still yield the same number of batches,
    made of padding rows that carry no loss tokens."""
    p = write_arrow(tmp_path / "tiny.arrow", random_sequences(3, seed=3, max_len=50))
    seen, empty_ranks = 0, 0
    for rank in range(8):
        dl = PackedDataLoader(p, capacity=128, overflow="split", batch_size=2, rank=rank, world_size=8, return_ids=True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            batches = list(dl)
            list(dl)  # warned once per epoch
        assert len(batches) == 1
        b = batches[0]
        seen += len(b["sample_ids"])
        msgs = [str(x.message) for x in w if "gets no data" in str(x.message)]
        if len(b["sample_ids"]) == 0:
            empty_ranks += 1
            assert b["num_loss_tokens"] == 0 and (b["labels"] == -100).all()
            assert len(msgs) == 1 and f"rank {rank} of 8 gets no data in epoch 0" in msgs[0], msgs
            assert "fewer than world_size * batch_size = 16" in msgs[0]
        else:
            assert msgs == []
    assert seen == 3 and empty_ranks >= 6


def test_drop_last_with_less_than_one_step_warns(tmp_path):
    p = write_arrow(tmp_path / "tiny.arrow", random_sequences(3, seed=3, max_len=50))
    dl = PackedDataLoader(p, capacity=128, overflow="split", batch_size=2, rank=0, world_size=4, drop_last=True)
    with pytest.warns(UserWarning, match="epoch 0 has no batches.*drop_last=True"):
        assert list(dl) == []


@pytest.mark.parametrize("world, batch", [(1, 1), (2, 3), (4, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_assign_rows_from_a_resume_point(world, batch, drop_last):
    """Elastic resume: steps start at offset = R % S; the schedule from batch R // S on covers rows [R, N)
    exactly once (up to the dropped tail), and is the fresh schedule shifted when R is a step boundary."""
    rng = np.random.default_rng(world * 10 + batch)
    step = world * batch
    for n in [0, 1, step, 3 * step + 1, int(rng.integers(1, 80))]:
        tokens = rng.integers(1, 1000, n)
        fresh = assign_rows(tokens, world, batch, drop_last)
        for done in range(n + 1):
            offset, start = resume_point(done, n, world, batch, drop_last)
            a = assign_rows(tokens, world, batch, drop_last, offset)
            assert offset < step or done == n == 0
            rest = a[:, start:]
            used = sorted(rest[rest >= 0].tolist())
            want = n - done if not drop_last else (n - done) // step * step
            if done == n:
                want = 0
            assert used == list(range(done, done + want)), (n, done)
            # saved again before any batch: the same point, or the end when no batch is left (drop_last)
            assert rows_consumed(offset, start, a.shape[1], n, world, batch) == (done if start < a.shape[1] else n)
            if done % step == 0 or done == n:
                assert offset == 0 and np.array_equal(a, fresh)
    with pytest.raises(ValueError, match="rows_consumed must be in"):
        resume_point(5, 4, world, batch, drop_last)
