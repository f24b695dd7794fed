"""Elastic resume: a state saved at world size W1 / batch size B1 resumes at W2 / B2 (and another
num_workers or drop_last): the rest of the epoch covers every remaining plan row, hence every remaining
sequence, exactly once, none consumed before the cut again, every rank the same number of batches.

Ranks are simulated by one loader per rank (``rank`` / ``world_size`` arguments), stepped in lock-step
as DDP would. Rows are identified by what the loader exposes: ``sample_ids`` (streaming: the row's
pieces) and ``row_ids`` (pre-packed: the directory row), mapped to their index in the epoch's plan.
"""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from packloader import PackedDataLoader
from packloader.prepacked import PrepackedRows
from tests.packloader.conftest import random_sequences, write_arrow, write_tar
from tests.packloader.loader_fixtures import (assert_exact_cover, batch_fingerprint, check_stream_batch,
                                              write_prepacked)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

_SEED = int(np.random.default_rng().integers(1 << 30))  # fresh data each run
EPOCH = 1


@pytest.fixture(scope="module")
def stream_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    seqs = [random_sequences(n, seed=_SEED + k, max_len=300) for k, n in enumerate([40, 30, 45])]
    seqs[1][2] = np.zeros(0, np.int32)  # empty: in no row
    seqs[2][5] = np.arange(1, 600, dtype=np.int32)  # longer than capacity 256: split into pieces
    paths = [write_arrow(root / "a.arrow", seqs[0], batch_rows=16), write_tar(root / "b.tar", seqs[1]),
             write_arrow(root / "c.arrow", seqs[2])]
    return paths, seqs


@pytest.fixture(scope="module")
def prepacked_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_pp")
    seqs = [random_sequences(n, seed=_SEED + 10 + k, max_len=200) for k, n in enumerate([45, 40])]
    d, _ = write_prepacked(root / "pp", seqs, 256, rows_per_file=11, batch_rows=4)
    return d, seqs


SOURCES = {
    "online": ("stream", dict(capacity=256, overflow="split", algorithm="online", buffer_size=12, seed=3)),
    "bfd": ("stream", dict(capacity=256, overflow="split", algorithm="bfd", seed=3)),
    "prepacked": ("prepacked", dict(seed=5)),
}


def corpus(request, name):
    kind, kw = SOURCES[name]
    source, seqs = request.getfixturevalue("stream_corpus" if kind == "stream" else "prepacked_corpus")
    return source, seqs, kw


class Plan:
    """The epoch's plan of rows, as the loader's rows object computes it (no rank, world size or worker
    count goes in), with a map from what a batch exposes back to the plan index."""

    def __init__(self, loader, epoch):
        rows = loader.dataset.rows
        self.prepacked = isinstance(rows, PrepackedRows)
        if self.prepacked:
            order = rows.order(loader.seed, epoch, loader.shuffle)
            self.n = len(order)
            self.index = {int(g): i for i, g in enumerate(order)}
        else:
            p = rows.plan(loader.seed, epoch, loader.shuffle)
            self.n = len(p)
            pieces = list(zip(p.shard.tolist(), p.row.tolist(), p.start.tolist(), p.length.tolist()))
            ro = p.row_offsets.tolist()
            self.index = {tuple(pieces[ro[r]:ro[r + 1]]): r for r in range(self.n)}
            assert len(self.index) == self.n

    def rows_of(self, batch) -> list[int]:
        """Plan indices of the batch's real rows (padding rows left out)."""
        sid = batch["sample_ids"].numpy()
        if self.prepacked:
            return [self.index[int(g)] for g in batch["row_ids"].tolist() if g >= 0]
        out = []
        for b in range(batch["input_ids"].shape[0]):
            key = tuple(tuple(x) for x in sid[sid[:, 0] == b, 1:].tolist())
            if key:
                out.append(self.index[key])
        return out


def pieces_of(batch):
    return [tuple(x) for x in batch["sample_ids"][:, 1:].tolist()]


def make_ranks(source, kw, world, batch_size, **extra):
    return [PackedDataLoader(source, batch_size=batch_size, rank=r, world_size=world, return_ids=True,
                             **{**kw, **extra}) for r in range(world)]


