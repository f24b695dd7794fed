"""Arrow IPC shards (file or stream), memory-mapped; the list-column helpers the Parquet reader shares."""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pyarrow as pa

from packloader.errors import DataError
from packloader.sources.base import SequenceBatch, Shard, to_int32

__all__ = ["ArrowShard"]


def check_list_type(path, schema: pa.Schema, column: str, *, required: bool, what: str):
    """Return the field index of ``column`` (None when absent and not required); check its type."""
    idx = schema.get_field_index(column)
    if idx < 0:
        if required:
            try:
                names = schema.names
            except UnicodeDecodeError:
                names = "not readable (a column name is not valid UTF-8: damaged file?)"
            raise DataError(f"{what} column {column!r} not found; columns are {names}", path=path)
        return None
    typ = schema.field(idx).type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        raise DataError(
            f"{what} column {column!r} has type {typ}; expected list<int32> or large_list<int32>",
            path=path,
        )
    vt = typ.value_type
    if not pa.types.is_integer(vt):
        raise DataError(
            f"{what} column {column!r} has type {typ}: values must be integers "
            "(list<int32> or large_list<int32>), not {vt}".replace("{vt}", str(vt)),
            path=path,
        )
    return idx


def list_arrays(path, arr: pa.Array, column: str, row0: int, *, allow_negative: bool):
    """(offsets int64 zero-based, values int32) of a (possibly sliced) list array; checks nulls, ids."""
    if arr.null_count:
        first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"column {column!r} has a null sequence", path=path, row=row0 + first)
    offs = arr.offsets.to_numpy()  # respects the slice (absolute positions into .values)
    lo, hi = int(offs[0]), int(offs[-1])
    values = arr.values  # ignores the slice: cut by the offsets
    if lo != 0 or hi != len(values):
        values = values.slice(lo, hi - lo)
    if values.null_count:
        pos = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offs, pos + lo, side="right") - 1)
        raise DataError(f"column {column!r} has a null token id", path=path, row=row0 + row)
    offsets = offs.astype(np.int64, copy=False)
    if lo:
        offsets = offsets - lo
    vals = values.to_numpy(zero_copy_only=False) if len(values) else np.empty(0, np.int32)
    vals = to_int32(path, vals, offsets, column, row0, allow_negative=allow_negative)
    return offsets, vals


def labels_arrays(path, arr, column, row0, tok_offsets):
    offsets, vals = list_arrays(path, arr, column, row0, allow_negative=True)
    if len(offsets) != len(tok_offsets) or not np.array_equal(offsets, tok_offsets):
        lt, ll = np.diff(tok_offsets), np.diff(offsets)
        bad = int(np.flatnonzero(lt != ll)[0])
        raise DataError(
            f"labels column {column!r} has {int(ll[bad])} labels for {int(lt[bad])} tokens",
            path=path, row=row0 + bad,
        )
    return vals



