"""Offline packing kernels (Numba).

Two families, both ending in the CSR arrays of a :class:`~packer_algos.plan.PackPlan` (pieces in
placement order inside each bin; bins numbered in the order they are opened):

* In-order kernels (``next_fit``, ``first_fit``) take ``order`` (the piece indices in placement order,
  or ``None`` for ``0, 1, 2, ...``), ``plen`` (int64 piece lengths, each in ``[1, capacity]``),
  ``capacity`` and ``max_items`` (0 = no cap on pieces per bin) and return ``(bin_seq, n_bins)``:
  ``bin_seq[k]`` is the bin of the ``k``-th placed piece; :func:`build_csr` makes the plan.
* Decreasing kernels (``first_fit_runs`` = FFD, ``best_fit_runs`` = BFD) take the length histogram
  ``count`` from :func:`sort_decreasing` and return *visits* ``(vbin, vcnt, n_visits, n_bins)``: visit
  ``v`` puts the next ``vcnt[v]`` pieces of the sorted order into bin ``vbin[v]``;
  :func:`build_csr_runs` makes the plan. See the comment above ``best_fit_runs`` for why placing a
  run of equal pieces a bin at a time gives exactly the piece-by-piece result.

Index arrays are int32 when there are fewer than 2**31 pieces (half the memory traffic on 16M-item
inputs), else int64: the dtype of the ``witness`` array chooses.

Tie rules (the pure-Python twins in ``tests/packer_algos/reference.py`` follow them exactly):

* ``next_fit``: one open bin; a piece that does not fit (or a bin at ``max_items``) closes it.
* ``first_fit`` / FFD: the lowest-numbered bin with room. A max-segment-tree over bins gives
  O(log n_bins) per piece (FFD: per visit).
* BFD: the bin with the least remaining capacity that still fits; among equals, the one that reached
  that remaining capacity most recently (a stack per remaining capacity). A hierarchical bitset over
  remaining capacities ``0..capacity`` (``_bitset.py``) finds it in O(log64 capacity) per visit.
* ``sort_decreasing``: counting sort, longest first; equal lengths keep the order of ``tie_order``
  (index order, or a seeded permutation). O(n + capacity).
"""
import numpy as np
from numba import njit

from ._bitset import bs_clear, bs_new, bs_next, bs_set


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
    return out, count


@njit(cache=True, inline="always")
def _max_tree_set(tree, P, b, v):
    j = b + P
    tree[j] = v
    j >>= 1
    while j >= 1:
        a = tree[2 * j]
        c = tree[2 * j + 1]
        x = a if a > c else c
        if tree[j] == x:
            break
        tree[j] = x
        j >>= 1


@njit(cache=True, inline="always")
def _max_tree_find_from(tree, P, s, L):
    """Lowest leaf index ``>= s`` whose value is ``>= L``, or -1."""
    if s >= P:
        return -1
    i = s + P
    if tree[i] >= L:
        return s
    while i > 1:
        if (i & 1) == 0 and tree[i + 1] >= L:
            i += 1
            while i < P:
                i = 2 * i
                if tree[i] < L:
                    i += 1
            return i - P
        i >>= 1
    return -1


@njit(cache=True)
def _grow_tree(tree, P):
    P2 = 2 * P
    t2 = np.zeros(2 * P2, dtype=tree.dtype)
    t2[P2:P2 + P] = tree[P:2 * P]
    for j in range(P2 - 1, 0, -1):
        a = t2[2 * j]
        b = t2[2 * j + 1]
        t2[j] = a if a > b else b
    return t2, P2


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
def first_fit(order, plen, capacity, max_items, witness, cwitness):
    """First fit over bins in opening order; O(log n_bins) per piece.

    A max-segment-tree over bins (grown by doubling; values of ``cwitness``'s dtype) holds each open
    bin's remaining capacity; the leftmost bin with room is found by one descent from the root.
    """
    m = plen.size
    P = 1024
    tree = np.zeros(2 * P, dtype=cwitness.dtype)  # max remaining capacity of the open bins below a node
    cnt = np.zeros(m if max_items > 0 else 1, dtype=witness.dtype)
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
                tree, P = _grow_tree(tree, P)
            r = capacity - L
        if max_items > 0:
            cnt[b] += 1
            if cnt[b] >= max_items:
                r = 0
        bin_seq[k] = b
        _max_tree_set(tree, P, b, r)
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