def lockstep_states(loaders, plan, epoch=EPOCH):
    """Step every rank's loader through the epoch in lock-step. Returns, for every cut k (batches per
    rank consumed, 0..n), the common state (checked identical on every rank, through JSON) and the plan
    rows and pieces consumed up to it."""
    its = []
    for dl in loaders:
        dl.set_epoch(epoch)
        its.append(iter(dl))
    n = len(loaders[0])
    assert [len(dl) for dl in loaders] == [n] * len(loaders)
    rows, pieces, cuts = [], [], []
    for k in range(n + 1):
        states = [json.loads(json.dumps(dl.state_dict())) for dl in loaders]
        assert all(s == states[0] for s in states), "ranks saved different states"
        cuts.append((states[0], list(rows), list(pieces)))
        if k < n:
            for it in its:
                b = next(it)
                rows += plan.rows_of(b)
                pieces += pieces_of(b)
    for it in its:
        with pytest.raises(StopIteration):
            next(it)
    return cuts


def resume_ranks(loaders, state, plan, epoch=EPOCH, seqs=None):
    """Load ``state`` into every rank's loader and run the usual loop (``set_epoch(state epoch)``, iterate).
    Returns (plan rows, pieces) of the rest; checks equal batch counts and static shapes."""
    rows, pieces, counts = [], [], []
    for dl in loaders:
        dl.load_state_dict(state)
        dl.set_epoch(epoch)
        it = iter(dl)
        n = len(it)  # batches this iterator will yield
        got = 0
        for b in it:
            assert tuple(b["input_ids"].shape) == (dl.batch_size, dl.capacity)
            if seqs is not None and not plan.prepacked:
                check_stream_batch(b, seqs, dl.capacity)  # the tokens are the named source tokens
            rows += plan.rows_of(b)
            pieces += pieces_of(b)
            got += 1
        assert got == n
        counts.append(got)
    assert len(set(counts)) == 1, f"ranks yield different batch counts {counts}"
    return rows, pieces, counts[0]


def expected_rest(n_rows, done, world, batch_size, drop_last):
    if not drop_last:
        return list(range(done, n_rows))
    step = world * batch_size
    return list(range(done, done + (n_rows - done) // step * step))


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("w1, b1", [(2, 2), (3, 1)])
def test_every_cut_resumes_on_1_to_4_ranks_with_another_batch_size(request, name, w1, b1):
    """Every cut point of an epoch at (w1, b1), resumed at world sizes 1..4 and another batch size:
    consumed + rest is every plan row exactly once (so every sequence exactly once), nothing consumed
    comes again, ranks stay in step."""
    source, seqs, kw = corpus(request, name)
    first = make_ranks(source, kw, w1, b1)
    plan = Plan(first[0], EPOCH)
    cuts = lockstep_states(first, plan)
    n1 = len(cuts) - 1
    assert n1 >= 4 and plan.n >= 12, (n1, plan.n)
    layouts = [(w2, b2) for w2 in (1, 2, 3, 4) for b2 in (1, 3) if (w2, b2) != (w1, b1)]
    seconds = {lay: make_ranks(source, kw, *lay) for lay in layouts}  # reused across cuts
    for k, (state, rows_before, pieces_before) in enumerate(cuts):
        done = plan.n if k == n1 else k * w1 * b1
        assert state["rows_consumed"] == done and state["epoch"] == EPOCH
        assert sorted(rows_before) == list(range(min(done, plan.n)))
        for (w2, b2), loaders in seconds.items():
            rows, pieces, n2 = resume_ranks(loaders, state, plan, seqs=seqs if k % 3 == 0 else None)
            assert sorted(rows) == list(range(done, plan.n)), (k, w2, b2)  # each remaining row once
            assert not set(rows) & set(rows_before)
            assert n2 == -(-(plan.n - done) // (w2 * b2)), (k, w2, b2, n2)
            assert_exact_cover(pieces_before + pieces, seqs)  # the union is every sequence, once


@pytest.mark.parametrize("name", list(SOURCES))
def test_global_order_does_not_depend_on_world_size_or_workers(request, name):
    """Global step s of any layout holds plan rows [s*S, (s+1)*S), the plan being computed without any
    rank, world size or worker count: the online packer runs over the whole epoch on every rank."""
    source, seqs, kw = corpus(request, name)
    plan = None
    for world, batch_size, workers in [(1, 1, 0), (2, 3, 0), (3, 2, 2), (4, 1, 1)]:
        loaders = make_ranks(source, kw, world, batch_size, num_workers=workers)
        plan = plan or Plan(loaders[0], EPOCH)
        per_rank = []
        for dl in loaders:
            dl.set_epoch(EPOCH)
            per_rank.append([plan.rows_of(b) for b in dl])
        step = world * batch_size
        for s in range(len(per_rank[0])):
            got = sorted(r for ranks in per_rank for r in ranks[s])
            assert got == list(range(s * step, min((s + 1) * step, plan.n))), (world, batch_size, s)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(list(SOURCES)),
       layouts=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.booleans()), min_size=3, max_size=3))
