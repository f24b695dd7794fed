"""pack(): invariants for every algorithm and overflow policy, agreement with the pure-Python twins,
clear errors on bad input."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_algos import ALGORITHMS, OVERFLOW_POLICIES, PackPlan, pack

from . import reference as ref
from .helpers import algorithms, capacities, length_lists, max_items, overflows, plan_bins

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def cases(draw):
    capacity = draw(capacities)
    lengths = draw(length_lists(capacity))
    algorithm = draw(algorithms)
    overflow = draw(overflows)
    mx = draw(max_items)
    buffer_size = draw(st.integers(1, 12)) if algorithm == "online" else None
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint16, list]))
    return capacity, lengths, algorithm, overflow, mx, buffer_size, dtype


def _call(capacity, lengths, algorithm, overflow, mx, buffer_size, dtype):
    arg = list(lengths) if dtype is list else np.asarray(lengths, dtype=dtype)
    return pack(arg, capacity, algorithm, overflow=overflow, max_items_per_bin=mx,
                buffer_size=buffer_size)


@SETTINGS
@given(cases())
def test_plan_invariants_hold(case):
    capacity, lengths, algorithm, overflow, mx, buffer_size, dtype = case
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if overflow == "error" and too_long:
        with pytest.raises(ValueError, match=rf"lengths\[{too_long[0]}\] = {lengths[too_long[0]]}"):
            _call(*case)
        return
    plan = _call(*case)
    assert isinstance(plan, PackPlan)
    plan.validate(lengths)  # every token once, no row over capacity, records match the policy
    for name in ("bin_offsets", "item_ids", "starts", "lengths", "split_ids", "truncated_ids",
                 "dropped_ids"):
        assert getattr(plan, name).dtype == np.int64
    # the properties agree with the arrays
    used = [sum(p[2] for p in b) for b in plan_bins(plan)]
    assert plan.n_bins == len(used)
    assert all(0 < u <= capacity for u in used)
    if mx is not None:
        assert all(len(b) <= mx for b in plan_bins(plan))
    assert plan.total_tokens == sum(used)
    assert plan.lower_bound == -(-sum(used) // capacity) <= plan.n_bins
    if plan.n_bins:
        assert plan.efficiency == pytest.approx(sum(used) / (plan.n_bins * capacity))
    assert plan.n_empty == sum(1 for n in lengths if n == 0)
    recorded = {"split": plan.split_ids, "truncate": plan.truncated_ids, "drop": plan.dropped_ids}
    for policy, ids in recorded.items():
        assert ids.tolist() == (too_long if {"carry": "split"}.get(overflow, overflow) == policy else [])


@SETTINGS
@given(cases())
def test_agrees_with_reference(case):
    capacity, lengths, algorithm, overflow, mx, buffer_size, dtype = case
    if overflow == "error" and any(n > capacity for n in lengths):
        overflow = "split"
        case = (capacity, lengths, algorithm, overflow, mx, buffer_size, dtype)
    plan = _call(*case)
    want = ref.pack(lengths, capacity, algorithm, overflow, mx, buffer_size)
    assert plan_bins(plan) == want


@settings(max_examples=40, deadline=None)
@given(capacity=capacities, data=st.data(), algorithm=st.sampled_from(["ffd", "bfd"]),
       seed=st.integers(0, 2**32 - 1), mx=max_items)
def test_seed_shuffles_ties_only(capacity, data, algorithm, seed, mx):
    lengths = data.draw(length_lists(capacity, allow_over=False, allow_zero=False))
    plain = pack(lengths, capacity, algorithm, max_items_per_bin=mx)
    seeded = pack(lengths, capacity, algorithm, max_items_per_bin=mx, seed=seed)
    seeded.validate(lengths)
    # same lengths in the same rows: the seed only changes which equal-length sequence goes where
    assert [b[2].tolist() for b in map(seeded.bin, range(seeded.n_bins))] == \
           [b[2].tolist() for b in map(plain.bin, range(plain.n_bins))]
    # and it is the documented rule: ties ordered by a default_rng(seed) permutation
    m = len(lengths)
    tie_rank = np.argsort(np.random.default_rng(seed).permutation(m)).tolist()
    ps, *_ = ref.pieces(lengths, capacity, "error")
    order = ref.decreasing(ps, tie_rank)
    fit = ref.first_fit if algorithm == "ffd" else ref.best_fit
    assert plan_bins(seeded) == fit(order, capacity, mx)
    # same seed, same plan
    again = pack(lengths, capacity, algorithm, max_items_per_bin=mx, seed=seed)
    assert np.array_equal(again.item_ids, seeded.item_ids)


def test_seed_changes_which_ties_share_a_row():
    lengths = np.random.default_rng(7).integers(1, 4, 2000)
    a = pack(lengths, 10, "bfd", seed=1)
    b = pack(lengths, 10, "bfd", seed=2)
    assert not np.array_equal(a.item_ids, b.item_ids)
    assert np.array_equal(a.lengths, b.lengths)


@settings(max_examples=60, deadline=None)
@given(capacity=capacities, data=st.data(), mx=max_items)
def test_any_fit_rules(capacity, data, mx):
    """Properties that follow from each rule, checked on the output alone."""
    lengths = data.draw(length_lists(capacity, allow_over=False))
    for algorithm in ("first_fit", "ffd", "bfd", "next_fit"):
        plan = pack(lengths, capacity, algorithm, max_items_per_bin=mx)
        bins = plan_bins(plan)
        used = [sum(p[2] for p in b) for b in bins]
        for j, b in enumerate(bins):
            first_len = b[0][2]
            earlier = range(max(j - 1, 0), j) if algorithm == "next_fit" else range(j)
            for i in earlier:
                # bin j was opened because its first piece fit in no earlier open bin
                full_i = mx is not None and len(bins[i]) >= mx
                assert full_i or capacity - used[i] < first_len
        if algorithm in ("ffd", "bfd"):
            ps = [p for b in bins for p in b]
            assert sorted(p[2] for p in ps) == sorted(n for n in lengths if n > 0)


def test_bfd_never_worse_than_next_fit_on_random_mix():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 300, 5000)
    nf = pack(lengths, 512, "next_fit")
    for algorithm in ("ffd", "bfd"):
        plan = pack(lengths, 512, algorithm).validate(lengths)
        assert plan.lower_bound <= plan.n_bins <= nf.n_bins
        assert plan.n_bins <= plan.lower_bound * 1.01 + 1


def test_empty_input_gives_empty_plan():
    for algorithm in ALGORITHMS:
        plan = pack([], 16, algorithm)
        assert plan.n_bins == 0 and plan.n_pieces == 0 and plan.total_tokens == 0
        assert plan.bin_offsets.tolist() == [0]
        plan.validate([])
        zeros = pack([0, 0, 0], 16, algorithm)
        assert zeros.n_bins == 0 and zeros.n_empty == 3
        zeros.validate([0, 0, 0])


def test_split_pieces_cover_the_sequence():
    rng = np.random.default_rng()
    capacity = int(rng.integers(5, 50))
    n = int(rng.integers(2 * capacity + 1, 5 * capacity))
    plan = pack([n, 1], capacity, "bfd", overflow="split").validate([n, 1])
    mine = plan.item_ids == 0
    st_ = np.sort(plan.starts[mine])
    assert st_.tolist() == list(range(0, n, capacity))
    assert plan.lengths[mine].sum() == n
    assert plan.split_ids.tolist() == [0]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_negative_length_names_index(algorithm):
    idx = int(np.random.default_rng().integers(0, 10))
    lengths = [3] * 10
    lengths[idx] = -2
    with pytest.raises(ValueError, match=rf"lengths\[{idx}\] = -2 is negative"):
        pack(lengths, 8, algorithm)


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.array([1.5]), [True, False], ["a"], [[1, 2], [3]]])
def test_non_integer_lengths_rejected(bad):
    with pytest.raises(TypeError, match="lengths"):
        pack(bad, 8)


def test_wrong_shape_rejected():
    with pytest.raises(ValueError, match="1-D"):
        pack(np.ones((2, 2), dtype=np.int64), 8)


@pytest.mark.parametrize("capacity, exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError),
                                           (True, TypeError), ("8", TypeError)])
def test_bad_capacity(capacity, exc):
    with pytest.raises(exc, match="capacity"):
        pack([1, 2], capacity)


def test_unknown_algorithm_and_policy():
    with pytest.raises(ValueError, match="unknown algorithm 'best'"):
        pack([1], 4, "best")
    with pytest.raises(ValueError, match="overflow must be one of"):
        pack([1], 4, overflow="wrap")


def test_overflow_error_names_index_and_length():
    with pytest.raises(ValueError, match=r"lengths\[2\] = 9 is longer than capacity 8"):
        pack([1, 8, 9, 12], 8)


def test_buffer_size_only_for_online():
    with pytest.raises(ValueError, match="buffer_size only applies"):
        pack([1], 4, "bfd", buffer_size=10)
    with pytest.raises(ValueError, match="buffer_size"):
        pack([1], 4, "online", buffer_size=0)


@pytest.mark.parametrize("mx", [0, -1])
def test_bad_max_items(mx):
    with pytest.raises(ValueError, match="max_items_per_bin"):
        pack([1], 4, max_items_per_bin=mx)


def test_module_surface():
    import packer_algos
    assert set(ALGORITHMS) == {"ffd", "bfd", "first_fit", "next_fit", "online"}
    assert set(OVERFLOW_POLICIES) == {"error", "split", "truncate", "drop", "carry"}
    for name in ("pack", "PackPlan", "OnlinePacker"):
        assert hasattr(packer_algos, name)
