"""Parquet shards, read in record batches (page checksums verified where the writer stored them)."""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pyarrow as pa

from packloader.errors import DataError
from packloader.sources.arrow import check_list_type, labels_arrays, list_arrays
from packloader.sources.base import DEFAULT_BATCH_ROWS, SequenceBatch, Shard

__all__ = ["ParquetShard"]


class ParquetShard(Shard):
    """A Parquet file, read column by column in record batches of ``batch_rows`` rows.

    Args:
        path: the ``.parquet`` / ``.pq`` file.
        token_column: the ``list<int32>`` / ``large_list<int32>`` token column. Default ``"input_ids"``.
        labels_column: optional labels column; None to ignore.
        batch_rows: rows per yielded batch.
        source: optional pyarrow random-access file of the shard (``path`` then only names it, e.g. an
            object's URI: see :func:`~packloader.sources.open_shard`); default: the memory map of ``path``.

    Example::

        >>> shard = ParquetShard("train-0000.parquet", token_column="tokens")   # doctest: +SKIP
    """

    format = "parquet"

    def __init__(self, path, token_column: str = "input_ids", labels_column: str | None = "labels",
                 *, batch_rows: int = DEFAULT_BATCH_ROWS, source=None):
        import pyarrow.parquet as pq

        self.path = os.fspath(path)
        self.token_column = token_column
        self.labels_column = labels_column
        self.batch_rows = int(batch_rows)
        self._source = source
        try:
            # page checksums (CRC32), where the writer stored them, are verified on every read
            if source is None:
                self._pf = pq.ParquetFile(self.path, memory_map=True, page_checksum_verification=True)
            else:  # (a remote file: its column chunks fetched in coalesced reads)
                self._pf = pq.ParquetFile(source, page_checksum_verification=True, pre_buffer=True)
            schema = self._pf.schema_arrow
        except (pa.ArrowException, OSError, ValueError) as e:
            if source is not None:
                source.close()
            raise DataError(f"corrupt or unreadable Parquet file: {type(e).__name__}: {e}", path=self.path) from None
        self.schema = schema
        check_list_type(self.path, schema, token_column, required=True, what="token")
        lab = None if labels_column is None else check_list_type(
            self.path, schema, labels_column, required=False, what="labels")
        self.has_labels = lab is not None
        self._columns = [token_column] + ([labels_column] if self.has_labels else [])
        md = self._pf.metadata
        self._groups = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)]).astype(np.int64)
        if int(self._groups[-1]) != md.num_rows:  # a damaged footer must not hide rows
            raise DataError(f"corrupt Parquet footer: its row groups hold {int(self._groups[-1])} rows, the file "
                            f"says {md.num_rows}", path=self.path)
        self._lengths = None

    def __len__(self) -> int:
        return int(self._groups[-1])

    def _group_batches(self, g: int, columns: list):
        """The record batches of row group ``g``; a read or decode error is a DataError naming the group's
        row range (errors are located by row group: the reader decodes a column chunk at a time)."""
        a, b = int(self._groups[g]), int(self._groups[g + 1])
        try:
            for rb in self._pf.iter_batches(batch_size=self.batch_rows, columns=columns, row_groups=[g]):
                yield rb
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"corrupt Parquet data in row group {g} (rows {a}-{b - 1}): {type(e).__name__}: {e}",
                            path=self.path, row=a) from None

    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            parts = []
            for g in range(len(self._groups) - 1):
                row = n = int(self._groups[g])
                for rb in self._group_batches(g, [self.token_column]):
                    arr = rb.column(0)
                    if arr.null_count:
                        list_arrays(self.path, arr, self.token_column, row, allow_negative=True)
                    parts.append(np.diff(arr.offsets.to_numpy()).astype(np.int64, copy=False))
                    row += rb.num_rows
                end = int(self._groups[g + 1])
                if row != end:
                    raise DataError(f"corrupt Parquet file: {row - n} rows decoded in row group {g} (rows "
                                    f"{n}-{end - 1}), its footer says {end - n}", path=self.path, row=n)
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._lengths

    def iter_batches(self, start: int = 0) -> Iterator[SequenceBatch]:
        start = self._check_start(start)
        if start == len(self):
            return
        g0 = int(np.searchsorted(self._groups, start, side="right") - 1)
        for g in range(g0, len(self._groups) - 1):
            row = int(self._groups[g])
            skip = start - row if g == g0 else 0
            for rb in self._group_batches(g, self._columns):
                if skip >= rb.num_rows:
                    skip -= rb.num_rows
                    row += rb.num_rows
                    continue
                if skip:
                    rb = rb.slice(skip)
                    row += skip
                    skip = 0
                offsets, tokens = list_arrays(self.path, rb.column(0), self.token_column, row,
                                               allow_negative=False)
                labels = None
                if self.has_labels:
                    labels = labels_arrays(self.path, rb.column(1), self.labels_column, row, offsets)
                yield self._check_vocab(SequenceBatch(row, offsets, tokens, labels))
                row += rb.num_rows

    def close(self) -> None:
        try:
            self._pf.close()
        except AttributeError:
            pass
        if self._source is not None:
            self._source.close()
