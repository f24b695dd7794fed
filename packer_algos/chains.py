"""Chains: the pieces of a sequence cut by ``overflow="carry"``, and the row order that keeps them in order.

A sequence longer than ``capacity`` is cut (:func:`packer_algos.pieces.make_pieces`) into a *chain*: piece
0 holds the remainder (``n % capacity`` tokens; a whole row when ``n`` is a multiple of ``capacity``) and
pieces 1, 2, ... hold ``capacity`` tokens each, so every piece after the first fills a row alone. A model
that carries its state from one piece to the next sees the sequence as if it were unsplit, provided that
piece ``k + 1`` comes after piece ``k``. The plan-level rule (:func:`carry_row_order`)::

    rows in the packer's order (any algorithm, after any shuffle)   A: anchor rows, c: continuation rows
        [ x x y0 ]  [ y1 ]  [ z z z ]  [ y2 ]  [ w0 v v ]  [ w1 ]
    carry order: every continuation row right after the row of its chain's piece 0, in piece order
        [ x x y0 ]  [ y1 ]  [ y2 ]  [ z z z ]  [ w0 v v ]  [ w1 ]

Rows holding no continuation piece (*anchor rows*) keep their relative order; so packing efficiency is
exactly that of the same pieces packed without the rule. Which rank and step a row goes to is decided
by the loader (:mod:`packloader.carry`), which keeps a chain's rows on one rank in this order.

:func:`chain_links` reads the chains back from any plan (a pre-packed directory's provenance columns
included) and refuses one that breaks the rule (a continuation piece sharing its row, a missing piece,
pieces out of order).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Chains", "chain_links", "carry_row_order", "permute_rows"]


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class Chains(NamedTuple):
    """The chains of a plan (``m`` pieces in ``N`` rows, CSR ``row_offsets``).

    Attributes:
        piece_index: int32 [m]: index of each piece in its chain (0 for a whole sequence).
        in_chain: bool [m]: the piece belongs to a cut sequence.
        next_row: int64 [m]: row of the next piece of the piece's chain, -1 for the last one (and for
            whole sequences).
        pred_row: int64 [N]: for a row holding a continuation piece (piece index > 0), the row of the
            previous piece of that chain; -1 for an anchor row.
        chain_pieces: int64 [n_chains]: number of pieces of each chain (sorted by chain key).
    """

    piece_index: np.ndarray
    in_chain: np.ndarray
    next_row: np.ndarray
    pred_row: np.ndarray
    chain_pieces: np.ndarray


def _chain_members(doc: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of cut sequences, sorted by (doc, start), and a flag at the first piece of each chain.
    Only the continuation pieces (start > 0) and the first pieces of their sequences are looked at: the
    whole sequences (nearly all pieces) cost one comparison and one binary search each."""
    cont = np.flatnonzero(start > 0)
    if cont.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    cut_docs = np.unique(doc[cont])
    pos = np.minimum(np.searchsorted(cut_docs, doc), cut_docs.size - 1)
    heads = np.flatnonzero((cut_docs[pos] == doc) & (start == 0))
    members = np.concatenate([heads, cont])
    members = members[np.lexsort((start[members], doc[members]))]
    first = np.ones(members.size, bool)
    first[1:] = doc[members[1:]] != doc[members[:-1]]
    return members, first