# --------------------------------------------------------------------------------------------------
# Decreasing-order kernels over the length histogram.
#
# FFD and BFD place the pieces longest first, so they see each length as one run of equal pieces
# (``count[L]`` of them). Inside a run the next piece always goes to the same bin as the previous
# one while it still fits there (that bin is then both the lowest-numbered and the tightest bin with
# room), so a bin visited in a run takes ``q = min(rem // L, pieces left, items left)`` pieces at once,
# and the next visit looks only further on (higher remaining capacity for BFD, higher bin number for
# FFD). Same bins, in the same order, as placing the pieces one by one (the tests' pure-Python
# twins do that), but the search structure is touched once per *visit*, not per piece, and the
# kernels never read the piece arrays: their output is a list of visits ``(bin, q)`` in placement
# order, which :func:`build_csr_runs` turns into the plan using the sorted ``order``.
#
# The two kernels repeat their visit bookkeeping (pieces a bin takes, the visit record, the max_items
# count) on purpose: the same lines moved into shared @njit helpers (inline="always" or not) made them
# 1.4-1.8x slower (1M lognormal lengths, capacity 4096: bfd 0.035 -> 0.052-0.065 s, ffd 0.030 -> 0.036-0.050 s,
# 2026-11-23, alternating runs against the copies), so they stay written out.


@njit(cache=True)
def best_fit_runs(count, capacity, max_items, witness):
    """BFD over ``count[L]`` (pieces of length L, placed L = capacity .. 1).

    Open bins sit in one stack per remaining capacity (``head`` / ``nxt``); a bitset over remaining
    capacities ``0..capacity`` finds the tightest one that fits. Returns ``(vbin, vcnt, n_visits,
    n_bins)``. Ties as in the module docstring (BFD): among bins with equal remaining capacity the one that
    reached it last.
    """
    m = 0
    for L in range(1, capacity + 1):
        m += count[L]
    vbin = np.empty(m, dtype=witness.dtype)
    vcnt = np.empty(m, dtype=witness.dtype)
    head = np.full(capacity + 1, -1, dtype=witness.dtype)
    nxt = np.empty(m, dtype=witness.dtype)
    cnt = np.zeros(m if max_items > 0 else 1, dtype=witness.dtype)
    bits, off, nbits = bs_new(capacity + 1)
    nv = 0
    nb = 0
    for L in range(capacity, 0, -1):
        left = count[L]
        if left == 0:
            continue
        r = L
        while left > 0:
            r = bs_next(bits, off, nbits, r)
            if r < 0:
                break
            b = head[r]
            h = nxt[b]
            head[r] = h
            if h < 0:
                bs_clear(bits, off, r)
            q = r // L
            if max_items > 0 and q > max_items - cnt[b]:
                q = max_items - cnt[b]
            if q > left:
                q = left
            left -= q
            vbin[nv] = b
            vcnt[nv] = q
            nv += 1
            rem = r - q * L
            open_ = rem > 0
            if max_items > 0:
                cnt[b] += q
                if cnt[b] >= max_items:
                    open_ = False
            if open_:
                h = head[rem]
                if h < 0:
                    bs_set(bits, off, rem)
                nxt[b] = h
                head[rem] = b
        if left == 0:
            continue
        per_bin = capacity // L
        if max_items > 0 and per_bin > max_items:
            per_bin = max_items
        while left > 0:
            b = nb
            nb += 1
            q = per_bin if per_bin < left else left
            left -= q
            vbin[nv] = b
            vcnt[nv] = q
            nv += 1
            rem = capacity - q * L
            open_ = rem > 0
            if max_items > 0:
                cnt[b] = q
                if q >= max_items:
                    open_ = False
            if open_:
                h = head[rem]
                if h < 0:
                    bs_set(bits, off, rem)
                nxt[b] = h
                head[rem] = b
    return vbin, vcnt, nv, nb