def test_chained_elastic_resumes_and_exact_resume_after_them(request, data, name, layouts):
    """Resume twice with random layouts (world size, batch size, drop_last) at random cuts, then resume a
    third time with the last layout: that one is batch-identical to the loaders that kept going."""
    source, seqs, kw = corpus(request, name)
    (w1, b1, d1), (w2, b2, d2), (w3, b3, d3) = layouts
    first = make_ranks(source, kw, w1, b1, drop_last=d1)
    plan = Plan(first[0], EPOCH)
    cuts = lockstep_states(first, plan)
    state, rows, pieces = cuts[data.draw(st.integers(0, len(cuts) - 1), label="cut1")]
    done = state["rows_consumed"]
    for w, b, d in [(w2, b2, d2), (w3, b3, d3)]:
        loaders = make_ranks(source, kw, w, b, drop_last=d)
        for dl in loaders:
            dl.load_state_dict(state)
            dl.set_epoch(EPOCH)
        its = [iter(dl) for dl in loaders]
        n = len(its[0])
        assert [len(it) for it in its] == [n] * w
        cut = data.draw(st.integers(0, n), label="cut")
        for _ in range(cut):
            for it in its:
                bt = next(it)
                rows += plan.rows_of(bt)
                pieces += pieces_of(bt)
        states = [dl.state_dict() for dl in loaders]
        assert all(s == states[0] for s in states)
        state = json.loads(json.dumps(states[0]))
        done = state["rows_consumed"]
        # all rows before the resume point were handed out, except a tail that drop_last dropped
        assert sorted(rows) == list(range(done if done < plan.n else len(rows)))
        # exact resume with the same layout: fresh loaders give what the running ones give next
        again = make_ranks(source, kw, w, b, drop_last=d)
        for dl, it in zip(again, its):
            dl.load_state_dict(state)
            dl.set_epoch(EPOCH)
            assert [batch_fingerprint(x) for x in dl] == [batch_fingerprint(x) for x in it]
    # the rest after the last cut, on the last layout
    rest, rest_pieces, _ = resume_ranks(make_ranks(source, kw, w3, b3, drop_last=d3), state, plan)
    assert not set(rest) & set(rows)
    assert sorted(rest) == expected_rest(plan.n, done, w3, b3, d3)
    if not (d1 or d2 or d3):
        assert sorted(rows + rest) == list(range(plan.n))
        assert_exact_cover(pieces + rest_pieces, seqs)


