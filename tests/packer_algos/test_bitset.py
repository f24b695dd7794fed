"""The hierarchical bitset behind BFD, and the run-at-a-time FFD/BFD kernels on capacities that need
several bitset levels, against plain Python."""
import numpy as np
import pytest
from numba import njit

from packer_algos import pack
from packer_algos._bitset import bs_clear, bs_new, bs_next, bs_prev, bs_set

from . import reference as ref
from .helpers import plan_bins


@njit  # not cached: Numba's cache would not notice edits to the inlined _bitset functions
def _replay(n_keys, ops, keys):
    bits, off, nbits = bs_new(n_keys)
    out = np.zeros(ops.size, dtype=np.int64)
    for t in range(ops.size):
        o = ops[t]
        if o == 0:
            bs_set(bits, off, keys[t])
        elif o == 1:
            bs_clear(bits, off, keys[t])
        elif o == 2:
            out[t] = bs_next(bits, off, nbits, keys[t])
        else:
            out[t] = bs_prev(bits, off, nbits, keys[t])
    return out


@pytest.mark.parametrize("n_keys", [1, 2, 63, 64, 65, 129, 4096, 4097, 4160, 262_145])
def test_bitset_matches_a_python_set(n_keys):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    T = 4000
    ops = rng.integers(0, 4, T)
    # keys clustered in a random window (so sets get dense) or spread out; queries a bit out of range
    lo = int(rng.integers(0, n_keys))
    width = int(rng.integers(1, 300))
    keys = np.where(rng.random(T) < 0.7, lo + rng.integers(0, width, T), rng.integers(0, n_keys, T))
    keys = np.minimum(keys, n_keys - 1)
    q = ops >= 2
    keys[q] = np.clip(keys[q] + rng.integers(-70, 70, q.sum()), -1, n_keys + 70)
    if (ops == 0).any():
        keys[ops == 0] = np.clip(keys[ops == 0], 0, n_keys - 1)
    keys[ops == 1] = np.clip(keys[ops == 1], 0, n_keys - 1)
    got = _replay(n_keys, ops.astype(np.int64), keys.astype(np.int64))
    present = set()
    for t, (o, k) in enumerate(zip(ops.tolist(), keys.tolist())):
        if o == 0:
            present.add(k)
        elif o == 1:
            present.discard(k)
        elif o == 2:
            want = min((x for x in present if x >= k), default=-1)
            assert got[t] == want, f"seed {seed}: next({k}) at step {t}"
        else:
            want = max((x for x in present if x <= k), default=-1)
            assert got[t] == want, f"seed {seed}: prev({k}) at step {t}"


@pytest.mark.parametrize("capacity", [64, 65, 4096, 5000])
@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
def test_decreasing_kernels_match_reference_on_large_capacities(capacity, algorithm):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        n = int(rng.integers(50, 300))
        # few distinct lengths (long runs shared by many bins) or lognormal-like spread
        if rng.random() < 0.5:
            choices = rng.integers(1, capacity + 1, int(rng.integers(1, 6)))
            lengths = rng.choice(choices, n)
        else:
            lengths = np.clip(rng.lognormal(np.log(capacity / 6), 0.9, n).astype(np.int64), 1, capacity)
        mx = None if rng.random() < 0.5 else int(rng.integers(1, 6))
        plan = pack(lengths, capacity, algorithm, max_items_per_bin=mx)
        plan.validate(lengths)
        assert plan_bins(plan) == ref.pack(lengths.tolist(), capacity, algorithm, mx=mx), \
            f"seed {seed}, n {n}, max_items {mx}"
