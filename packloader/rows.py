"""The row-source interface of :class:`packloader.PackedDataLoader`: the rows of an epoch, and a batch of them.

A row source is a small stage between the data and the loader's schedule::

    source ──> row source ──> epoch_rows(seed, epoch, shuffle)   int64 [N]: real tokens of each plan row
                         └──> build(seed, epoch, shuffle, rows)   Built(raw, ids): the rows as one buffer

Two implement it:

* :class:`packloader.stream.StreamingRows`: token shards, packed from their lengths into the epoch's plan
  (online by default) and built from a small per-process cache of decoded shards;
* :class:`packloader.prepacked.PrepackedRows`: a directory written by ``packloader pack``; the plan is its
  rows in an order shuffled by ``(seed, epoch)``, built from the memory-mapped files.

Both place tokens with :func:`packloader.place.place_pieces` and answer ``build`` with the same
:class:`Built`, so the loader never asks which one it holds. A plan is a pure function of (the data, the
settings, ``seed``, ``epoch``): no rank, world size or worker count goes into it (what makes a loader
state resumable on another layout, see :mod:`packloader.state`). A row source is pickled to the
DataLoader workers: it carries lengths and cached plans, never open files.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

__all__ = ["Built", "RowSource", "epoch_rng", "SALT_SHARDS", "SALT_SEQS", "SALT_ROWS"]

#: salts of the shuffling decisions of an epoch (see :func:`epoch_rng`)
SALT_SHARDS = 0x5A4D   # the order of shards (streaming)
SALT_SEQS = 0x5E95     # the order of the sequences of one shard (streaming)
SALT_ROWS = 0x70E5     # the order of the rows (pre-packed; streaming with an offline algorithm)


def epoch_rng(seed: int, epoch: int, salt: int, extra: int = 0) -> np.random.Generator:
    """The deterministic generator of one shuffling decision of one epoch."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFF, int(epoch), salt, int(extra)])


class Built(NamedTuple):
    """What :meth:`RowSource.build` returns: a batch of rows before collation.

    Attributes:
        raw: the int32 buffer of :func:`packloader.batch.raw_alloc` (input_ids, labels if the source has
            any, the sequence lengths of each row): what a DataLoader worker sends to the main process.
        ids: the id tables asked for with ``want_ids`` (else empty), int64 numpy arrays under their batch
            keys: ``sample_ids`` [m, 5] (row in batch, source file, sequence, start, length of each piece)
            from every source, ``row_ids`` [B] (dataset row, -1: padding row) from a pre-packed one.
    """

    raw: np.ndarray
    ids: dict


class RowSource(Protocol):
    """The interface the loader calls (see the module docstring).

    Attributes:
        fingerprint: identifies the data (a loader state resumes only on the same one).
        capacity: tokens per row.
        overflow_counts: what the overflow policy did to the data (see
            :attr:`packloader.PackedDataLoader.overflow_counts`).
    """

    fingerprint: str
    capacity: int
    overflow_counts: dict

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """int64 [N]: the real-token count of each row of the epoch's plan, in plan order."""

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False) -> Built:
        """The plan rows ``rows`` (int64 [B]; ``-1``: a padding row) of the epoch, as one raw buffer."""
