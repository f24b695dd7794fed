"""PackPlan: the result of packing, in CSR form."""
from __future__ import annotations

import numpy as np


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class PackPlan:
    """Which piece of which sequence goes into which packed row.

    A plan is CSR-shaped: bin (row) ``b`` holds the pieces ``bin_offsets[b]:bin_offsets[b+1]`` of the
    piece arrays ``item_ids`` / ``starts`` / ``lengths``. A piece is a whole sequence unless the
    sequence was split (``overflow="split"``) or truncated (``overflow="truncate"``); ``starts`` is the
    token offset of the piece inside its original sequence.

    Example (capacity 8, ``lengths = [5, 3, 6, 2]``, best-fit decreasing)::

        row 0   [ 2 2 2 2 2 2 | 3 3 ]     item 2 (6 tokens) + item 3 (2 tokens)
        row 1   [ 0 0 0 0 0 | 1 1 1 ]     item 0 (5 tokens) + item 1 (3 tokens)

        >>> from packer_algos import pack
        >>> plan = pack([5, 3, 6, 2], 8, "bfd")
        >>> plan.bin_offsets.tolist(), plan.item_ids.tolist()
        ([0, 2, 4], [2, 3, 0, 1])
        >>> plan.bin(1)            # (item_ids, starts, lengths) views
        (array([0, 1]), array([0, 0]), array([5, 3]))
        >>> plan.efficiency, plan.lower_bound
        (1.0, 2)

    Args:
        capacity: tokens per packed row.
        bin_offsets: int64 ``[n_bins + 1]``, starts at 0, non-decreasing, ends at ``n_pieces``.
        item_ids: int64 ``[n_pieces]``, index of each piece's sequence in the packed ``lengths``.
        starts: int64 ``[n_pieces]``, token offset of each piece inside its sequence (0 unless split).
        lengths: int64 ``[n_pieces]``, tokens in each piece.
        split_ids / truncated_ids / dropped_ids: int64, sorted indices of the sequences longer than
            ``capacity`` that were split, truncated (to their first ``capacity`` tokens) or dropped.
        n_empty: how many zero-length sequences were dropped (they are never placed).
        algorithm, overflow, max_items_per_bin: how the plan was made (``validate`` checks the cap).
    """

    __slots__ = ("capacity", "bin_offsets", "item_ids", "starts", "lengths", "split_ids",
                 "truncated_ids", "dropped_ids", "n_empty", "algorithm", "overflow",
                 "max_items_per_bin")

    def __init__(self, capacity, bin_offsets, item_ids, starts, lengths, *, split_ids=(),
                 truncated_ids=(), dropped_ids=(), n_empty=0, algorithm=None, overflow="error",
                 max_items_per_bin=None):
        self.capacity = int(capacity)
        self.bin_offsets = _i64(bin_offsets)
        self.item_ids = _i64(item_ids)
        self.starts = _i64(starts)
        self.lengths = _i64(lengths)
        self.split_ids = _i64(split_ids)
        self.truncated_ids = _i64(truncated_ids)
        self.dropped_ids = _i64(dropped_ids)
        self.n_empty = int(n_empty)
        self.algorithm = algorithm
        self.overflow = overflow
        self.max_items_per_bin = None if max_items_per_bin is None else int(max_items_per_bin)

    # ------------------------------------------------------------------ properties
    @property
    def n_bins(self) -> int:
        """Number of packed rows."""
        return int(self.bin_offsets.size - 1)

    @property
    def n_pieces(self) -> int:
        """Number of placed pieces (sequences, or parts of split sequences)."""
        return int(self.item_ids.size)

    @property
    def total_tokens(self) -> int:
        """Tokens placed in all rows."""
        return int(self.lengths.sum())

    @property
    def efficiency(self) -> float:
        """``total_tokens / (n_bins * capacity)``; 0.0 for a plan without rows."""
        nb = self.n_bins
        return self.total_tokens / (nb * self.capacity) if nb else 0.0

    @property
    def lower_bound(self) -> int:
        """``ceil(total_tokens / capacity)``: no plan of these pieces has fewer rows."""
        return -(-self.total_tokens // self.capacity)

    def bin_lengths(self) -> np.ndarray:
        """Tokens used in each row, int64 ``[n_bins]``."""
        if self.n_pieces == 0:
            return np.zeros(self.n_bins, dtype=np.int64)
        cs = np.concatenate(([0], np.cumsum(self.lengths)))
        return cs[self.bin_offsets[1:]] - cs[self.bin_offsets[:-1]]

    def bin(self, i: int):
        """Row ``i`` as ``(item_ids, starts, lengths)`` int64 views."""
        nb = self.n_bins
        if not -nb <= i < nb:
            raise IndexError(f"bin index {i} out of range for a plan with {nb} bins")
        i %= nb
        a, b = self.bin_offsets[i], self.bin_offsets[i + 1]
        return self.item_ids[a:b], self.starts[a:b], self.lengths[a:b]

    def __len__(self) -> int:
        return self.n_bins

    def __repr__(self) -> str:
        return (f"PackPlan(algorithm={self.algorithm!r}, capacity={self.capacity}, n_bins={self.n_bins}, "
                f"n_pieces={self.n_pieces}, total_tokens={self.total_tokens}, "
                f"efficiency={self.efficiency:.5f}, lower_bound={self.lower_bound}, "
                f"split={self.split_ids.size}, truncated={self.truncated_ids.size}, "
                f"dropped={self.dropped_ids.size}, empty={self.n_empty})")

    # ------------------------------------------------------------------ validation
    def validate(self, lengths) -> "PackPlan":
        """Check every invariant against the original ``lengths``; raise ValueError on the first broken one.

        Checked: array shapes and dtypes; ``bin_offsets`` starts at 0, ends at ``n_pieces`` and every
        row is non-empty; no row exceeds ``capacity`` (nor ``max_items_per_bin`` pieces); every piece
        lies inside its sequence and has length >= 1; each token of each kept sequence is placed
        exactly once (a truncated sequence: its first ``capacity`` tokens); zero-length, dropped
        sequences have no pieces; split/truncated/dropped sequences are exactly the ones longer than
        ``capacity`` under the plan's overflow policy; ``n_empty`` matches; with ``overflow="carry"``,
        every chain's pieces lie in increasing rows and each piece after the first fills its row alone
        (:func:`packer_algos.chains.chain_links`). Returns ``self``.
        """
        L = np.asarray(lengths)
        if L.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {L.shape}")
        L = L.astype(np.int64)
        n = L.size
        C = self.capacity

        def fail(msg):
            raise ValueError(f"invalid PackPlan: {msg}")

        if C < 1:
            fail(f"capacity {C} < 1")
        for name in ("bin_offsets", "item_ids", "starts", "lengths", "split_ids", "truncated_ids",
                     "dropped_ids"):
            a = getattr(self, name)
            if a.dtype != np.int64 or a.ndim != 1:
                fail(f"{name} must be a 1-D int64 array, got {a.dtype} with shape {a.shape}")
        m = self.item_ids.size
        if self.starts.size != m or self.lengths.size != m:
            fail(f"item_ids, starts, lengths differ in size ({m}, {self.starts.size}, {self.lengths.size})")
        off = self.bin_offsets
        if off.size < 1 or off[0] != 0 or off[-1] != m:
            fail(f"bin_offsets must start at 0 and end at n_pieces={m}")
        d = np.diff(off)
        if d.size and d.min() < 1:
            fail(f"bin {int(np.argmin(d))} is empty or bin_offsets decrease there")
        if m:
            if self.item_ids.min() < 0 or self.item_ids.max() >= n:
                bad = int(np.flatnonzero((self.item_ids < 0) | (self.item_ids >= n))[0])
                fail(f"piece {bad} has item_id {int(self.item_ids[bad])} outside [0, {n})")
            if self.lengths.min() < 1:
                bad = int(np.argmin(self.lengths))
                fail(f"piece {bad} has length {int(self.lengths[bad])} < 1")
            if self.starts.min() < 0:
                bad = int(np.argmin(self.starts))
                fail(f"piece {bad} has start {int(self.starts[bad])} < 0")
        used = self.bin_lengths()
        if used.size and used.max() > C:
            b = int(np.argmax(used))
            fail(f"bin {b} holds {int(used[b])} tokens > capacity {C}")
        if self.max_items_per_bin is not None and d.size and d.max() > self.max_items_per_bin:
            b = int(np.argmax(d))
            fail(f"bin {b} holds {int(d[b])} pieces > max_items_per_bin {self.max_items_per_bin}")

        # what each sequence should contribute
        if (L < 0).any():
            fail(f"lengths[{int(np.flatnonzero(L < 0)[0])}] is negative")
        n_zero = int((L == 0).sum())
        if n_zero != self.n_empty:
            fail(f"n_empty is {self.n_empty} but lengths has {n_zero} zeros")
        over = np.flatnonzero(L > C)
        empty = np.zeros(0, dtype=np.int64)
        want = {"split": empty, "truncate": empty, "drop": empty}
        if self.overflow == "carry":
            want["split"] = over
        elif self.overflow in want:
            want[self.overflow] = over
        elif self.overflow == "error":
            if over.size:
                fail(f"overflow='error' but lengths[{int(over[0])}] = {int(L[over[0]])} > capacity {C}")
        else:
            fail(f"unknown overflow policy {self.overflow!r}")
        for name, key in (("split_ids", "split"), ("truncated_ids", "truncate"), ("dropped_ids", "drop")):
            got = getattr(self, name)
            if not np.array_equal(got, want[key]):
                fail(f"{name} should be the {want[key].size} sequences longer than capacity "
                     f"(overflow={self.overflow!r}), got {got.size} ids")
        expected = L.copy()
        if self.overflow == "truncate":
            expected[over] = C
        elif self.overflow == "drop":
            expected[over] = 0

        # coverage: the pieces of each sequence tile [0, expected) exactly
        if m:
            order = np.lexsort((self.starts, self.item_ids))
            ids = self.item_ids[order]
            st = self.starts[order]
            en = st + self.lengths[order]
            first = np.ones(m, dtype=bool)
            first[1:] = ids[1:] != ids[:-1]
            last = np.ones(m, dtype=bool)
            last[:-1] = first[1:]
            bad = first & (st != 0)
            if bad.any():
                k = order[np.flatnonzero(bad)[0]]
                fail(f"sequence {int(self.item_ids[k])}: its first piece starts at "
                     f"{int(self.starts[k])}, not 0 (tokens missing)")
            cont = ~first
            bad = np.zeros(m, dtype=bool)
            bad[1:] = cont[1:] & (st[1:] != en[:-1])
            if bad.any():
                k = order[np.flatnonzero(bad)[0]]
                fail(f"sequence {int(self.item_ids[k])}: piece at start {int(self.starts[k])} "
                     "overlaps or leaves a gap after the previous piece")
            bad = last & (en != expected[ids])
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                fail(f"sequence {int(ids[k])}: pieces end at {int(en[k])} but {int(expected[ids[k]])} "
                     "tokens should be placed")
            placed = ids[first]
            if self.overflow == "carry":  # chains in order, continuation pieces alone in their rows
                from .chains import chain_links

                try:
                    chain_links(off, self.item_ids, self.starts, self.lengths)
                except ValueError as e:
                    fail(str(e))
        else:
            placed = np.zeros(0, dtype=np.int64)
        kept = np.flatnonzero(expected > 0)
        if placed.size != kept.size or not np.array_equal(placed, kept):
            missing = np.setdiff1d(kept, placed)
            if missing.size:
                i = int(missing[0])
                fail(f"sequence {i} (length {int(L[i])}) is not placed")
            extra = np.setdiff1d(placed, kept)
            i = int(extra[0])
            fail(f"sequence {i} (length {int(L[i])}) should not be placed")
        return self
