"""What every reader returns: :class:`SequenceBatch` (flat token arrays) and the :class:`Shard` interface;
the token-id checks shared by the readers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from packloader.errors import DataError

__all__ = ["SequenceBatch", "Shard", "concat_batches", "DEFAULT_BATCH_ROWS"]

#: rows per :class:`SequenceBatch` for Parquet and tar shards (Arrow IPC keeps its own record batches)
DEFAULT_BATCH_ROWS = 16384

_INT32_MAX = np.iinfo(np.int32).max


@dataclass
class SequenceBatch:
    """A run of consecutive sequences of one shard, as flat arrays.

    Args:
        row_start: index, in the shard, of the first sequence of this batch.
        offsets: int64 ``[n + 1]``; sequence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``;
            ``offsets[0] == 0``.
        tokens: int32 ``[offsets[-1]]`` token ids (all >= 0).
        labels: int32 ``[offsets[-1]]`` labels aligned with ``tokens``, or None when the shard has no
            labels (the labels are then the inputs).

    Example::

        >>> import numpy as np
        >>> b = SequenceBatch(10, np.array([0, 2, 5]), np.arange(5, dtype=np.int32), None)
        >>> len(b), b.lengths().tolist(), b.sequence(1).tolist()
        (2, [2, 3], [2, 3, 4])
    """

    row_start: int
    offsets: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        """int64 ``[n]`` sequence lengths."""
        return np.diff(self.offsets)

    def sequence(self, i: int) -> np.ndarray:
        """Tokens of the ``i``-th sequence of this batch (a view)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def label_sequence(self, i: int) -> np.ndarray:
        """Labels of the ``i``-th sequence of this batch (the tokens when the shard has no labels)."""
        src = self.tokens if self.labels is None else self.labels
        return src[self.offsets[i]:self.offsets[i + 1]]


def concat_batches(batches: list[SequenceBatch]) -> SequenceBatch:
    """One batch holding ``batches`` (consecutive, of one shard) in order."""
    if len(batches) == 1:
        return batches[0]
    if not batches:
        return SequenceBatch(0, np.zeros(1, np.int64), np.zeros(0, np.int32), None)
    offsets = [np.zeros(1, np.int64)]
    base = 0
    for b in batches:
        offsets.append(b.offsets[1:] + base)
        base += int(b.offsets[-1])
    tokens = np.concatenate([b.tokens for b in batches])
    labels = None
    if any(b.labels is not None for b in batches):
        labels = np.concatenate([b.tokens if b.labels is None else b.labels for b in batches])
    return SequenceBatch(batches[0].row_start, np.concatenate(offsets), tokens, labels)



class Shard:
    """One shard of tokenized sequences (base class; use :func:`open_shard`).

    Attributes:
        path: the file (str).
        token_column: the name of the token column / tar member extension stem.
        labels_column: the name of the labels column / member, or None.
        has_labels: whether the shard carries labels.

    ``len(shard)`` is the number of sequences; :meth:`lengths` their lengths; :meth:`iter_batches`
    yields :class:`SequenceBatch` es in shard order.
    """

    path: str
    token_column: str
    labels_column: str | None
    has_labels: bool = False
    format: str = ""
    vocab_size: int | None = None

    def _check_vocab(self, batch: "SequenceBatch") -> "SequenceBatch":
        """Raise a DataError naming the file and row when a token id is ``>= vocab_size``."""
        v = self.vocab_size
        if v is not None and batch.num_tokens and int(batch.tokens.max()) >= v:
            pos = int(np.argmax(batch.tokens >= v))
            row = int(np.searchsorted(batch.offsets, pos, side="right") - 1)
            raise DataError(
                f"{self.token_column!r} has id {int(batch.tokens[pos])} at position {pos - int(batch.offsets[row])}"
                f" of the sequence, outside the vocabulary (vocab_size={v})", path=self.path,
                row=batch.row_start + row,
            )
        return batch

    def __len__(self) -> int:
        raise NotImplementedError

    def lengths(self) -> np.ndarray:
        """int64 ``[len(self)]``: the token count of every sequence."""
        raise NotImplementedError

    def iter_batches(self, start: int = 0) -> Iterator[SequenceBatch]:
        """Yield :class:`SequenceBatch` es in shard order, beginning at sequence ``start``."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        return int(self.lengths().sum())

    def read_all(self) -> SequenceBatch:
        """Every sequence of the shard as one :class:`SequenceBatch` (a view of the memory map when the
        shard is one Arrow record batch; otherwise the batches are concatenated)."""
        return concat_batches(list(self.iter_batches()))

    def close(self) -> None:
        """Release the file (memory map) held by the shard."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, sequences={len(self)})"

    def _check_start(self, start: int) -> int:
        n = len(self)
        if start < 0 or start > n:
            raise IndexError(f"{self.path}: start {start} out of range for {n} sequences")
        return int(start)


def to_int32(path, vals: np.ndarray, offsets: np.ndarray, column: str, row0: int, *, allow_negative: bool):
    """Convert an integer array to int32 (a view when already int32); check the id range.

    ``offsets`` (zero-based, int64) map a bad position back to its row for the error message.
    """

    def row_of(pos: int) -> int:
        return row0 + int(np.searchsorted(offsets, pos, side="right") - 1)

    if vals.dtype.kind not in "iu":
        raise DataError(f"{column!r} values have dtype {vals.dtype}; expected integers", path=path, row=row0)
    if len(vals) == 0:
        return vals.astype(np.int32, copy=False)
    if vals.dtype != np.int32:
        wide = vals.dtype.itemsize > 4 or (vals.dtype.kind == "u" and vals.dtype.itemsize == 4)
        if wide:
            hi = vals > _INT32_MAX
            lo = vals < np.iinfo(np.int32).min if vals.dtype.kind == "i" else None
            bad = hi if lo is None else (hi | lo)
            if bad.any():
                pos = int(np.argmax(bad))
                raise DataError(f"{column!r} has id {int(vals[pos])} that does not fit in int32",
                                path=path, row=row_of(pos))
        vals = vals.astype(np.int32)
    if not allow_negative and int(vals.min()) < 0:
        pos = int(np.argmax(vals < 0))
        row = row_of(pos)
        raise DataError(
            f"{column!r} has a negative token id ({int(vals[pos])}) at position "
            f"{pos - int(offsets[row - row0])} of the sequence",
            path=path, row=row,
        )
    return vals
