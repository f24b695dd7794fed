"""Pure-Python twins of the packer_algos algorithms, written from their documented rules.

Slow (O(n * bins)) on purpose: each function says in plain code what the Numba kernel must do, and
the tests require the kernels to give exactly the same bins. A bin is a list of
``(item_id, start, length)`` tuples in placement order; bins are in opening (or emission) order.
"""
from __future__ import annotations


def pieces(lengths, capacity, overflow):
    """(pieces, split_ids, truncated_ids, dropped_ids, n_empty) for the overflow policy."""
    out, split, trunc, drop, n_empty = [], [], [], [], 0
    for i, n in enumerate(lengths):
        n = int(n)
        if n < 0:
            raise ValueError(f"lengths[{i}] is negative")
        if n == 0:
            n_empty += 1
            continue
        if n <= capacity:
            out.append((i, 0, n))
        elif overflow == "error":
            raise ValueError(f"lengths[{i}] = {n} is longer than capacity {capacity}")
        elif overflow == "truncate":
            trunc.append(i)
            out.append((i, 0, capacity))
        elif overflow == "drop":
            drop.append(i)
        elif overflow == "split":
            split.append(i)
            for s in range(0, n, capacity):
                out.append((i, s, min(capacity, n - s)))
        elif overflow == "carry":  # the remainder first, then whole rows
            split.append(i)
            rem = n - (n - 1) // capacity * capacity
            out.append((i, 0, rem))
            for s in range(rem, n, capacity):
                out.append((i, s, capacity))
        else:
            raise ValueError(overflow)
    return out, split, trunc, drop, n_empty


def decreasing(ps, tie_rank=None):
    """Longest first; equal lengths by position in the input (or by ``tie_rank[position]``)."""
    key = (lambda k: (-ps[k][2], k)) if tie_rank is None else (lambda k: (-ps[k][2], tie_rank[k]))
    return [ps[k] for k in sorted(range(len(ps)), key=key)]


def _full(bin_, capacity, mx):
    return mx is not None and len(bin_) >= mx


def next_fit(ps, capacity, mx=None):
    bins = []
    for p in ps:
        if not bins or sum(q[2] for q in bins[-1]) + p[2] > capacity or _full(bins[-1], capacity, mx):
            bins.append([])
        bins[-1].append(p)
    return bins


def first_fit(ps, capacity, mx=None):
    bins = []
    for p in ps:
        for b in bins:
            if sum(q[2] for q in b) + p[2] <= capacity and not _full(b, capacity, mx):
                b.append(p)
                break
        else:
            bins.append([p])
    return bins


def best_fit(ps, capacity, mx=None):
    """Least remaining capacity that fits; ties: the bin whose remaining capacity changed last."""
    bins, stamp = [], []
    for step, p in enumerate(ps):
        best = None
        for j, b in enumerate(bins):
            rem = capacity - sum(q[2] for q in b)
            if rem >= p[2] and not _full(b, capacity, mx):
                key = (rem, -stamp[j])
                if best is None or key < best[0]:
                    best = (key, j)
        if best is None:
            bins.append([p])
            stamp.append(step)
        else:
            bins[best[1]].append(p)
            stamp[best[1]] = step
    return bins


def online(ps, capacity, buffer_size, mx=None, flush=True, pending=None):
    """The OnlinePacker rule. Returns (bins emitted, pending items left) when ``flush`` is False."""
    pending = list(pending or [])  # arrival order
    bins = []

    def close_one():
        first = pending.pop(0)
        b, rem = [first], capacity - first[2]
        while rem > 0 and pending and not _full(b, capacity, mx):
            fit = [q for q in pending if q[2] <= rem]
            if not fit:
                break
            longest = max(q[2] for q in fit)
            q = next(q for q in pending if q[2] == longest)  # oldest of that length
            pending.remove(q)
            b.append(q)
            rem -= q[2]
        bins.append(b)

    for p in ps:
        pending.append(p)
        if len(pending) > buffer_size:
            close_one()
    if flush:
        while pending:
            close_one()
        return bins
    return bins, pending


def carry_order(bins):
    """The carry rule: anchor rows (no piece starting after token 0) in their order, each followed by
    the rows of the later pieces of the sequences whose first piece it holds, in token order."""
    later = {}
    for b in bins:
        if b[0][1] > 0:
            later.setdefault(b[0][0], []).append(b)
    out = []
    for b in bins:
        if b[0][1] > 0:
            continue
        out.append(b)
        for item, start, _ in b:
            if start == 0:
                out.extend(sorted(later.get(item, []), key=lambda r: r[0][1]))
    return out


def pack(lengths, capacity, algorithm, overflow="error", mx=None, buffer_size=None, tie_rank=None):
    """Reference ``packer_algos.pack``: the bins as lists of (item_id, start, length)."""
    if overflow == "carry":
        return carry_order(pack(lengths, capacity, algorithm, "carry-unordered", mx, buffer_size, tie_rank))
    ps, *_ = pieces(lengths, capacity, "carry" if overflow == "carry-unordered" else overflow)
    if algorithm == "next_fit":
        return next_fit(ps, capacity, mx)
    if algorithm == "first_fit":
        return first_fit(ps, capacity, mx)
    if algorithm == "ffd":
        return first_fit(decreasing(ps, tie_rank), capacity, mx)
    if algorithm == "bfd":
        return best_fit(decreasing(ps, tie_rank), capacity, mx)
    if algorithm == "online":
        return online(ps, capacity, 1000 if buffer_size is None else buffer_size, mx)
    raise ValueError(algorithm)
