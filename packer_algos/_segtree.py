"""Numba helpers: a bottom-up segment tree over small integer keys, for "nearest non-empty key" queries.

The tree lives in one int64 array ``tree`` of size ``2 * P`` (``P`` a power of two); leaf ``k`` is
``tree[P + k]`` and holds how many things have key ``k``; an inner node is 1 when some leaf below it
is non-zero, else 0 (so an update stops climbing as soon as an ancestor does not change). A query finds
the largest non-empty key ``<= hi`` in O(log P). The online packer keys it by *item length* (its buffer).
"""
from numba import njit


def tree_size(n_keys: int) -> int:
    """Smallest power of two >= n_keys (at least 2)."""
    p = 2
    while p < n_keys:
        p *= 2
    return p


@njit(cache=True, inline="always")
def seg_inc(tree, P, key):
    """One more thing with ``key``."""
    i = key + P
    tree[i] += 1
    if tree[i] == 1:
        i >>= 1
        while i >= 1 and tree[i] == 0:
            tree[i] = 1
            i >>= 1


@njit(cache=True, inline="always")
def seg_dec(tree, P, key):
    """One thing fewer with ``key`` (its count must be > 0)."""
    i = key + P
    tree[i] -= 1
    if tree[i] == 0:
        i >>= 1
        while i >= 1 and tree[2 * i] == 0 and tree[2 * i + 1] == 0:
            tree[i] = 0
            i >>= 1


@njit(cache=True, inline="always")
def seg_last_le(tree, P, hi):
    """Largest key ``<= hi`` whose count is > 0, or -1 when there is none."""
    if hi < 0:
        return -1
    if hi >= P:
        hi = P - 1
    i = hi + P
    if tree[i] > 0:
        return hi
    while i > 1:
        if (i & 1) == 1 and tree[i - 1] > 0:
            i = i - 1
            while i < P:
                i = 2 * i + 1
                if tree[i] == 0:
                    i -= 1
            return i - P
        i >>= 1
    return -1