@njit(cache=True)
def first_fit_runs(count, capacity, max_items, witness, cwitness):
    """FFD over ``count[L]`` (pieces of length L, placed L = capacity .. 1).

    A max-segment-tree over bins (opening order, grown by doubling; values of ``cwitness``'s dtype)
    holds each open bin's remaining capacity; within a run the search for the next bin with room
    starts after the bin just filled. Returns ``(vbin, vcnt, n_visits, n_bins)``.
    """
    m = 0
    for L in range(1, capacity + 1):
        m += count[L]
    vbin = np.empty(m, dtype=witness.dtype)
    vcnt = np.empty(m, dtype=witness.dtype)
    cnt = np.zeros(m if max_items > 0 else 1, dtype=witness.dtype)
    P = 1024
    tree = np.zeros(2 * P, dtype=cwitness.dtype)
    nv = 0
    nb = 0
    for L in range(capacity, 0, -1):
        left = count[L]
        if left == 0:
            continue
        s = 0
        while left > 0 and tree[1] >= L:
            b = _max_tree_find_from(tree, P, s, L)
            if b < 0:
                break
            r = tree[b + P]
            q = r // L
            if max_items > 0 and q > max_items - cnt[b]:
                q = max_items - cnt[b]
            if q > left:
                q = left
            left -= q
            vbin[nv] = b
            vcnt[nv] = q
            nv += 1
            rem = r - q * L
            if max_items > 0:
                cnt[b] += q
                if cnt[b] >= max_items:
                    rem = 0
            _max_tree_set(tree, P, b, rem)
            s = b + 1
        if left == 0:
            continue
        per_bin = capacity // L
        if max_items > 0 and per_bin > max_items:
            per_bin = max_items
        while left > 0:
            b = nb
            nb += 1
            if b >= P:
                tree, P = _grow_tree(tree, P)
            q = per_bin if per_bin < left else left
            left -= q
            vbin[nv] = b
            vcnt[nv] = q
            nv += 1
            rem = capacity - q * L
            if max_items > 0:
                cnt[b] = q
                if q >= max_items:
                    rem = 0
            if rem > 0:
                _max_tree_set(tree, P, b, rem)
    return vbin, vcnt, nv, nb


@njit(cache=True)
def build_csr_runs(order, count, capacity, vbin, vcnt, n_visits, n_bins, piece_item, piece_start,
                   starts):
    """CSR arrays (bin_offsets, item_ids, lengths) from the visits of a ``*_runs`` kernel.

    ``order`` is the decreasing order of :func:`sort_decreasing` (its ``count``); visit ``v`` puts the
    next ``vcnt[v]`` pieces of ``order`` into bin ``vbin[v]``. Their length is known from ``count``,
    so the piece lengths are never gathered. ``piece_item`` / ``piece_start`` may be ``None``.
    """
    m = order.size
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    for v in range(n_visits):
        offsets[vbin[v] + 1] += vcnt[v]
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    pos = offsets[:-1].copy()
    ids = np.empty(m, dtype=np.int64)
    lens = np.empty(m, dtype=np.int64)
    k = 0
    L = capacity + 1
    end = 0  # end (in order) of the run of length L
    for v in range(n_visits):
        while k >= end:
            L -= 1
            end += count[L]
        b = vbin[v]
        q = vcnt[v]
        p = pos[b]
        pos[b] = p + q
        for j in range(q):
            i = order[k + j]
            ids[p + j] = i if piece_item is None else piece_item[i]
            lens[p + j] = L
            if piece_start is not None:
                starts[p + j] = piece_start[i]
        k += q
    return offsets, ids, lens
