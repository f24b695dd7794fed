"""Placing sequence pieces into packed rows: the one kernel behind every packed row that packloader builds.

A *piece* is ``length`` consecutive tokens of a flat token array, starting at ``src_start``; it goes to row
``dst_row`` of a ``[B, L]`` output, from column ``dst_col`` on::

    src_ids   [ .. a0 a1 a2 a3 a4 .. b0 b1 b2 .. ]        pieces (src_start, length, dst_row, dst_col):
                   ^a                ^b                     a: (a, 5, 0, 0)   b: (b, 3, 0, 5)
    out_ids   row 0 [ a0 a1 a2 a3 a4 | b0 b1 b2 | 0 0 ]     (pad_from[0] = 8: the tail is padding)
    out_labels      [  - a1 a2 a3 a4 |  - b1 b2 | - - ]     (mask_starts=True; - = IGNORE_INDEX)

Its three users:

* ``packloader pack`` (:func:`packloader.pack_writer.scatter_rows`): a plan's rows from one shard's tokens, with
  ``mask_starts`` and the padding written (the pre-packed format stores finished labels);
* streaming rows (:meth:`packloader.stream.StreamingRows.build`): a batch's pieces, one call per shard that
  the batch draws on, into a zeroed raw buffer (the collation masks the starts and the padding);
* pre-packed rows (:meth:`packloader.prepacked.PrepackedRows.build`): whole rows (one piece of ``L`` tokens
  each) from the memory-mapped files, one call per record batch.

:func:`place_pieces` checks every piece against both arrays (out of range is a ValueError, never a write
out of bounds) and then runs :func:`_place_kernel` (Numba: plain arrays in, plain arrays out).
:func:`row_layout` turns a plan's rows (CSR: piece offsets per row, piece lengths) into destinations.
The pure-Python twin that checks the kernel on random inputs is in ``tests/packloader/test_place.py``.
"""
from __future__ import annotations

import numpy as np

from packloader._numba import njit_cached
from packloader.batch import IGNORE_INDEX

__all__ = ["place_pieces", "row_layout", "warm_up"]


@njit_cached(nogil=True)
def _copy(src, dst):  # (an element loop over 1-D views: vectorised, about 3x faster than slice assignment)
    for j in range(len(src)):
        dst[j] = src[j]


@njit_cached(nogil=True)
def _fill(dst, value):
    for j in range(len(dst)):
        dst[j] = value


@njit_cached(nogil=True)
def _place_kernel(src_ids, src_labels, src_start, length, dst_row, dst_col, out_ids, out_labels, with_labels,
                  mask_starts, pad_from):
    """Returns -1, or the first piece that reaches outside the arrays (then nothing is written)."""
    B, L = out_ids.shape
    n_src = len(src_ids)
    for p in range(len(length)):
        s, n, r, c = src_start[p], length[p], dst_row[p], dst_col[p]
        if n < 0 or s < 0 or s + n > n_src or r < 0 or r >= B or c < 0 or c + n > L:
            return p
    flat_ids = out_ids.reshape(-1)
    flat_labels = out_labels.reshape(-1)
    for p in range(len(length)):
        s, n = src_start[p], length[p]
        d = dst_row[p] * L + dst_col[p]
        _copy(src_ids[s:s + n], flat_ids[d:d + n])
        if with_labels:
            _copy(src_labels[s:s + n], flat_labels[d:d + n])
            if mask_starts and n > 0:
                flat_labels[d] = IGNORE_INDEX
    for r in range(len(pad_from)):
        _fill(flat_ids[r * L + pad_from[r]:(r + 1) * L], 0)
        if with_labels:
            _fill(flat_labels[r * L + pad_from[r]:(r + 1) * L], IGNORE_INDEX)
    return -1


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


_NO_PADDING = np.zeros(0, np.int64)


