"""Offline packing kernels (Numba): piece lengths in, a bin number per piece out.

Every kernel takes ``order`` (the piece indices in the order they are placed, or ``None`` for
``0, 1, 2, ...``), ``plen`` (int64 piece lengths, each in ``[1, capacity]``), ``capacity`` and
``max_items`` (0 = no cap on pieces per bin), and returns ``(bin_seq, n_bins)``: ``bin_seq[k]`` is the
bin of the ``k``-th placed piece; bins are numbered in the order they are opened. :func:`build_csr`
turns that into the CSR arrays of a :class:`~packer_algos.plan.PackPlan`, keeping the placement order
inside each bin. Index arrays are int32 when there are fewer than 2**31 pieces (half the memory
traffic on 16M-item inputs), else int64: the dtype of the ``witness`` array chooses.

Tie rules (the pure-Python twins in ``tests/packer_algos/reference.py`` follow them exactly):

* ``next_fit``: one open bin; a piece that does not fit (or a bin at ``max_items``) closes it.
* ``first_fit``: the lowest-numbered bin with room. A max-segment-tree over bins gives
  O(log n_bins) per piece.
* ``best_fit``: the bin with the least remaining capacity that still fits; among equals, the one
  that reached that remaining capacity most recently (a stack per remaining capacity). A
  count-segment-tree over remaining capacities ``0..capacity`` gives O(log capacity) per piece.
* ``sort_decreasing``: counting sort, longest first; equal lengths keep the order of ``tie_order``
  (index order, or a seeded permutation). O(n + capacity).
"""
import numpy as np
from numba import njit

from ._segtree import seg_dec, seg_first_ge, seg_inc


@njit(cache=True)
def sort_decreasing(plen, tie_order, capacity, witness):
    """Piece indices sorted by length, longest first; ties in ``tie_order`` order (``None``: index order)."""
    m = plen.size
    count = np.zeros(capacity + 2, dtype=np.int64)
    for i in range(m):
        count[plen[i]] += 1
    # pos[L] = first output slot of length L, longest first
    pos = np.empty(capacity + 2, dtype=np.int64)
    acc = 0
    for L in range(capacity + 1, -1, -1):
        pos[L] = acc
        acc += count[L]
    out = np.empty(m, dtype=witness.dtype)
    if tie_order is None:
        for i in range(m):
            L = plen[i]
            out[pos[L]] = i
            pos[L] += 1
    else:
        for k in range(m):
            i = tie_order[k]
            L = plen[i]
            out[pos[L]] = i
            pos[L] += 1
    return out


@njit(cache=True)
def next_fit(order, plen, capacity, max_items, witness):
    """In-order greedy: one open bin, closed by the first piece that does not fit."""
    m = plen.size
    bin_seq = np.empty(m, dtype=witness.dtype)
    nb = 0
    rem = -1  # no open bin yet
    cnt = 0
    for k in range(m):
        i = k if order is None else order[k]
        L = plen[i]
        if rem < L or (max_items > 0 and cnt >= max_items):
            nb += 1
            rem = capacity
            cnt = 0
        rem -= L
        cnt += 1
        bin_seq[k] = nb - 1
    return bin_seq, nb


@njit(cache=True)
def _grow_max_tree(tree, P):
    P2 = 2 * P
    t2 = np.zeros(2 * P2, dtype=np.int64)
    t2[P2:P2 + P] = tree[P:2 * P]
    for j in range(P2 - 1, 0, -1):
        a = t2[2 * j]
        b = t2[2 * j + 1]
        t2[j] = a if a > b else b
    return t2, P2


@njit(cache=True)
def first_fit(order, plen, capacity, max_items, witness):
    """First fit over bins in opening order (FFD when ``order`` is decreasing); O(log n_bins) per piece.

    A max-segment-tree over bins (grown by doubling) holds each open bin's remaining capacity; the
    leftmost bin with room is found by one descent from the root.
    """
    m = plen.size
    P = 1024
    tree = np.zeros(2 * P, dtype=np.int64)  # max remaining capacity of the open bins below a node
    cnt = np.zeros(m if max_items > 0 else 1, dtype=np.int64)
    bin_seq = np.empty(m, dtype=witness.dtype)
    nb = 0
    for k in range(m):
        i = k if order is None else order[k]
        L = plen[i]
        if tree[1] >= L:
            j = 1
            while j < P:
                j = 2 * j
                if tree[j] < L:
                    j += 1
            b = j - P
            r = tree[j] - L
        else:
            b = nb
            nb += 1
            if b >= P:
                tree, P = _grow_max_tree(tree, P)
            r = capacity - L
        if max_items > 0:
            cnt[b] += 1
            if cnt[b] >= max_items:
                r = 0
        bin_seq[k] = b
        j = b + P
        tree[j] = r
        j >>= 1
        while j >= 1:
            a = tree[2 * j]
            c = tree[2 * j + 1]
            v = a if a > c else c
            if tree[j] == v:
                break
            tree[j] = v
            j >>= 1
    return bin_seq, nb


@njit(cache=True)
def best_fit(order, plen, capacity, max_items, witness):
    """Best fit (BFD when ``order`` is decreasing); O(log capacity) per piece.

    Open bins sit in one stack per remaining capacity; a segment tree over remaining capacities
    ``0..capacity`` finds the smallest non-empty one that fits. Bins that are full (or at
    ``max_items``) are not kept.
    """
    m = plen.size
    P = 2
    while P < capacity + 1:
        P *= 2
    tree = np.zeros(2 * P, dtype=np.int64)  # open bins per remaining capacity
    head = np.full(capacity + 1, -1, dtype=np.int64)  # top of the stack per remaining capacity
    nxt = np.empty(m, dtype=witness.dtype)  # next bin down the stack, per bin
    cnt = np.zeros(m if max_items > 0 else 1, dtype=np.int64)
    bin_seq = np.empty(m, dtype=witness.dtype)
    nb = 0
    for k in range(m):
        i = k if order is None else order[k]
        L = plen[i]
        r = seg_first_ge(tree, P, L)
        if r < 0:
            b = nb
            nb += 1
            r = capacity - L
        else:
            b = head[r]
            head[r] = nxt[b]
            seg_dec(tree, P, r)
            r -= L
        bin_seq[k] = b
        open_ = r > 0
        if max_items > 0:
            cnt[b] += 1
            if cnt[b] >= max_items:
                open_ = False
        if open_:
            nxt[b] = head[r]
            head[r] = b
            seg_inc(tree, P, r)
    return bin_seq, nb


@njit(cache=True)
def build_csr(order, bin_seq, n_bins, piece_item, piece_start, plen, starts):
    """CSR arrays (bin_offsets, item_ids, lengths); pieces in placement order inside a bin.

    ``piece_item`` / ``piece_start`` may be ``None`` (identity ids, zero starts). ``starts`` is the
    preallocated (zeroed) int64 output for starts, written only when ``piece_start`` is given.
    """
    m = plen.size
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    for k in range(m):
        offsets[bin_seq[k] + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    pos = offsets[:-1].copy()
    ids = np.empty(m, dtype=np.int64)
    lens = np.empty(m, dtype=np.int64)
    for k in range(m):
        i = k if order is None else order[k]
        b = bin_seq[k]
        p = pos[b]
        pos[b] = p + 1
        ids[p] = i if piece_item is None else piece_item[i]
        lens[p] = plen[i]
        if piece_start is not None:
            starts[p] = piece_start[i]
    return offsets, ids, lens
