"""OnlinePacker: the documented rule, batching, checkpoint/resume, bounded buffer, errors."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_algos import OnlinePacker, pack

from . import reference as ref
from .helpers import csr_bins, length_lists, max_items, plan_bins, tuple_bins

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def streams(draw):
    capacity = draw(st.integers(1, 40))
    lengths = draw(length_lists(capacity, max_size=150))
    buffer_size = draw(st.integers(1, 16))
    mx = draw(max_items)
    overflow = draw(st.sampled_from(["split", "truncate", "drop"]))
    ids = draw(st.lists(st.integers(-2**40, 2**40), min_size=len(lengths), max_size=len(lengths),
                        unique=True))
    return capacity, lengths, buffer_size, mx, overflow, ids


def _packer(capacity, buffer_size, mx, overflow):
    return OnlinePacker(capacity, buffer_size, max_items_per_bin=mx, overflow=overflow)


def _ref_pieces(ids, lengths, capacity, overflow):
    ps, *_ = ref.pieces(lengths, capacity, overflow)
    return [(ids[i], s, n) for i, s, n in ps]


@SETTINGS
@given(streams(), st.data())
def test_push_many_matches_reference_and_single_pushes(stream, data):
    capacity, lengths, buffer_size, mx, overflow, ids = stream
    want = ref.online(_ref_pieces(ids, lengths, capacity, overflow), capacity, buffer_size, mx)

    one = _packer(capacity, buffer_size, mx, overflow)
    got_one = []
    for i, n in zip(ids, lengths):
        got_one += tuple_bins(one.push(i, n))
    got_one += tuple_bins(one.flush())
    assert got_one == want

    # random batch boundaries give the same bins
    many = _packer(capacity, buffer_size, mx, overflow)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=5)))
    got_many = []
    for a, b in zip([0] + cuts, cuts + [len(lengths)]):
        got_many += tuple_bins(many.push_many(ids[a:b], lengths[a:b]))
    got_many += tuple_bins(many.flush())
    assert got_many == want
    assert one.n_pending == many.n_pending == 0

    # every kept token is emitted exactly once, rows within capacity and max items
    for b in want:
        assert sum(p[2] for p in b) <= capacity
        assert mx is None or len(b) <= mx
    assert one.n_empty == sum(1 for n in lengths if n == 0)
    n_over = sum(1 for n in lengths if n > capacity)
    assert (one.n_split, one.n_truncated, one.n_dropped) == (
        n_over * (overflow == "split"), n_over * (overflow == "truncate"), n_over * (overflow == "drop"))


@SETTINGS
@given(streams(), st.data())
def test_checkpoint_resume_gives_identical_bins(stream, data):
    capacity, lengths, buffer_size, mx, overflow, ids = stream
    cut = data.draw(st.integers(0, len(lengths)))
    a = _packer(capacity, buffer_size, mx, overflow)
    before = tuple_bins(a.push_many(ids[:cut], lengths[:cut]))
    state = a.state_dict()
    text = json.dumps(state)  # JSON-serializable
    assert len(state["pending_ids"]) <= buffer_size
    after_a = tuple_bins(a.push_many(ids[cut:], lengths[cut:])) + tuple_bins(a.flush())

    b = _packer(capacity, buffer_size, mx, overflow)
    b.push_many([10**12], [1])  # junk that the restore must wipe
    b.load_state_dict(json.loads(text))
    assert b.state_dict() == state
    after_b = tuple_bins(b.push_many(ids[cut:], lengths[cut:])) + tuple_bins(b.flush())
    assert after_a == after_b
    uninterrupted = ref.online(_ref_pieces(ids, lengths, capacity, overflow), capacity, buffer_size, mx)
    assert before + after_b == uninterrupted
    assert a.state_dict()["counters"] == b.state_dict()["counters"]


@SETTINGS
@given(streams())
def test_pack_online_is_the_packer_flushed(stream):
    capacity, lengths, buffer_size, mx, overflow, _ = stream
    plan = pack(lengths, capacity, "online", overflow=overflow, max_items_per_bin=mx,
                buffer_size=buffer_size)
    plan.validate(lengths)
    p = _packer(capacity, buffer_size, mx, overflow)
    assert plan_bins(plan) == csr_bins(*p.push_many_csr(np.arange(len(lengths)), lengths, flush=True))


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 12), st.data())
def test_no_item_waits_more_than_buffer_size_bins(capacity, buffer_size, data):
    """Each closed bin starts with the oldest pending item, so an item is in one of the
    buffer_size + 1 bins closed after its push (order is kept up to the buffer window)."""
    lengths = data.draw(length_lists(capacity, allow_zero=False, allow_over=False, max_size=200))
    p = OnlinePacker(capacity, buffer_size)
    closed_before = {}
    where = {}
    n_closed = 0
    for i, n in enumerate(lengths):
        closed_before[i] = n_closed
        for b in p.push(i, n):
            for item in b[0].tolist():
                where[item] = n_closed
            n_closed += 1
        assert p.n_pending <= buffer_size
    for b in p.flush():
        for item in b[0].tolist():
            where[item] = n_closed
        n_closed += 1
    assert sorted(where) == list(range(len(lengths)))
    for i in where:
        assert where[i] - closed_before[i] <= buffer_size


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 12), st.data())
def test_bins_start_with_oldest_then_longest_fit(capacity, buffer_size, data):
    lengths = data.draw(length_lists(capacity, allow_zero=False, allow_over=False, max_size=100))
    p = OnlinePacker(capacity, buffer_size)
    pending = []
    for i, n in enumerate(lengths):
        pending.append((i, n))
        for ids, _, lens in p.push(i, n):
            assert ids[0] == pending[0][0]  # the oldest pending item opens the bin
            for item, ln in zip(ids.tolist(), lens.tolist()):
                pending.remove((item, ln))
            rem = capacity - int(lens.sum())
            assert all(n2 > rem for _, n2 in pending) or rem == 0  # nothing pending still fits
            assert list(lens[1:]) == sorted(lens[1:], reverse=True)  # fillers longest first


def test_split_in_online_packer():
    p = OnlinePacker(10, 4, overflow="split")
    bins = p.push(7, 25) + p.flush()
    pieces = sorted(x for b in tuple_bins(bins) for x in b)
    assert pieces == [(7, 0, 10), (7, 10, 10), (7, 20, 5)]
    assert p.n_split == 1


def test_efficiency_on_shuffled_mix():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 512, 20000)
    plan = pack(lengths, 512, "online", buffer_size=200).validate(lengths)
    assert plan.efficiency > 0.97
    assert plan.n_bins < pack(lengths, 512, "next_fit").n_bins


# ------------------------------------------------------------------ errors
def test_errors():
    with pytest.raises(ValueError, match="capacity"):
        OnlinePacker(0, 10)
    with pytest.raises(ValueError, match="buffer_size"):
        OnlinePacker(10, 0)
    with pytest.raises(ValueError, match="overflow"):
        OnlinePacker(10, 5, overflow="nope")
    p = OnlinePacker(10, 5)
    with pytest.raises(ValueError, match="item 42 has length 11 > capacity 10"):
        p.push(42, 11)
    with pytest.raises(ValueError, match="negative"):
        p.push(1, -1)
    with pytest.raises(TypeError, match="lengths"):
        p.push_many([1, 2], [1.5, 2.0])
    with pytest.raises(ValueError, match="one id per length"):
        p.push_many([1, 2, 3], [1, 2])
    assert p.n_pending == 0 and p.n_pushed == 0  # failed pushes change nothing
    p.push(0, 0)
    assert p.n_empty == 1 and p.n_pending == 0
    other = OnlinePacker(12, 5)
    with pytest.raises(ValueError, match="capacity"):
        other.load_state_dict(p.state_dict())
