"""Input checks and the overflow policies: sequence lengths in, pieces to place out."""
from __future__ import annotations

import numbers

import numpy as np
from numba import njit

OVERFLOW_POLICIES = ("error", "split", "truncate", "drop", "carry")
#: the policies that cut a long sequence into pieces placed as their own items (``carry`` also keeps
#: the pieces' order: see :mod:`packer_algos.chains`)
CUTTING_POLICIES = ("split", "carry")


def check_int(name: str, value, minimum: int = 1, allow_none: bool = False):
    """``value`` as a Python int >= ``minimum``; TypeError / ValueError naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_overflow(overflow) -> str:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    return overflow


def as_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """A 1-D int64 array of non-negative lengths; clear errors for anything else.

    Accepts a numpy integer array or a sequence of Python ints. Rejects floats, booleans, objects
    (TypeError), other shapes and negative values (ValueError naming the first bad index).
    """
    if isinstance(lengths, np.ndarray):
        a = lengths
    else:
        try:
            a = np.asarray(lengths)
        except (ValueError, TypeError) as e:  # ragged input and friends
            raise TypeError(f"{name} must be a 1-D array of integers: {e}") from None
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(a))
        raise ValueError(f"{name}[{i}] = {int(a[i])} is too large")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.dtype.kind == "i" and a.min() < 0:
        i = int(np.flatnonzero(a < 0)[0])
        raise ValueError(f"{name}[{i}] = {int(a[i])} is negative; lengths must be >= 0 "
                         "(zero-length sequences are dropped and counted)")
    return a


@njit(cache=True)
def _scan(L, capacity):
    """(number of zeros, number longer than capacity, index of the first one longer or -1)."""
    n_zero = 0
    n_over = 0
    first_over = -1
    for i in range(L.size):
        x = L[i]
        if x == 0:
            n_zero += 1
        elif x > capacity:
            if n_over == 0:
                first_over = i
            n_over += 1
    return n_zero, n_over, first_over


class Pieces:
    """What is left to place after the overflow policy: parallel int64 arrays plus bookkeeping.

    ``item`` is ``None`` when the pieces are exactly the sequences ``0..n-1`` (nothing dropped or
    split: saves two big arrays on the fast path); ``start`` is ``None`` when every start is 0.
    """

    __slots__ = ("item", "start", "length", "split_ids", "truncated_ids", "dropped_ids", "n_empty")

    def __init__(self, item, start, length, split_ids, truncated_ids, dropped_ids, n_empty):
        self.item, self.start, self.length = item, start, length
        self.split_ids, self.truncated_ids, self.dropped_ids = split_ids, truncated_ids, dropped_ids
        self.n_empty = n_empty


def make_pieces(L: np.ndarray, capacity: int, overflow: str, item_ids=None) -> Pieces:
    """Apply the zero-length rule and the overflow policy to checked lengths ``L``.

    ``item_ids`` (default ``arange(len(L))``) name the sequences; the recorded split / truncated /
    dropped ids are taken from it. Pieces come in input order (a split sequence's parts in token
    order), which is the order the in-order algorithms place them.

    ``"split"`` cuts a sequence of ``n > capacity`` tokens into pieces of ``capacity`` tokens and the
    remainder last; ``"carry"`` puts the remainder (``n % capacity`` tokens, if any) *first* and the
    ``capacity``-token pieces after it, so that every piece but the first fills a row alone (what
    keeps a chain's rows orderable, see :mod:`packer_algos.chains`). Both record the sequence in
    ``split_ids``.
    """
    n = L.size
    empty = np.zeros(0, dtype=np.int64)
    n_empty, n_over, first_over = _scan(L, capacity)
    if n_over and overflow == "error":
        i = first_over
        raise ValueError(f"lengths[{i}] = {int(L[i])} is longer than capacity {capacity} "
                         f"({n_over} sequence(s) are); pass overflow='split', 'carry', 'truncate' or 'drop'")
    if n_over == 0 and n_empty == 0:
        return Pieces(item_ids, None, L, empty, empty, empty, 0)
    ids = np.arange(n, dtype=np.int64) if item_ids is None else item_ids
    zero = L == 0
    over_mask = L > capacity
    over = np.flatnonzero(over_mask)
    split_ids = truncated_ids = dropped_ids = empty
    if overflow == "truncate":
        keep = ~zero
        truncated_ids = ids[over]
        plen = np.minimum(L[keep], capacity)
        return Pieces(ids[keep], None, plen, split_ids, truncated_ids,
                      dropped_ids, n_empty)
    if overflow == "drop":
        keep = ~(zero | over_mask)
        dropped_ids = ids[over]
        return Pieces(ids[keep], None, L[keep], split_ids,
                      truncated_ids, dropped_ids, n_empty)
    # split / carry (or no overflow at all, only zeros)
    keep = ~zero
    kl = L[keep]
    kid = ids[keep]
    if over.size == 0:
        return Pieces(kid, None, kl, split_ids, truncated_ids,
                      dropped_ids, n_empty)
    split_ids = ids[over]
    npieces = -(-kl // capacity)
    item = np.repeat(kid, npieces)
    first = np.repeat(np.cumsum(npieces) - npieces, npieces)
    k = np.arange(item.size, dtype=np.int64) - first
    if overflow == "carry":  # remainder first, then whole rows: piece k > 0 ends at rem + k * capacity
        rem = np.repeat(kl - (npieces - 1) * capacity, npieces)
        start = np.where(k == 0, 0, rem + (k - 1) * capacity)
        plen = np.where(k == 0, rem, capacity)
        return Pieces(item, start, plen, split_ids, truncated_ids, dropped_ids, n_empty)
    start = k * capacity
    plen = np.minimum(np.repeat(kl, npieces) - start, capacity)
    return Pieces(item, start, plen, split_ids, truncated_ids, dropped_ids, n_empty)
