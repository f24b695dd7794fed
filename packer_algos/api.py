"""``pack()``: checked inputs, overflow policy, one of the packing algorithms, a validated-shape PackPlan."""
from __future__ import annotations

import numpy as np

from . import offline
from .chains import carry_row_order, permute_rows
from .online import OnlinePacker
from .pieces import as_lengths, check_int, check_overflow, make_pieces
from .plan import PackPlan

ALGORITHMS = ("ffd", "bfd", "first_fit", "next_fit", "online")
DEFAULT_BUFFER_SIZE = 1000


def _cap_witness(capacity):
    """An empty array whose dtype (int32 when it can) holds remaining capacities in the FFD tree."""
    return np.empty(0, dtype=np.int32 if capacity < 2**31 - 1 else np.int64)


def pack(lengths, capacity, algorithm="bfd", *, overflow="error", max_items_per_bin=None,
         buffer_size=None, seed=None) -> PackPlan:
    """Pack sequences of the given lengths into rows of ``capacity`` tokens.

    Example (capacity 10, ``lengths = [6, 3, 7, 4]``)::

        next_fit (in order, one open row):   [ 0 0 0 0 0 0 1 1 1 - ] [ 2 2 2 2 2 2 2 - - - ] [ 3 3 3 3 - ... ]
        bfd (longest first, tightest row):   [ 2 2 2 2 2 2 2 1 1 1 ] [ 0 0 0 0 0 0 3 3 3 3 ]

        >>> plan = pack([6, 3, 7, 4], 10, "bfd")
        >>> [plan.bin(b)[0].tolist() for b in range(plan.n_bins)]
        [[2, 1], [0, 3]]
        >>> pack([6, 3, 7, 4], 10, "next_fit").n_bins
        3

    Args:
        lengths: 1-D integer array (numpy, any int dtype) or list of ints; one entry per sequence.
            Negative entries raise ValueError naming the index. Zero-length sequences are dropped
            and counted (``plan.n_empty``), never placed. Floats/bools raise TypeError.
        capacity: tokens per packed row, an int >= 1.
        algorithm: ``"bfd"`` best-fit decreasing (the default), ``"ffd"`` first-fit decreasing
            (both O(n + capacity) plus a search per bin visit: a run of equal lengths fills each bin
            it reaches at once), ``"first_fit"`` first fit in the given order,
            ``"next_fit"`` in-order greedy (one open row; what PackMamba and torchtune do; the
            baseline), ``"online"`` the streaming packer of :class:`OnlinePacker` run over the
            sequences in the given order and flushed at the end.
        overflow: for a sequence longer than ``capacity``: ``"error"`` (ValueError naming the index
            and length), ``"split"`` (pieces of ``capacity`` tokens plus a remainder, each placed as its
            own item; ``plan.starts`` gives their offsets), ``"carry"`` (the same pieces with the
            remainder first, and the rows ordered so that each piece comes after the one before it:
            piece 0 then the ``capacity``-token pieces, each alone in a row right after its chain's
            earlier rows; see :mod:`packer_algos.chains`. For a model that carries its state from
            piece to piece; packs as tightly as ``"split"``), ``"truncate"`` (keep the first
            ``capacity`` tokens) or ``"drop"``. The plan lists them in ``split_ids`` (split and
            carry) / ``truncated_ids`` / ``dropped_ids``.
        max_items_per_bin: optional cap (int >= 1) on pieces per row.
        buffer_size: pending-item buffer of ``"online"`` (default 1000). Passing it with another
            algorithm is a ValueError (it would silently do nothing).
        seed: only used by ``"ffd"`` and ``"bfd"``: sequences of equal length are placed in an order
            shuffled by ``numpy.random.default_rng(seed)`` instead of index order, so which sequences
            share a row varies with the seed (the number of rows does not change much; without
            ``max_items_per_bin`` it is the same). The in-order algorithms follow the given order;
            for them ``seed`` is accepted and ignored (shuffle ``lengths`` yourself).

    Returns:
        A :class:`PackPlan`. Rows are numbered in the order they were opened (``"online"``: the order
        they were emitted); inside a row, pieces are in placement order.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    capacity = check_int("capacity", capacity)
    overflow = check_overflow(overflow)
    max_items_per_bin = check_int("max_items_per_bin", max_items_per_bin, allow_none=True)
    if algorithm == "online":
        buffer_size = check_int("buffer_size", DEFAULT_BUFFER_SIZE if buffer_size is None else buffer_size)
    elif buffer_size is not None:
        raise ValueError(f"buffer_size only applies to algorithm='online', not {algorithm!r}")
    if seed is not None and not isinstance(seed, (int, np.integer, np.random.SeedSequence)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    L = as_lengths(lengths)
    pc = make_pieces(L, capacity, overflow)
    mx = max_items_per_bin or 0
    m = pc.length.size

    if algorithm == "online":
        packer = OnlinePacker(capacity, buffer_size, max_items_per_bin=max_items_per_bin)
        off, ids, starts, lens = packer._run_pieces(*packer._arrays(pc), True)
    else:
        witness = np.empty(0, dtype=np.int32 if m < 2**31 - 1 else np.int64)
        starts = np.zeros(m, dtype=np.int64)
        if algorithm in ("ffd", "bfd"):
            # longest first: one run per length, placed a bin at a time (see offline.py)
            tie = None if seed is None else np.random.default_rng(seed).permutation(m).astype(witness.dtype)
            order, count = offline.sort_decreasing(pc.length, tie, capacity, witness)
            if algorithm == "bfd":
                vbin, vcnt, nv, nb = offline.best_fit_runs(count, capacity, mx, witness)
            else:
                vbin, vcnt, nv, nb = offline.first_fit_runs(count, capacity, mx, witness,
                                                            _cap_witness(capacity))
            off, ids, lens = offline.build_csr_runs(order, count, capacity, vbin, vcnt, nv, nb,
                                                    pc.item, pc.start, starts)
        else:
            if algorithm == "first_fit":
                bin_seq, nb = offline.first_fit(None, pc.length, capacity, mx, witness,
                                                _cap_witness(capacity))
            else:
                bin_seq, nb = offline.next_fit(None, pc.length, capacity, mx, witness)
            off, ids, lens = offline.build_csr(None, bin_seq, nb, pc.item, pc.start, pc.length, starts)
    if overflow == "carry" and pc.split_ids.size:
        off, ids, starts, lens = permute_rows(off, carry_row_order(off, ids, starts), ids, starts, lens)
    return PackPlan(capacity, off, ids, starts, lens, split_ids=pc.split_ids,
                    truncated_ids=pc.truncated_ids, dropped_ids=pc.dropped_ids, n_empty=pc.n_empty,
                    algorithm=algorithm, overflow=overflow, max_items_per_bin=max_items_per_bin)
