"""Exact resume: state_dict after any number of batches, a fresh loader with load_state_dict, and the
rest of the run is exactly what the uninterrupted loader would have produced."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from packloader import PackedDataLoader
from tests.packloader.conftest import random_sequences, write_arrow, write_tar
from tests.packloader.loader_fixtures import batch_fingerprint, write_prepacked

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

_SEED = int(np.random.default_rng().integers(1 << 30))  # fresh data each run


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    seqs = [random_sequences(n, seed=_SEED + k, max_len=400) for k, n in enumerate([50, 35, 60])]
    paths = [write_arrow(root / "a.arrow", seqs[0], batch_rows=20), write_tar(root / "b.tar", seqs[1]),
             write_arrow(root / "c.arrow", seqs[2])]
    return paths


@pytest.fixture(scope="module")
def prepacked(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_pp")
    seqs = [random_sequences(60, seed=_SEED + 10 + k, max_len=300) for k in range(2)]
    d, _ = write_prepacked(root / "pp", seqs, 256, rows_per_file=9, batch_rows=4)
    return d


def run(loader, epochs):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [(e, batch_fingerprint(b)) for b in loader]
    return out


def resume_check(make, cut, epochs=(0, 1)):
    """Consume `cut` batches over `epochs`, checkpoint (through JSON), resume in a fresh loader."""
    ref = run(make(), epochs)
    assert 0 <= cut <= len(ref)
    first = make()
    got, state = [], None
    for e in epochs:
        first.set_epoch(e)
        it = iter(first)
        while len(got) < cut:
            try:
                b = next(it)
            except StopIteration:
                break
            got.append((e, batch_fingerprint(b)))
        if len(got) == cut:
            state = json.loads(json.dumps(first.state_dict()))
            break
    second = make()
    second.load_state_dict(state)
    rest = []
    for e in epochs:
        if e < state["epoch"]:
            continue
        second.set_epoch(e)
        rest += [(e, batch_fingerprint(b)) for b in second]
    assert got + rest == ref, (cut, len(got), len(rest), len(ref))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch_size=st.integers(1, 3), world=st.sampled_from([1, 2, 3]),
       algorithm=st.sampled_from(["online", "bfd"]), buffer_size=st.integers(1, 40))
def test_resume_streaming_any_cut(shards, data, batch_size, world, algorithm, buffer_size):
    rank = data.draw(st.integers(0, world - 1))

    def make():
        return PackedDataLoader(shards, capacity=512, overflow="split", batch_size=batch_size, algorithm=algorithm,
                                buffer_size=buffer_size, seed=5, rank=rank, world_size=world)

    total = len(run(make(), (0, 1)))
    resume_check(make, data.draw(st.integers(0, total)))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch_size=st.integers(1, 4), world=st.sampled_from([1, 2, 3]), shuffle=st.booleans())
def test_resume_prepacked_any_cut(prepacked, data, batch_size, world, shuffle):
    rank = data.draw(st.integers(0, world - 1))

    def make():
        return PackedDataLoader(prepacked, batch_size=batch_size, shuffle=shuffle, seed=9, rank=rank,
                                world_size=world)

    total = len(run(make(), (0, 1)))
    resume_check(make, data.draw(st.integers(0, total)))


@pytest.mark.parametrize("workers_before, workers_after", [(2, 1), (2, 0)])
def test_prefetched_batches_are_not_consumed(shards, workers_before, workers_after):
    """Workers run ahead (prefetch); the state counts only batches handed to the loop, and the resumed
    loader may use another number of workers."""
    kw = dict(capacity=256, overflow="split", batch_size=2, seed=1)
    ref = [batch_fingerprint(b) for b in PackedDataLoader(shards, **kw)]
    first = PackedDataLoader(shards, num_workers=workers_before, prefetch_factor=4, **kw)
    it = iter(first)
    got = [batch_fingerprint(next(it)) for _ in range(3)]
    sd = first.state_dict()
    assert sd["batches_consumed"] == 3
    del it
    second = PackedDataLoader(shards, num_workers=workers_after, **kw)
    second.load_state_dict(sd)
    assert got + [batch_fingerprint(b) for b in second] == ref


def test_end_of_epoch_state(shards):
    kw = dict(capacity=256, overflow="split", batch_size=2, seed=1)
    a = PackedDataLoader(shards, **kw)
    ep0 = [batch_fingerprint(b) for b in a]
    sd = a.state_dict()
    assert sd["epoch"] == 0 and sd["batches_consumed"] == len(ep0)
    b = PackedDataLoader(shards, **kw)
    b.load_state_dict(sd)
    b.set_epoch(1)  # a loop that counts epochs itself: next epoch, from its start
    a.set_epoch(1)
    ep1 = [batch_fingerprint(x) for x in a]
    assert [batch_fingerprint(x) for x in b] == ep1 != ep0
    c = PackedDataLoader(shards, **kw)
    c.load_state_dict(sd)  # a loop restarting at state["epoch"]: the rest of epoch 0 is empty
    c.set_epoch(0)
    assert list(c) == []
    assert [batch_fingerprint(x) for x in c] == ep0  # iterating again repeats epoch 0, as without resume
    c.set_epoch(1)
    assert [batch_fingerprint(x) for x in c] == ep1


def test_state_of_one_rank_resumes_every_rank(shards):
    kw = dict(capacity=256, overflow="split", batch_size=2, seed=1, world_size=3)
    r0 = PackedDataLoader(shards, rank=0, **kw)
    it = iter(r0)
    for _ in range(2):
        next(it)
    sd = r0.state_dict()
    for rank in (1, 2):
        ref = [batch_fingerprint(b) for b in PackedDataLoader(shards, rank=rank, **kw)]
        other = PackedDataLoader(shards, rank=rank, **kw)
        other.load_state_dict(sd)
        assert [batch_fingerprint(b) for b in other] == ref[2:]


@pytest.mark.parametrize("change, key", [
    ({"seed": 2}, "seed"),
    ({"capacity": 300}, "capacity"),
    ({"algorithm": "bfd"}, "algorithm"),
    ({"buffer_size": 10}, "buffer_size"),
    ({"shuffle": False}, "shuffle"),
    ({"overflow": "truncate"}, "overflow"),
    ({"max_items_per_bin": 3}, "max_items_per_bin"),
])
def test_mismatched_settings_are_named(shards, change, key):
    """A setting that changes the epoch's plan cannot change on resume; the error names it and says
    what may change (world size, batch size, drop_last, workers: see test_elastic.py)."""
    kw = dict(capacity=256, overflow="split", batch_size=2, seed=1)
    sd = PackedDataLoader(shards, **kw).state_dict()
    other = PackedDataLoader(shards, **{**kw, **change})
    with pytest.raises(ValueError, match=f"mismatch: '{key}' was .* when saved, this loader has .*"
                                         "world_size, batch_size, drop_last and num_workers may change"):
        other.load_state_dict(sd)


def test_mismatched_source_and_garbage_state(shards, prepacked):
    sd = PackedDataLoader(shards, capacity=256, overflow="split").state_dict()
    with pytest.raises(ValueError, match="mismatch: 'source'"):
        PackedDataLoader(shards[:2], capacity=256, overflow="split").load_state_dict(sd)
    with pytest.raises(ValueError, match="mismatch: 'source'"):
        PackedDataLoader(prepacked).load_state_dict({**sd, "settings": {**sd["settings"], "capacity": 256}})
    loader = PackedDataLoader(shards, capacity=256, overflow="split")
    with pytest.raises(ValueError, match="not a PackedDataLoader state_dict"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({**sd, "rows_consumed": 10**6})
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({**sd, "version": 1, "batches_consumed": 10**6})
    with pytest.raises(ValueError, match="bad state_dict position"):
        loader.load_state_dict({**sd, "epoch": -1})
    with pytest.raises(ValueError, match="bad state_dict position"):
        loader.load_state_dict({**sd, "rows_consumed": -1})
    with pytest.raises(ValueError, match="unsupported PackedDataLoader state version 3"):
        loader.load_state_dict({**sd, "version": 3})


def test_every_cut_with_sequences_in_the_packer_buffer_and_a_partial_shard(tmp_path):
    """Online packing, one row per batch: resume at every batch boundary of two epochs. The test also
    checks that the cuts exercise the hard cases: sequences the online packer has already read but not
    yet placed (in its buffer at the cut: before the last consumed sequence in stream order, in a row
    after the cut), and a shard partly consumed. Some resumed loaders use workers (another count than
    the saving one)."""
    seqs = [random_sequences(n, seed=_SEED + 20 + k, max_len=300) for k, n in enumerate([40, 25, 45])]
    paths = [write_arrow(tmp_path / f"s{k}.arrow", s, batch_rows=16) for k, s in enumerate(seqs)]

    def make(workers=0):
        return PackedDataLoader(paths, capacity=512, overflow="split", batch_size=1, buffer_size=8, seed=3, num_workers=workers)

    ref = run(make(), (0, 1))
    probe = make()
    rows = probe.dataset.rows
    hard = 0
    for epoch in (0, 1):
        plan = rows.plan(probe.seed, epoch, True)
        shard_of, row_of = rows.stream_order(probe.seed, epoch, True)
        pos = {(int(s), int(r)): i for i, (s, r) in enumerate(zip(shard_of, row_of))}
        piece_pos = np.array([pos[(int(s), int(r))] for s, r in zip(plan.shard, plan.row)])
        for k in range(1, len(plan)):
            done = piece_pos[: plan.row_offsets[k]]
            rest = piece_pos[plan.row_offsets[k]:]
            buffered = int((rest < done.max()).sum())
            shards_done = set(plan.shard[: plan.row_offsets[k]].tolist())
            partial = shards_done & set(plan.shard[plan.row_offsets[k]:].tolist())
            hard += buffered > 0 and bool(partial)
    print(f"cuts={len(ref)} hard={hard}")
    assert hard >= len(ref) // 3, hard  # most cuts leave sequences in the buffer, inside a partly read shard

    for cut in range(len(ref) + 1):
        first = make()
        got, state = [], None
        for e in (0, 1):
            first.set_epoch(e)
            it = iter(first)
            while len(got) < cut:
                try:
                    b = next(it)
                except StopIteration:
                    break
                got.append((e, batch_fingerprint(b)))
            if len(got) == cut:
                state = json.loads(json.dumps(first.state_dict()))
                break
        second = make(workers=2 if cut % 9 == 4 else 0)
        second.load_state_dict(state)
        rest = []
        for e in range(state["epoch"], 2):
            second.set_epoch(e)
            rest += [(e, batch_fingerprint(b)) for b in second]
        assert got + rest == ref, cut


def test_persistent_workers_resume_after_an_abandoned_iterator(shards):
    """Persistent workers hold prefetched batches of an abandoned iterator; loading a state and iterating
    again gives exactly the saved position's batches (stale prefetches are dropped, not counted), and an
    iterator left open across load_state_dict no longer moves the position."""
    kw = dict(capacity=256, overflow="split", batch_size=2, seed=4)
    ref = PackedDataLoader(shards, **kw)
    ep0 = [batch_fingerprint(b) for b in ref]
    ref.set_epoch(1)
    ep1 = [batch_fingerprint(b) for b in ref]
    probe = PackedDataLoader(shards, **kw)
    it = iter(probe)
    for _ in range(5):
        next(it)
    state5 = probe.state_dict()

    pw = PackedDataLoader(shards, num_workers=2, persistent_workers=True, prefetch_factor=3, **kw)
    it = iter(pw)
    got = [batch_fingerprint(next(it)) for _ in range(2)]
    assert got == ep0[:2] and pw.state_dict()["batches_consumed"] == 2
    pw.load_state_dict(state5)
    next(it)  # the old iterator: not counted any more
    assert pw.state_dict()["batches_consumed"] == 5
    assert [batch_fingerprint(b) for b in pw] == ep0[5:]
    assert pw.state_dict()["batches_consumed"] == len(ep0)
    pw.set_epoch(1)
    assert [batch_fingerprint(b) for b in pw] == ep1
