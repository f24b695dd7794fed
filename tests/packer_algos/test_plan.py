"""PackPlan: properties, bin(), and validate() catching every kind of broken plan."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packer_algos import PackPlan, pack

from .helpers import algorithms, capacities, length_lists


def _copy(plan, **changes):
    kw = dict(split_ids=plan.split_ids, truncated_ids=plan.truncated_ids, dropped_ids=plan.dropped_ids,
              n_empty=plan.n_empty, algorithm=plan.algorithm, overflow=plan.overflow,
              max_items_per_bin=plan.max_items_per_bin)
    arrays = dict(capacity=plan.capacity, bin_offsets=plan.bin_offsets.copy(),
                  item_ids=plan.item_ids.copy(), starts=plan.starts.copy(), lengths=plan.lengths.copy())
    for k, v in changes.items():
        (arrays if k in arrays else kw)[k] = v
    return PackPlan(arrays.pop("capacity"), *arrays.values(), **kw)


def test_properties_match_hand_computation():
    rng = np.random.default_rng()
    lengths = rng.integers(1, 100, 300)
    plan = pack(lengths, 128, "bfd")
    assert plan.n_pieces == 300
    assert plan.total_tokens == lengths.sum()
    assert plan.lower_bound == -(-int(lengths.sum()) // 128)
    assert plan.efficiency == pytest.approx(lengths.sum() / (plan.n_bins * 128))
    assert len(plan) == plan.n_bins
    got = np.concatenate([plan.bin(b)[0] for b in range(plan.n_bins)])
    assert np.array_equal(got, plan.item_ids)
    assert np.array_equal(plan.bin(-1)[0], plan.bin(plan.n_bins - 1)[0])
    assert np.array_equal(plan.bin_lengths(), [plan.bin(b)[2].sum() for b in range(plan.n_bins)])
    with pytest.raises(IndexError):
        plan.bin(plan.n_bins)
    assert "PackPlan(" in repr(plan) and "bfd" in repr(plan)


def test_bin_returns_views():
    plan = pack([3, 4, 5], 8, "first_fit")
    ids, starts, lens = plan.bin(0)
    assert ids.base is not None and np.shares_memory(ids, plan.item_ids)


@st.composite
def plans(draw):
    capacity = draw(st.integers(2, 30))
    lengths = draw(length_lists(capacity, allow_zero=True)).copy()
    lengths.append(draw(st.integers(1, capacity)))  # at least one piece
    overflow = draw(st.sampled_from(["split", "truncate", "drop"]))
    lengths.append(draw(st.integers(capacity + 1, 3 * capacity)))  # at least one overflow
    lengths.append(draw(st.integers(1, capacity)))  # a piece after the overflow, still kept
    plan = pack(lengths, capacity, draw(algorithms), overflow=overflow)
    return plan, lengths


CORRUPTIONS = ["drop_piece", "duplicate_piece", "shrink_piece", "grow_piece", "shift_start",
               "merge_bins", "bad_item", "empty_bin", "bad_offsets_end", "wrong_n_empty",
               "wrong_records", "zero_length_piece", "wrong_capacity", "cap_items", "wrong_dtype"]


@settings(max_examples=100, deadline=None)
@given(plans(), st.sampled_from(CORRUPTIONS), st.data())
def test_validate_catches_corruption(pl, corruption, data):
    plan, lengths = pl
    plan.validate(lengths)  # the real plan is fine
    m, nb = plan.n_pieces, plan.n_bins
    k = data.draw(st.integers(0, m - 1))
    ids, starts, lens, off = plan.item_ids.copy(), plan.starts.copy(), plan.lengths.copy(), plan.bin_offsets.copy()
    if corruption == "drop_piece":
        ids, starts, lens = np.delete(ids, k), np.delete(starts, k), np.delete(lens, k)
        b = int(np.searchsorted(off, k, side="right") - 1)
        off[b + 1:] -= 1
        bad = _copy(plan, bin_offsets=off, item_ids=ids, starts=starts, lengths=lens)
        if np.any(np.diff(off) == 0):  # removing the only piece of a bin: drop the bin too
            keep = np.concatenate(([True], np.diff(off) > 0))
            bad = _copy(bad, bin_offsets=off[keep])
    elif corruption == "duplicate_piece":  # the same piece again, as its own extra bin
        bad = _copy(plan, bin_offsets=np.append(off, m + 1), item_ids=np.append(ids, ids[k]),
                    starts=np.append(starts, starts[k]), lengths=np.append(lens, lens[k]))
    elif corruption == "shrink_piece":
        if lens[k] == 1:
            lens[k] = 2  # then grow instead
        else:
            lens[k] -= 1
        bad = _copy(plan, lengths=lens)
    elif corruption == "grow_piece":
        lens[k] += 1
        bad = _copy(plan, lengths=lens)
    elif corruption == "shift_start":
        starts[k] += data.draw(st.sampled_from([-1, 1]))
        bad = _copy(plan, starts=starts)
    elif corruption == "merge_bins":  # two rows whose contents overflow one row, as one row
        used = plan.bin_lengths()
        pairs = [(a, a + 1) for a in range(nb - 1) if used[a] + used[a + 1] > plan.capacity]
        if not pairs:
            ids[k] = -1
            bad = _copy(plan, item_ids=ids)
        else:
            a, _ = data.draw(st.sampled_from(pairs))
            bad = _copy(plan, bin_offsets=np.delete(off, a + 1))
    elif corruption == "bad_item":
        ids[k] = data.draw(st.sampled_from([-1, len(lengths), 10**9]))
        bad = _copy(plan, item_ids=ids)
    elif corruption == "empty_bin":
        bad = _copy(plan, bin_offsets=np.insert(off, 1, 0))
    elif corruption == "bad_offsets_end":
        off[-1] -= 1
        bad = _copy(plan, bin_offsets=off)
    elif corruption == "wrong_n_empty":
        bad = _copy(plan, n_empty=plan.n_empty + data.draw(st.sampled_from([-1, 1])))
    elif corruption == "wrong_records":
        field = {"split": "split_ids", "truncate": "truncated_ids", "drop": "dropped_ids"}[plan.overflow]
        bad = _copy(plan, **{field: getattr(plan, field)[1:]})
    elif corruption == "zero_length_piece":
        lens[k] = 0
        bad = _copy(plan, lengths=lens)
    elif corruption == "wrong_capacity":
        bad = _copy(plan, capacity=int(plan.bin_lengths().max()) - 1)
    elif corruption == "cap_items":
        biggest = int(np.diff(off).max())
        if biggest < 2:
            bad = _copy(plan, capacity=0)
        else:
            bad = _copy(plan, max_items_per_bin=biggest - 1)
    elif corruption == "wrong_dtype":
        bad = _copy(plan)
        bad.item_ids = bad.item_ids.astype(np.int32)
    with pytest.raises(ValueError, match="invalid PackPlan"):
        bad.validate(lengths)


def test_validate_rejects_other_lengths():
    lengths = [5, 3, 6, 2]
    plan = pack(lengths, 8, "bfd")
    with pytest.raises(ValueError, match="sequence 0"):
        plan.validate([4, 3, 6, 2])
    with pytest.raises(ValueError, match="not placed"):
        plan.validate([5, 3, 6, 2, 7])
    with pytest.raises(ValueError, match="overflow='error'"):
        plan.validate([5, 3, 6, 2, 9])