class ArrowShard(Shard):
    """An Arrow IPC file (or stream), memory-mapped: token arrays are views of the file's pages.

    Args:
        path: the ``.arrow`` / ``.ipc`` / ``.feather`` file.
        token_column: the ``list<int32>`` / ``large_list<int32>`` token column. Default ``"input_ids"``.
        labels_column: optional labels column (same row lengths); None to ignore.
        source: optional pyarrow random-access file holding the shard (``path`` then only names it, e.g.
            the URI of an object read into memory by :func:`~packloader.sources.open_shard`); default:
            the memory map of ``path``.

    Example::

        >>> shard = ArrowShard("shard-000.arrow")                  # doctest: +SKIP
        >>> b = next(shard.iter_batches()); b.tokens.base is not None
        True
    """

    format = "arrow"

    def __init__(self, path, token_column: str = "input_ids", labels_column: str | None = "labels", *,
                 source=None):
        self.path = os.fspath(path)
        self.token_column = token_column
        self.labels_column = labels_column
        try:
            self._source = pa.memory_map(self.path, "r") if source is None else source
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot open Arrow file: {e}", path=self.path) from None
        try:
            try:
                reader = pa.ipc.open_file(self._source)
                self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                schema = reader.schema
            except pa.ArrowInvalid:
                self._source.seek(0)
                stream = pa.ipc.open_stream(self._source)
                schema = stream.schema
                self._batches = list(stream)
                self._check_end_of_stream()
            for i, b in enumerate(self._batches):
                b.validate(full=True)  # offsets in range and increasing: a damaged file is refused
        except DataError:
            self._source.close()
            raise
        except (pa.ArrowException, OSError, ValueError) as e:  # (a damaged name: UnicodeDecodeError)
            self._source.close()
            raise DataError(f"corrupt or unreadable Arrow IPC file: {type(e).__name__}: {e}", path=self.path) from None
        self.schema = schema
        self._tok_idx = check_list_type(self.path, schema, token_column, required=True, what="token")
        self._lab_idx = (
            None if labels_column is None
            else check_list_type(self.path, schema, labels_column, required=False, what="labels")
        )
        self.has_labels = self._lab_idx is not None
        self._rows = np.cumsum([0] + [b.num_rows for b in self._batches]).astype(np.int64)
        self._lengths = None

    def _check_end_of_stream(self) -> None:
        """An IPC stream ends with an end-of-stream marker (``0xFFFFFFFF 0x00000000``, or the legacy
        ``0x00000000``) right after its last message; a stream cut at a message boundary lacks it."""
        size = self._source.size()
        self._source.seek(0)
        reader = pa.ipc.MessageReader.open_stream(self._source)
        end, n_msgs = 0, 0
        while True:
            try:
                reader.read_next_message()
            except StopIteration:
                break
            end, n_msgs = self._source.tell(), n_msgs + 1
        tail = bytes(self._source.read_at(min(8, size - end), end)) if end < size else b""
        if tail not in (b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00"):
            what = "no end-of-stream marker" if not tail else "bytes after the last message are not an end-of-stream marker"
            raise DataError(f"truncated or damaged Arrow IPC stream: {what} after message {n_msgs} "
                            f"(byte {end} of {size}; {len(self._batches)} record batch(es) read)", path=self.path)
        if end + len(tail) != size:
            raise DataError(f"Arrow IPC stream has {size - end - len(tail)} unexpected byte(s) after its "
                            "end-of-stream marker", path=self.path)

    def __len__(self) -> int:
        return int(self._rows[-1])

    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            parts = []
            for bi, b in enumerate(self._batches):
                arr = b.column(self._tok_idx)
                if arr.null_count:
                    list_arrays(self.path, arr, self.token_column, int(self._rows[bi]), allow_negative=True)
                parts.append(np.diff(arr.offsets.to_numpy()).astype(np.int64, copy=False))
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._lengths

    def iter_batches(self, start: int = 0) -> Iterator[SequenceBatch]:
        start = self._check_start(start)
        first = int(np.searchsorted(self._rows, start, side="right") - 1)
        for bi in range(max(first, 0), len(self._batches)):
            row0 = int(self._rows[bi])
            batch = self._batches[bi]
            if row0 < start:
                batch = batch.slice(start - row0)
                row0 = start
            if batch.num_rows == 0:
                continue
            try:
                offsets, tokens = list_arrays(
                    self.path, batch.column(self._tok_idx), self.token_column, row0, allow_negative=False
                )
                labels = None
                if self._lab_idx is not None:
                    labels = labels_arrays(
                        self.path, batch.column(self._lab_idx), self.labels_column, row0, offsets
                    )
            except pa.ArrowException as e:
                raise DataError(f"corrupt Arrow data: {e}", path=self.path, row=row0) from None
            yield self._check_vocab(SequenceBatch(row0, offsets, tokens, labels))

    def close(self) -> None:
        self._batches = []
        self._rows = np.zeros(1, np.int64)
        self._source.close()