def place_pieces(src_ids: np.ndarray, src_labels: np.ndarray | None, src_start, length, dst_row, dst_col,
                 out_ids: np.ndarray, out_labels: np.ndarray | None = None, *, mask_starts: bool = False,
                 pad_from=None) -> None:
    """Copy pieces of ``src_ids`` (and ``src_labels``) into the rows of ``out_ids`` (and ``out_labels``).

    Args:
        src_ids: int32 [n] flat source tokens.
        src_labels: int32 [n] their labels, or None: the labels are the tokens.
        src_start, length, dst_row, dst_col: int [m] each: piece ``p`` is
            ``src[src_start[p]:src_start[p] + length[p]]`` and goes to
            ``out[dst_row[p], dst_col[p]:dst_col[p] + length[p]]``.
        out_ids: int32 [B, L] C-contiguous, written in place.
        out_labels: int32 [B, L] written in place, or None to write no labels.
        mask_starts: write ``IGNORE_INDEX`` as the label of each piece's first token.
        pad_from: optional int [B]: row ``r``'s columns from ``pad_from[r]`` on are padding (ids 0,
            labels ``IGNORE_INDEX``), written after the pieces. None: the padding is left as it is.

    Raises:
        ValueError: mismatched shapes, or a piece that reaches outside ``src_ids`` or a row (names it;
            nothing is written then).
    """
    src_start, length, dst_row, dst_col = _i64(src_start), _i64(length), _i64(dst_row), _i64(dst_col)
    m = len(length)
    if not (len(src_start) == len(dst_row) == len(dst_col) == m):
        raise ValueError(f"src_start, length, dst_row, dst_col must have one length, got {len(src_start)}, {m}, "
                         f"{len(dst_row)}, {len(dst_col)}")
    if out_ids.ndim != 2 or not out_ids.flags.c_contiguous:
        raise ValueError(f"out_ids must be a C-contiguous [B, L] array, got shape {out_ids.shape}")
    B, L = out_ids.shape
    with_labels = out_labels is not None
    if with_labels and (out_labels.shape != out_ids.shape or not out_labels.flags.c_contiguous):
        raise ValueError(f"out_labels must be C-contiguous and shaped as out_ids {out_ids.shape}, got shape "
                         f"{out_labels.shape}")
    if src_labels is None:
        src_labels = src_ids
    elif len(src_labels) != len(src_ids):
        raise ValueError(f"src_labels has {len(src_labels)} tokens, src_ids {len(src_ids)}")
    if pad_from is None:
        pad_from = _NO_PADDING
    else:
        pad_from = _i64(pad_from)
        if len(pad_from) != B or (B and (pad_from.min() < 0 or pad_from.max() > L)):
            raise ValueError(f"pad_from must hold {B} columns in [0, {L}]")
    bad = _place_kernel(src_ids, src_labels, src_start, length, dst_row, dst_col, out_ids,
                        out_labels if with_labels else out_ids, with_labels, bool(mask_starts), pad_from)
    if bad >= 0:
        p = int(bad)
        raise ValueError(f"piece {p} (src_start {int(src_start[p])}, length {int(length[p])}, row "
                         f"{int(dst_row[p])}, column {int(dst_col[p])}) reaches outside the source "
                         f"({len(src_ids)} tokens) or the output ([{B}, {L}])")


def row_layout(row_offsets, length) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the pieces of consecutive rows go: rows in CSR form (row ``r``'s pieces are
    ``row_offsets[r] - row_offsets[0]`` to ``row_offsets[r + 1] - row_offsets[0]`` of ``length``, placed one
    after another from column 0).

    Returns:
        ``(dst_row, dst_col, fill)``: int64 [m], int64 [m] (the piece's first column) and int64 [n_rows]
        (tokens in each row; the padding starts there).
    """
    row_offsets = _i64(row_offsets)
    length = _i64(length)
    rel = row_offsets - row_offsets[0]
    counts = np.diff(rel)
    dst_row = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    before = np.zeros(len(length) + 1, np.int64)  # tokens before each piece
    np.cumsum(length, out=before[1:])
    dst_col = before[:-1] - before[rel[:-1]][dst_row]
    fill = before[rel[1:]] - before[rel[:-1]]
    return dst_row, dst_col, fill


def warm_up() -> None:
    """Load (or compile) the kernel, in this process, for the array types the row sources pass it (writable
    and read-only sources: memory-mapped shards and pre-packed files are read-only). DataLoader workers
    forked afterwards inherit it; otherwise each worker loads it at its first batch, about 0.4 s, again
    every epoch without ``persistent_workers``."""
    out = np.zeros((1, 2), np.int32)
    for writable in (True, False):
        src = np.zeros(2, np.int32)
        src.flags.writeable = writable
        place_pieces(src, src, [0], [2], [0], [0], out, out)
