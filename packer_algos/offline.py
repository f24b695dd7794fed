"""Offline packing kernels (Numba): piece lengths in, a bin number per piece out.

Every kernel takes ``order`` (the piece indices in the order they are placed), ``plen`` (int64 piece
lengths, each in ``[1, capacity]``), ``capacity`` and ``max_items`` (0 = no cap on pieces per bin), and
returns ``(bin_of, n_bins)``: ``bin_of[i]`` is the bin of piece ``i``; bins are numbered in the order
they are opened. :func:`build_csr` turns that into the CSR arrays of a
:class:`~packer_algos.plan.PackPlan`, keeping the placement order inside each bin.

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

from ._segtree import seg_add, seg_first_ge


@njit(cache=True)
def sort_decreasing(plen, tie_order, capacity):
    """Piece indices sorted by length, longest first; ties in the order they appear in ``tie_order``."""
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
    out = np.empty(m, dtype=np.int64)
    for k in range(m):
        i = tie_order[k]
        L = plen[i]
        out[pos[L]] = i
        pos[L] += 1
    return out


@njit(cache=True)
def next_fit(order, plen, capacity, max_items):
    m = order.size
    bin_of = np.empty(m, dtype=np.int64)
    nb = 0
    rem = -1  # no open bin yet
    cnt = 0
    for k in range(m):
        i = order[k]
        L = plen[i]
        if rem < L or (max_items > 0 and cnt >= max_items):
            nb += 1
            rem = capacity
            cnt = 0
        rem -= L
        cnt += 1
        bin_of[i] = nb - 1
    return bin_of, nb


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
def first_fit(order, plen, capacity, max_items):
    """First fit over bins in opening order (FFD when ``order`` is decreasing)."""
    m = order.size
    P = 1024
    tree = np.zeros(2 * P, dtype=np.int64)  # max remaining capacity of the open bins below a node
    cnt = np.zeros(m if max_items > 0 else 1, dtype=np.int64)
    bin_of = np.empty(m, dtype=np.int64)
    nb = 0
    for k in range(m):
        i = order[k]
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
        bin_of[i] = b
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
    return bin_of, nb


@njit(cache=True)
def best_fit(order, plen, capacity, max_items):
    """Best fit (BFD when ``order`` is decreasing); O(log capacity) per piece."""
    m = order.size
    P = 2
    while P < capacity + 1:
        P *= 2
    tree = np.zeros(2 * P, dtype=np.int64)  # number of open bins per remaining capacity
    head = np.full(capacity + 1, -1, dtype=np.int64)  # stack of open bins per remaining capacity
    nxt = np.empty(m, dtype=np.int64)
    cnt = np.zeros(m if max_items > 0 else 1, dtype=np.int64)
    bin_of = np.empty(m, dtype=np.int64)
    nb = 0
    for k in range(m):
        i = order[k]
        L = plen[i]
        r = seg_first_ge(tree, P, L)
        if r < 0:
            b = nb
            nb += 1
            r = capacity - L
        else:
            b = head[r]
            head[r] = nxt[b]
            seg_add(tree, P, r, -1)
            r -= L
        bin_of[i] = b
        open_ = r > 0
        if max_items > 0:
            cnt[b] += 1
            if cnt[b] >= max_items:
                open_ = False
        if open_:
            nxt[b] = head[r]
            head[r] = b
            seg_add(tree, P, r, 1)
    return bin_of, nb


@njit(cache=True)
def build_csr(order, bin_of, n_bins, piece_item, piece_start, plen):
    """CSR arrays (bin_offsets, item_ids, starts, lengths); pieces in placement order inside a bin."""
    m = order.size
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    for i in range(m):
        offsets[bin_of[i] + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    pos = offsets[:-1].copy()
    ids = np.empty(m, dtype=np.int64)
    starts = np.empty(m, dtype=np.int64)
    lens = np.empty(m, dtype=np.int64)
    for k in range(m):
        i = order[k]
        b = bin_of[i]
        p = pos[b]
        ids[p] = piece_item[i]
        starts[p] = piece_start[i]
        lens[p] = plen[i]
        pos[b] = p + 1
    return offsets, ids, starts, lens