def test_resume_with_other_workers_and_world_size(stream_corpus):
    """World size, batch size and num_workers change together (workers build the rest); persistent
    workers that already ran a whole epoch take up the resumed schedule (another offset)."""
    paths, seqs = stream_corpus
    kw = SOURCES["online"][1]
    first = make_ranks(paths, kw, 2, 2)
    plan = Plan(first[0], EPOCH)
    cuts = lockstep_states(first, plan)
    # a resume point that is not a step boundary of the new layout (3 ranks x 1 row)
    state, rows, pieces = next(c for k, c in enumerate(cuts) if len(cuts) // 2 <= k < len(cuts) - 1 and k * 4 % 3)
    rest, rest_pieces, _ = resume_ranks(make_ranks(paths, kw, 3, 1, num_workers=2), state, plan, seqs=seqs)
    assert sorted(rows + rest) == list(range(plan.n)) and not set(rows) & set(rest)
    assert_exact_cover(pieces + rest_pieces, seqs)

    second = make_ranks(paths, kw, 3, 1, num_workers=2, persistent_workers=True)
    whole = []
    for dl in second:
        dl.set_epoch(EPOCH)
        whole += [r for b in dl for r in plan.rows_of(b)]  # starts the workers, whole epoch
    assert sorted(whole) == list(range(plan.n))
    again, _, _ = resume_ranks(second, state, plan)
    assert sorted(again) == sorted(rest)


@pytest.mark.parametrize("name", ["online", "prepacked"])
def test_same_layout_is_batch_identical_and_len_is_unchanged(request, name):
    """With the saving world size and batch size nothing changes: same batches, same len(loader), same
    batch counter, at every cut."""
    source, seqs, kw = corpus(request, name)
    ref = make_ranks(source, kw, 2, 2)
    fps = []
    for dl in ref:
        dl.set_epoch(EPOCH)
        fps.append([batch_fingerprint(b) for b in dl])
    n = len(fps[0])
    first = make_ranks(source, kw, 2, 2)
    cuts = lockstep_states(first, Plan(first[0], EPOCH))
    for k, (state, _, _) in enumerate(cuts):
        assert state["batches_consumed"] == k
        for r, dl in enumerate(make_ranks(source, kw, 2, 2)):
            dl.load_state_dict(state)
            dl.set_epoch(EPOCH)
            assert len(dl) == n and dl.state_dict()["batches_consumed"] == k
            assert [batch_fingerprint(b) for b in dl] == fps[r][k:]


def test_end_of_epoch_with_drop_last_resumes_empty_then_next_epoch(stream_corpus):
    """A state saved after the last batch of an epoch (drop_last: its tail rows dropped) resumes with an
    empty rest even on a layout whose steps would fit that tail; the next epoch is whole."""
    paths, _ = stream_corpus
    kw = SOURCES["online"][1]
    plan = Plan(PackedDataLoader(paths, **kw), EPOCH)
    world, batch_size = next((w, b) for w, b in [(4, 3), (3, 3), (2, 5), (4, 2)] if plan.n % (w * b))
    first = make_ranks(paths, kw, world, batch_size, drop_last=True)  # a tail of rows is dropped
    state = lockstep_states(first, plan)[-1][0]
    assert state["rows_consumed"] == plan.n
    for dl in make_ranks(paths, kw, 1, 1):
        dl.load_state_dict(state)
        dl.set_epoch(EPOCH)
        assert list(dl) == []
        dl.set_epoch(EPOCH + 1)
        assert len(list(dl)) == len(Plan(dl, EPOCH + 1).index)


def test_version_1_state_resumes_elastically(stream_corpus):
    """A state written by the previous format (batches of the saving layout) loads on another layout."""
    paths, seqs = stream_corpus
    kw = SOURCES["online"][1]
    first = make_ranks(paths, kw, 2, 2)
    plan = Plan(first[0], EPOCH)
    state, rows, pieces = lockstep_states(first, plan)[3]
    old = {"format": state["format"], "version": 1, "epoch": EPOCH, "batches_consumed": 3, "rank": 0,
           "settings": state["settings"]}
    rest, rest_pieces, _ = resume_ranks(make_ranks(paths, kw, 3, 1), old, plan)
    assert sorted(rest) == list(range(12, plan.n))
    assert_exact_cover(pieces + rest_pieces, seqs)


@pytest.mark.parametrize("change, key", [
    ({"seed": 4}, "seed"),
    ({"capacity": 300}, "capacity"),
    ({"buffer_size": 5}, "buffer_size"),
    ({"algorithm": "bfd"}, "algorithm"),
    ({"shuffle": False}, "shuffle"),
])
def test_plan_changes_are_refused_and_say_what_may_change(stream_corpus, change, key):
    paths, _ = stream_corpus
    kw = SOURCES["online"][1]
    state = make_ranks(paths, kw, 2, 2)[0].state_dict()
    other = PackedDataLoader(paths, batch_size=3, rank=0, world_size=3, **{**kw, **change})
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    msg = str(e.value)
    assert f"mismatch: '{key}' was" in msg
    assert "world_size, batch_size, drop_last and num_workers may change" in msg
    assert "(source, capacity, seed, shuffle, algorithm, buffer_size, overflow, max_items_per_bin)" in msg


def test_another_source_or_plan_is_refused(stream_corpus, prepacked_corpus):
    paths, _ = stream_corpus
    kw = SOURCES["online"][1]
    state = PackedDataLoader(paths, **kw).state_dict()
    with pytest.raises(ValueError, match="mismatch: 'source'"):
        PackedDataLoader(paths[::-1], **kw).load_state_dict(state)  # the same shards in another order
    with pytest.raises(ValueError, match="mismatch: 'source'"):
        PackedDataLoader(prepacked_corpus[0]).load_state_dict(state)
    # the same settings but another plan (as after a change of the packer): refused, not misread
    with pytest.raises(ValueError, match="epoch 0's plan was .* the packer or the shuffling changed"):
        PackedDataLoader(paths, **kw).load_state_dict({**state, "epoch_digest": "0" * 16})
    with pytest.raises(ValueError, match="epoch 0's plan was"):
        PackedDataLoader(paths, **kw).load_state_dict({**state, "epoch_rows": state["epoch_rows"] + 1})
