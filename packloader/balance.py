"""Rows into steps by cost: a row source whose epoch plan is the inner source's, sorted by estimated cost
inside consecutive windows of plan rows.

:func:`packloader.distributed.assign_rows_by_cost` balances the ranks *inside* a global step, but a step is a
window of consecutive plan rows: a step that holds one very expensive row (one long sequence under
attention) and cheap ones cannot be balanced, its expensive rank sets the pace while the others wait.
Sorting the plan by cost inside windows of ``window`` rows puts rows of similar cost into the same steps,
so every step can be split evenly::

    plan (costs)       9 1 1 8 | 1 9 1 1 | ...        2 ranks, batch 1: steps [9 1] [1 8] [1 9] [1 1]
    sorted, window 8   9 9 8 1 | 1 1 1 1 | ...                          steps [9 9] [8 1] [1 1] [1 1]

The sorted plan is a pure function of the inner plan, ``window`` and ``attention_factor`` (no rank, world
size or batch size goes into it), so it is a plan like any other: exact resume with the same layout,
elastic with another; it changes the plan, so the state records it in the source fingerprint, and a state
saved without it (or with another window or factor) is refused by name. The price: inside a window, the
data order follows cost, not the shuffle (rows of long sequences tend to come first); windows keep the
shuffled order between them. Use windows of a few global steps' rows (e.g. 16 x world_size x batch_size).
"""
from __future__ import annotations

import numpy as np

from packloader.distributed import row_costs
from packloader.rows import Built

__all__ = ["CostSortedRows", "cost_sorted_order"]


def cost_sorted_order(cost: np.ndarray, window: int) -> np.ndarray:
    """The permutation of plan rows that sorts each window of ``window`` consecutive rows by decreasing
    cost (ties keep plan order); rows never leave their window.

    Example::

        cost_sorted_order(np.array([1., 9., 5., 2., 7.]), window=3)   # [1, 2, 0, 4, 3]

    Args:
        cost: float [N], the cost of each plan row (:func:`packloader.distributed.row_costs`).
        window: rows per window (>= 1; 1 keeps the plan order).

    Returns:
        int64 [N]: new plan row ``i`` is old plan row ``order[i]``.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    cost = np.asarray(cost, dtype=np.float64)
    n = len(cost)
    order = np.arange(n, dtype=np.int64)
    for lo in range(0, n, int(window)):
        hi = min(lo + int(window), n)
        order[lo:hi] = lo + np.argsort(-cost[lo:hi], kind="stable")
    return order


class CostSortedRows:
    """A row source (:mod:`packloader.rows`) over ``inner`` with each window of ``window`` plan rows sorted by
    :func:`~packloader.distributed.row_costs` (``attention_factor``), most expensive first.

    Args:
        inner: the row source (a :class:`~packloader.stream.StreamingRows` or
            :class:`~packloader.prepacked.PrepackedRows`).
        window: plan rows per sorted window (>= 1).
        attention_factor: the cost model's factor (>= 0).
    """

    def __init__(self, inner, window: int, attention_factor: float):
        cost_sorted_order(np.zeros(0), window)  # checks window
        row_costs(np.zeros(1, np.int64), np.zeros(0, np.int64), attention_factor)  # checks the factor
        self.inner, self.window, self.attention_factor = inner, int(window), float(attention_factor)
        self.fingerprint = f"{inner.fingerprint}|cost-sorted:window={self.window}:factor={self.attention_factor!r}"
        self._order: tuple | None = None

    def __getattr__(self, name):  # capacity, overflow, overflow_counts, directory, ...: the inner source's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The epoch's permutation: sorted plan row ``i`` is the inner plan's row ``order[i]``."""
        key = (int(seed), int(epoch), bool(shuffle))
        if self._order is None or self._order[0] != key:
            off, _, _, length = self.inner.epoch_pieces(seed, epoch, shuffle)
            self._order = (key, cost_sorted_order(row_costs(off, length, self.attention_factor), self.window))
        return self._order[1]

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        return np.asarray(self.inner.epoch_rows(seed, epoch, shuffle))[self.order(seed, epoch, shuffle)]

    def epoch_pieces(self, seed: int, epoch: int, shuffle: bool):
        from packer_algos.chains import permute_rows

        off, doc, start, length = self.inner.epoch_pieces(seed, epoch, shuffle)
        return permute_rows(off, self.order(seed, epoch, shuffle), doc, start, length)

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False) -> Built:
        rows = np.asarray(rows, dtype=np.int64)
        order = self.order(seed, epoch, shuffle)
        return self.inner.build(seed, epoch, shuffle, np.where(rows >= 0, order[np.maximum(rows, 0)], -1),
                                want_ids=want_ids)
