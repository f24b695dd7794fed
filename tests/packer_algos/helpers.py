"""Shared bits for the packer_algos tests."""
import numpy as np
from hypothesis import strategies as st

from packer_algos import ALGORITHMS, OVERFLOW_POLICIES


def plan_bins(plan):
    """A PackPlan as a list of bins, each a list of (item_id, start, length) tuples."""
    return [list(zip(*(a.tolist() for a in plan.bin(b)))) for b in range(plan.n_bins)]


def csr_bins(off, ids, starts, lens):
    return [list(zip(ids[a:b].tolist(), starts[a:b].tolist(), lens[a:b].tolist()))
            for a, b in zip(off[:-1].tolist(), off[1:].tolist())]


def tuple_bins(bins):
    """OnlinePacker bins (tuples of arrays) as lists of (item_id, start, length)."""
    return [list(zip(i.tolist(), s.tolist(), n.tolist())) for i, s, n in bins]


capacities = st.integers(min_value=1, max_value=40)
algorithms = st.sampled_from(ALGORITHMS)
overflows = st.sampled_from(OVERFLOW_POLICIES)
max_items = st.one_of(st.none(), st.integers(min_value=1, max_value=5))


@st.composite
def length_lists(draw, capacity, max_size=120, allow_zero=True, allow_over=True):
    """Lengths in [0 or 1, capacity or 3*capacity]; sometimes many ties, sometimes spread out."""
    lo = 0 if allow_zero else 1
    hi = 3 * capacity if allow_over else capacity
    if draw(st.booleans()):
        hi = min(hi, lo + draw(st.integers(0, 4)))  # few distinct lengths: lots of ties
    return draw(st.lists(st.integers(lo, max(lo, hi)), max_size=max_size))


def as_array(values, dtype):
    return np.asarray(values, dtype=dtype)
