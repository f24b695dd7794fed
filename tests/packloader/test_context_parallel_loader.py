"""Context-parallel groups inside a data-parallel world (issue 32, the loader side):
``PackedDataLoader(..., context_parallel_size=C)`` gives the C ranks of a CP group the same batches in the
same order, different DP groups different rows (every sequence once), the same number of batches on
every rank, and a state that resumes exactly (same DP size, any C) and elastically (another DP size)."""
from __future__ import annotations

import json

import pytest

from packloader import PackedDataLoader
from packloader.distributed import data_parallel_rank_world
from tests.packloader.conftest import random_sequences, write_arrow
from tests.packloader.loader_fixtures import assert_exact_cover, batch_fingerprint

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

CAPACITY = 128


@pytest.fixture
def corpus(tmp_path):
    seqs = [random_sequences(70, seed=k, min_len=1, max_len=CAPACITY, vocab=300) for k in range(2)]
    return [write_arrow(tmp_path / f"cp-{k}.arrow", s, batch_rows=16) for k, s in enumerate(seqs)], seqs


def make(paths, rank, world, cp=1, capacity=None, **kw):
    """A loader; the capacity rounded up to a multiple of ``cp`` (each CP rank takes an equal chunk of a row)."""
    capacity = -(-CAPACITY // cp) * cp if capacity is None else capacity
    return PackedDataLoader(paths, capacity=capacity, batch_size=2, seed=11, rank=rank, world_size=world,
                            context_parallel_size=cp, return_ids=True, **kw)


def pieces_of(batches):
    return [tuple(p) for b in batches for p in b["sample_ids"][:, 1:].tolist()]


def test_capacity_must_split_into_equal_chunks(corpus):
    with pytest.raises(ValueError, match="not divisible by context_parallel_size=3"):
        make(corpus[0], 0, 3, cp=3, capacity=128)


def test_dp_rank_world_layout_and_errors():
    assert [data_parallel_rank_world(r, 8, 2) for r in range(8)] == [(r // 2, 4) for r in range(8)]
    assert data_parallel_rank_world(3, 4, 4) == (0, 1) and data_parallel_rank_world(3, 4, 1) == (3, 4)
    with pytest.raises(ValueError, match="does not divide world_size=6"):
        data_parallel_rank_world(0, 6, 4)
    with pytest.raises(ValueError, match="context_parallel_size must be an int >= 1"):
        data_parallel_rank_world(0, 4, 0)


@pytest.mark.parametrize("world, cp", [(4, 2), (6, 3), (4, 4)])
def test_cp_groups_share_rows_dp_groups_partition_them(corpus, world, cp):
    paths, seqs = corpus
    loaders = [make(paths, r, world, cp) for r in range(world)]
    runs = [list(x) for x in loaders]
    fps = [[batch_fingerprint(b) for b in run] for run in runs]
    assert len({len(f) for f in fps}) == 1 and all(len(x) == len(fps[0]) for x in loaders)
    dp = world // cp
    for r in range(world):
        assert (loaders[r].dp_rank, loaders[r].dp_size) == (r // cp, dp)
        assert fps[r] == fps[(r // cp) * cp], f"rank {r} differs from its CP group's first rank"
    # one member per DP group: every sequence exactly once; the same batches as a plain DP world of that size
    firsts = [runs[g * cp] for g in range(dp)]
    assert_exact_cover(pieces_of([b for run in firsts for b in run]), seqs)
    plain = [[batch_fingerprint(b) for b in make(paths, g, dp, capacity=loaders[0].capacity)] for g in range(dp)]
    assert [fps[g * cp] for g in range(dp)] == plain
    if dp > 1:
        assert set(pieces_of(firsts[0])).isdisjoint(pieces_of(firsts[1]))


def test_cp_rank_from_environment(corpus, monkeypatch):
    paths, _ = corpus
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    x = PackedDataLoader(paths, capacity=CAPACITY, batch_size=2, seed=11, context_parallel_size=2)
    assert (x.rank, x.world_size, x.dp_rank, x.dp_size) == (3, 4, 1, 2)
    with pytest.raises(ValueError, match="does not divide world_size=4"):
        PackedDataLoader(paths, capacity=CAPACITY, context_parallel_size=3)


def test_cp_state_resumes_exactly_and_elastically(corpus):
    paths, seqs = corpus
    world, cp = 4, 2
    loaders = [make(paths, r, world, cp) for r in range(world)]
    runs = [[batch_fingerprint(b) for b in x] for x in loaders]
    cut = len(runs[0]) // 2
    states = []
    for x in loaders:
        it = iter(x)
        for _ in range(cut):
            next(it)
        states.append(json.loads(json.dumps(x.state_dict())))
    assert all(s == states[0] for s in states)  # every rank's state is the same: save rank 0's
    assert states[0]["rows_consumed"] == cut * (world // cp) * 2 and states[0]["settings"]["world_size"] == 2
    # the same layout: every rank continues exactly
    for r in range(world):
        fresh = make(paths, r, world, cp)
        fresh.load_state_dict(states[0])
        assert [batch_fingerprint(b) for b in fresh] == runs[r][cut:]
    # the same DP size with another C (8 ranks, CP groups of 4; or no CP on 2 ranks): exact too
    for new_world, new_cp in [(8, 4), (2, 1)]:
        for r in range(new_world):
            fresh = make(paths, r, new_world, new_cp)
            fresh.load_state_dict(states[0])
            assert [batch_fingerprint(b) for b in fresh] == runs[(r // new_cp) * cp][cut:]
    # another DP size (4 ranks in 1 CP group of 4 -> 1 DP group): the rest exactly once, the same on all
    done = [b for g in range(2) for b in list(make(paths, g * cp, world, cp))[:cut]]
    rest = []
    for r in range(4):
        fresh = make(paths, r, 4, 4)
        fresh.load_state_dict(states[0])
        got = list(fresh)
        if r == 0:
            rest = got
        else:
            assert [batch_fingerprint(b) for b in got] == [batch_fingerprint(b) for b in rest]
    assert_exact_cover(pieces_of(done + rest), seqs)


def test_cp_with_workers_and_compute_balance(corpus):
    """Members of a CP group agree whatever their num_workers, also with compute balancing and rows sorted
    into steps by cost (the sorted row source travels to the workers)."""
    paths, _ = corpus
    kw = dict(balance="compute", attention_factor=0.01, cost_sort_window=8)
    a = [batch_fingerprint(b) for b in make(paths, 2, 4, 2, num_workers=2, **kw)]
    b = [batch_fingerprint(b) for b in make(paths, 3, 4, 2, num_workers=0, **kw)]
    assert a == b and a