def chain_links(row_offsets, doc, start, length) -> Chains:
    """The chains of a plan whose pieces (in row order, CSR ``row_offsets``) belong to sequences ``doc``
    and begin at token ``start`` with ``length`` tokens.

    Raises:
        ValueError: a chain breaks the carry rule: a continuation piece whose earlier tokens are in no
            piece (its predecessor is missing), two pieces overlapping, a continuation piece sharing its
            row with another piece, or a piece placed in a row before (or in the row of) its
            predecessor. The message names the sequence and the rows.
    """
    row_offsets, doc, start, length = _i64(row_offsets), _i64(doc), _i64(start), _i64(length)
    n_rows, m = row_offsets.size - 1, doc.size
    piece_index = np.zeros(m, np.int32)
    in_chain = np.zeros(m, bool)
    next_row = np.full(m, -1, np.int64)
    pred_row = np.full(n_rows, -1, np.int64)
    members, first = _chain_members(doc, start)
    if members.size == 0:
        return Chains(piece_index, in_chain, next_row, pred_row, np.zeros(0, np.int64))
    row_of = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(row_offsets))
    chain_no = np.cumsum(first) - 1
    chain_first = np.flatnonzero(first)
    idx = np.arange(members.size) - chain_first[chain_no]
    st, ln, rw = start[members], length[members], row_of[members]
    bad = first & (st != 0)
    if bad.any():
        k = members[np.flatnonzero(bad)[0]]
        raise ValueError(f"overflow='carry': sequence {int(doc[k])} has a piece at token {int(start[k])} but "
                         "none at token 0: its first piece is missing")
    cont = ~first
    gap = np.zeros(members.size, bool)
    gap[1:] = cont[1:] & (st[1:] != st[:-1] + ln[:-1])
    if gap.any():
        j = int(np.flatnonzero(gap)[0])
        raise ValueError(f"overflow='carry': sequence {int(doc[members[j]])}: the piece at token {int(st[j])} "
                         f"does not follow the previous piece (tokens {int(st[j - 1])}..{int(st[j - 1] + ln[j - 1])}): "
                         "a piece is missing or two overlap, so its predecessor never comes")
    alone = np.diff(row_offsets)[rw] == 1
    shared = cont & ~alone
    if shared.any():
        j = int(np.flatnonzero(shared)[0])
        raise ValueError(f"overflow='carry': row {int(rw[j])} holds piece {int(idx[j])} of sequence "
                         f"{int(doc[members[j]])} together with other pieces; a continuation piece must fill "
                         "its row alone (pack with overflow='carry')")
    order_bad = np.zeros(members.size, bool)
    order_bad[1:] = cont[1:] & (rw[1:] <= rw[:-1])
    if order_bad.any():
        j = int(np.flatnonzero(order_bad)[0])
        raise ValueError(f"overflow='carry': piece {int(idx[j])} of sequence {int(doc[members[j]])} is in row "
                         f"{int(rw[j])}, not after its predecessor's row {int(rw[j - 1])} (rows out of chain order)")
    piece_index[members] = idx
    in_chain[members] = True
    last = np.ones(members.size, bool)
    last[:-1] = first[1:]
    nxt = np.flatnonzero(~last)
    next_row[members[nxt]] = rw[nxt + 1]
    pred_row[rw[cont]] = rw[np.flatnonzero(cont) - 1]
    chain_pieces = np.diff(np.append(chain_first, members.size))
    return Chains(piece_index, in_chain, next_row, pred_row, chain_pieces)


def carry_row_order(row_offsets, doc, start) -> np.ndarray:
    """int64 [N]: the rows in carry order (see the module docstring): the anchor rows in their order, each
    followed by the continuation rows of the chains whose piece 0 it holds (chains in the order of their
    piece 0 in the row, each in piece order). Continuation rows are the rows whose one piece starts after
    token 0. A permutation of ``range(N)``; the identity when nothing is cut."""
    row_offsets, doc, start = _i64(row_offsets), _i64(doc), _i64(start)
    n_rows = row_offsets.size - 1
    members, first = _chain_members(doc, start)
    if members.size == 0:
        return np.arange(n_rows, dtype=np.int64)
    row_of = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(row_offsets))
    chain_first = np.flatnonzero(first)
    chain_no = np.cumsum(first) - 1
    head = members[chain_first[chain_no]]            # piece 0 of each member's chain
    cont = ~first
    anchor_of = np.arange(n_rows, dtype=np.int64)    # sort key 1: the anchor row's position
    slot = np.full(n_rows, -1, np.int64)             # sort key 2: -1 the anchor, else its piece 0's slot
    rank = np.zeros(n_rows, np.int64)                # sort key 3: the piece index
    crow = row_of[members[cont]]
    if np.unique(crow).size != crow.size:
        raise ValueError("overflow='carry': a row holds two continuation pieces (pack with overflow='carry')")
    anchor_of[crow] = row_of[head[cont]]
    slot[crow] = head[cont] - row_offsets[row_of[head[cont]]]
    rank[crow] = np.arange(members.size)[cont] - chain_first[chain_no[cont]]
    return np.lexsort((rank, slot, anchor_of)).astype(np.int64)


def permute_rows(row_offsets, perm, *piece_arrays):
    """A CSR plan with its rows in the order ``perm``: ``(new_offsets, *piece arrays permuted)``."""
    row_offsets, perm = _i64(row_offsets), _i64(perm)
    counts = np.diff(row_offsets)[perm]
    new_off = np.zeros(perm.size + 1, np.int64)
    np.cumsum(counts, out=new_off[1:])
    idx = np.repeat(row_offsets[:-1][perm] - new_off[:-1], counts) + np.arange(new_off[-1])
    return (new_off,) + tuple(np.asarray(a)[idx] for a in piece_arrays)
