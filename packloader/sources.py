"""Token shards in: Arrow IPC (memory-mapped), Parquet and WebDataset tar shards.

A *shard* is one file of tokenized sequences. :func:`open_shard` picks a reader by the file's suffix and
returns a :class:`Shard`, which yields :class:`SequenceBatch` es: flat ``int32`` token arrays plus
``int64`` offsets, read through pyarrow record batches (``.values`` / ``.offsets``) or straight out of
a memory-mapped tar, without a Python loop per token.

========================================  ==========================================================
suffix                                    reader
========================================  ==========================================================
``.arrow`` / ``.ipc`` / ``.feather``      Arrow IPC file (or stream), memory-mapped, zero-copy;
``.arrows``                               a stream must end with its end-of-stream marker
``.parquet`` / ``.pq``                    Parquet, read in record batches of ``batch_rows`` rows
``.tar``                                  WebDataset tar; members ``KEY.input_ids.npy`` (or
                                          ``KEY.npy``) and optional ``KEY.labels.npy``
========================================  ==========================================================

Example::

    >>> from packloader.sources import resolve_sources, open_shard
    >>> paths = resolve_sources(["data/shard-{000..003}.arrow"])        # doctest: +SKIP
    >>> shard = open_shard(paths[0])                                     # doctest: +SKIP
    >>> len(shard), shard.lengths()[:3]                                  # doctest: +SKIP
    (5000, array([212, 87, 1033]))
    >>> for b in shard.iter_batches():                                   # doctest: +SKIP
    ...     first = b.tokens[b.offsets[0]:b.offsets[1]]                  # sequence b.row_start

Token columns are ``list<int32>`` or ``large_list<int32>`` (other integer value types are accepted and
converted when every id fits in int32); float values, nulls, negative ids, a missing column and a corrupt
file raise :class:`~packloader.errors.DataError` naming the file and the row.
"""
from __future__ import annotations

import glob
import mmap
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from packloader.errors import DataError

__all__ = [
    "SequenceBatch",
    "Shard",
    "ArrowShard",
    "ParquetShard",
    "TarShard",
    "open_shard",
    "resolve_sources",
    "expand_braces",
    "shard_format",
    "ARROW_SUFFIXES",
    "PARQUET_SUFFIXES",
    "TAR_SUFFIXES",
]

ARROW_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
PARQUET_SUFFIXES = (".parquet", ".pq")
TAR_SUFFIXES = (".tar",)
SUPPORTED_SUFFIXES = ARROW_SUFFIXES + PARQUET_SUFFIXES + TAR_SUFFIXES

#: rows per :class:`SequenceBatch` for Parquet and tar shards (Arrow IPC keeps its own record batches)
DEFAULT_BATCH_ROWS = 16384

_INT32_MAX = np.iinfo(np.int32).max


# --------------------------------------------------------------------------------------------------
# path patterns


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style brace patterns, as webdataset accepts them.

    ``{a,b}`` alternates, ``{000..127}`` counts (keeping the zero padding of the wider bound),
    ``{0..10..2}`` counts by a step and ``{a..e}`` runs over letters; braces nest and several may appear.
    A brace with neither ``,`` nor ``..`` is left as text.

    Args:
        pattern: the pattern.

    Returns:
        The expanded strings, in order.

    Example::

        >>> expand_braces("shard-{00..02}.{arrow,tar}")
        ['shard-00.arrow', 'shard-00.tar', 'shard-01.arrow', 'shard-01.tar', 'shard-02.arrow', 'shard-02.tar']
    """
    open_at = -1
    depth = 0
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                open_at = i
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                head, body, tail = pattern[:open_at], pattern[open_at + 1:i], pattern[i + 1:]
                options = _brace_options(body)
                if options is None:  # literal braces: keep them, expand what follows
                    return [head + "{" + body + "}" + t for t in expand_braces(tail)]
                out = []
                for opt in options:
                    for expanded in expand_braces(head + opt):
                        for t in expand_braces(tail):
                            out.append(expanded + t)
                return out
    return [pattern]


def _brace_options(body: str) -> list[str] | None:
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?", body)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        step = abs(int(m.group(3))) if m.group(3) else 1
        if step == 0:
            step = 1
        padded = any(len(g.lstrip("-")) > 1 and g.lstrip("-").startswith("0") for g in m.group(1, 2))
        width = max(len(m.group(1)), len(m.group(2))) if padded else 0
        values = range(a, b + 1, step) if a <= b else range(a, b - 1, -step)
        return [str(v).zfill(width) if width else str(v) for v in values]
    m = re.fullmatch(r"([A-Za-z])\.\.([A-Za-z])", body)
    if m:
        a, b = ord(m.group(1)), ord(m.group(2))
        step = 1 if a <= b else -1
        return [chr(c) for c in range(a, b + step, step)]
    # top-level commas
    parts, depth, cur = [], 0, []
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if not parts:
        return None
    parts.append("".join(cur))
    return parts


def shard_format(path) -> str:
    """Return ``"arrow"``, ``"parquet"`` or ``"tar"`` for a shard path, from its suffix.

    Raises:
        DataError: the suffix is not one of the supported ones.
    """
    name = os.fspath(path).lower()
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TAR_SUFFIXES):
        return "tar"
    raise DataError(
        f"unsupported shard suffix; expected one of {', '.join(SUPPORTED_SUFFIXES)}", path=path
    )


def resolve_sources(patterns: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Expand shard patterns into a list of existing shard files.

    A pattern naming an existing file or directory literally is taken as is (so ``br[ack]et.arrow`` or
    ``a{1,2}.arrow`` can be addressed; :func:`glob.escape` works too). Otherwise it is brace-expanded
    (:func:`expand_braces`), then glob-expanded (``*``, ``?``, ``[...]``, ``**``); the matches of each glob
    are sorted. A directory stands for every supported shard (``.arrow``, ``.arrows``, ``.ipc``,
    ``.feather``, ``.parquet``, ``.pq``, ``.tar``) directly inside it, sorted; a directory written by
    ``packloader prepare`` stands for exactly the shards its ``prepare.json`` lists (so shards of another
    output set can never be counted twice). Duplicates are dropped, keeping the first occurrence.

    Args:
        patterns: one pattern or an iterable of patterns (str or path-like).

    Returns:
        Paths (str), in pattern order.

    Raises:
        DataError: a pattern matches no file, or names a file with an unsupported suffix; a directory
            written by ``packloader pack`` (a pre-packed directory, finished or not, is not a set of
            token shards); a ``prepare`` directory whose manifest lists a missing shard.

    Example::

        >>> resolve_sources(["data/shard-{000..127}.tar", "more/*.parquet"])   # doctest: +SKIP
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    out: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        matched: list[str] = []
        literal = os.path.exists(pattern)
        for expanded in ([pattern] if literal else expand_braces(pattern)):
            if os.path.isdir(expanded):
                hits = _directory_shards(expanded)
            elif not literal and glob.has_magic(expanded):
                hits = sorted(glob.glob(expanded, recursive=True))
                hits = [h for h in hits if os.path.isfile(h) and h.lower().endswith(SUPPORTED_SUFFIXES)]
            elif os.path.isfile(expanded):
                shard_format(expanded)  # raises on an unsupported suffix
                hits = [expanded]
            else:
                raise DataError(f"no such shard file (from pattern {pattern!r})", path=expanded)
            matched.extend(hits)
        if not matched:
            raise DataError(f"pattern {pattern!r} matches no shard file")
        for p in matched:
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def _directory_shards(d: str) -> list[str]:
    """The shards a directory stands for (see :func:`resolve_sources`)."""
    import json

    from packloader._outdir import owner_of

    owner = owner_of(d)
    if owner == "pack" or os.path.isfile(os.path.join(d, "index.json")):
        if os.path.isfile(os.path.join(d, "index.json")):
            raise DataError("a pre-packed directory (written by 'packloader pack'), not token shards: read it "
                            "with PackedDataLoader / PrepackedDataset, or give the original shards", path=d)
        raise DataError("not a finished pre-packed directory (written by 'packloader pack', but no index.json: "
                        "packing incomplete, failed, or still running)", path=d)
    manifest = os.path.join(d, "prepare.json")
    if owner == "prepare" and os.path.isfile(manifest):
        try:
            with open(manifest, encoding="utf-8") as f:
                m = json.load(f)
            names = m["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"unreadable prepare manifest: {e}", path=manifest) from None
        if m.get("replacing"):
            raise DataError("'packloader prepare' did not finish replacing this directory's shards; run it "
                            "again", path=d)
        out = []
        for n in names:
            p = os.path.join(d, n)
            if not os.path.isfile(p):
                raise DataError(f"shard {n!r} listed in prepare.json is missing", path=d)
            out.append(p)
        return out
    return sorted(
        os.path.join(d, n) for n in os.listdir(d)
        if n.lower().endswith(SUPPORTED_SUFFIXES) and os.path.isfile(os.path.join(d, n))
    )


# --------------------------------------------------------------------------------------------------
# batches


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


def _concat_batches(batches: list[SequenceBatch]) -> SequenceBatch:
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


# --------------------------------------------------------------------------------------------------
# shards


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
        return _concat_batches(list(self.iter_batches()))

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


def open_shard(
    path,
    token_column: str = "input_ids",
    labels_column: str | None = "labels",
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    vocab_size: int | None = None,
) -> Shard:
    """Open one shard, choosing the reader by its suffix.

    Args:
        path: the shard file (``.arrow`` / ``.ipc`` / ``.feather``, ``.parquet`` / ``.pq``, ``.tar``).
        token_column: the column (or, in a tar, the member ``KEY.<token_column>.npy``; ``KEY.npy`` is
            accepted too) holding the token ids. Default ``"input_ids"``.
        labels_column: the optional labels column / member (``-100`` marks tokens without loss). When
            the shard lacks it, the labels are the inputs (``SequenceBatch.labels is None``). ``None``
            ignores labels altogether.
        batch_rows: sequences per batch for Parquet and tar shards.
        vocab_size: optional; reading a token id ``>= vocab_size`` raises a DataError naming the file and
            row.

    Returns:
        An :class:`ArrowShard`, :class:`ParquetShard` or :class:`TarShard`.

    Raises:
        DataError: unsupported suffix, unreadable or corrupt file, missing token column, wrong type.
    """
    fmt = shard_format(path)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError("no such file", path=path)
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
                                   or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
    if fmt == "arrow":
        shard = ArrowShard(path, token_column, labels_column)
    elif fmt == "parquet":
        shard = ParquetShard(path, token_column, labels_column, batch_rows=batch_rows)
    else:
        shard = TarShard(path, token_column, labels_column, batch_rows=batch_rows)
    shard.vocab_size = None if vocab_size is None else int(vocab_size)
    return shard


# ---- pyarrow helpers -------------------------------------------------------------------------------


def _check_list_type(path, schema: pa.Schema, column: str, *, required: bool, what: str):
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


def _list_arrays(path, arr: pa.Array, column: str, row0: int, *, allow_negative: bool):
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
    vals = _to_int32(path, vals, offsets, column, row0, allow_negative=allow_negative)
    return offsets, vals


def _to_int32(path, vals: np.ndarray, offsets: np.ndarray, column: str, row0: int, *, allow_negative: bool):
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


def _labels_arrays(path, arr, column, row0, tok_offsets):
    offsets, vals = _list_arrays(path, arr, column, row0, allow_negative=True)
    if len(offsets) != len(tok_offsets) or not np.array_equal(offsets, tok_offsets):
        lt, ll = np.diff(tok_offsets), np.diff(offsets)
        bad = int(np.flatnonzero(lt != ll)[0])
        raise DataError(
            f"labels column {column!r} has {int(ll[bad])} labels for {int(lt[bad])} tokens",
            path=path, row=row0 + bad,
        )
    return vals


def _column(batch, idx):
    col = batch.column(idx)
    if isinstance(col, pa.ChunkedArray):  # tables
        col = col.combine_chunks()
    return col


class ArrowShard(Shard):
    """An Arrow IPC file (or stream), memory-mapped: token arrays are views of the file's pages.

    Args:
        path: the ``.arrow`` / ``.ipc`` / ``.feather`` file.
        token_column: the ``list<int32>`` / ``large_list<int32>`` token column. Default ``"input_ids"``.
        labels_column: optional labels column (same row lengths); None to ignore.

    Example::

        >>> shard = ArrowShard("shard-000.arrow")                  # doctest: +SKIP
        >>> b = next(shard.iter_batches()); b.tokens.base is not None
        True
    """

    format = "arrow"

    def __init__(self, path, token_column: str = "input_ids", labels_column: str | None = "labels"):
        self.path = os.fspath(path)
        self.token_column = token_column
        self.labels_column = labels_column
        try:
            self._source = pa.memory_map(self.path, "r")
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
        self._tok_idx = _check_list_type(self.path, schema, token_column, required=True, what="token")
        self._lab_idx = (
            None if labels_column is None
            else _check_list_type(self.path, schema, labels_column, required=False, what="labels")
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
                    _list_arrays(self.path, arr, self.token_column, int(self._rows[bi]), allow_negative=True)
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
                offsets, tokens = _list_arrays(
                    self.path, batch.column(self._tok_idx), self.token_column, row0, allow_negative=False
                )
                labels = None
                if self._lab_idx is not None:
                    labels = _labels_arrays(
                        self.path, batch.column(self._lab_idx), self.labels_column, row0, offsets
                    )
            except pa.ArrowException as e:
                raise DataError(f"corrupt Arrow data: {e}", path=self.path, row=row0) from None
            yield self._check_vocab(SequenceBatch(row0, offsets, tokens, labels))

    def close(self) -> None:
        self._batches = []
        self._rows = np.zeros(1, np.int64)
        self._source.close()


class ParquetShard(Shard):
    """A Parquet file, read column by column in record batches of ``batch_rows`` rows.

    Args:
        path: the ``.parquet`` / ``.pq`` file.
        token_column: the ``list<int32>`` / ``large_list<int32>`` token column. Default ``"input_ids"``.
        labels_column: optional labels column; None to ignore.
        batch_rows: rows per yielded batch.

    Example::

        >>> shard = ParquetShard("train-0000.parquet", token_column="tokens")   # doctest: +SKIP
    """

    format = "parquet"

    def __init__(self, path, token_column: str = "input_ids", labels_column: str | None = "labels",
                 *, batch_rows: int = DEFAULT_BATCH_ROWS):
        import pyarrow.parquet as pq

        self.path = os.fspath(path)
        self.token_column = token_column
        self.labels_column = labels_column
        self.batch_rows = int(batch_rows)
        try:
            # page checksums (CRC32), where the writer stored them, are verified on every read
            self._pf = pq.ParquetFile(self.path, memory_map=True, page_checksum_verification=True)
            schema = self._pf.schema_arrow
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"corrupt or unreadable Parquet file: {type(e).__name__}: {e}", path=self.path) from None
        self.schema = schema
        _check_list_type(self.path, schema, token_column, required=True, what="token")
        lab = None if labels_column is None else _check_list_type(
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

    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            parts = []
            row = 0
            try:
                for rb in self._pf.iter_batches(batch_size=self.batch_rows, columns=[self.token_column]):
                    arr = rb.column(0)
                    if arr.null_count:
                        _list_arrays(self.path, arr, self.token_column, row, allow_negative=True)
                    parts.append(np.diff(arr.offsets.to_numpy()).astype(np.int64, copy=False))
                    row += rb.num_rows
                if row != len(self):
                    raise DataError(f"corrupt Parquet file: {row} rows decoded, its footer says {len(self)}",
                                    path=self.path)
            except DataError:
                raise
            except (pa.ArrowException, OSError, ValueError) as e:
                raise DataError(f"corrupt Parquet data: {type(e).__name__}: {e}", path=self.path, row=row) from None
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._lengths

    def iter_batches(self, start: int = 0) -> Iterator[SequenceBatch]:
        start = self._check_start(start)
        if start == len(self):
            return
        g = int(np.searchsorted(self._groups, start, side="right") - 1)
        row = int(self._groups[g])
        skip = start - row
        try:
            it = self._pf.iter_batches(
                batch_size=self.batch_rows, columns=self._columns,
                row_groups=list(range(g, len(self._groups) - 1)),
            )
            for rb in it:
                if skip >= rb.num_rows:
                    skip -= rb.num_rows
                    row += rb.num_rows
                    continue
                if skip:
                    rb = rb.slice(skip)
                    row += skip
                    skip = 0
                offsets, tokens = _list_arrays(self.path, rb.column(0), self.token_column, row,
                                               allow_negative=False)
                labels = None
                if self.has_labels:
                    labels = _labels_arrays(self.path, rb.column(1), self.labels_column, row, offsets)
                yield self._check_vocab(SequenceBatch(row, offsets, tokens, labels))
                row += rb.num_rows
        except DataError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"corrupt Parquet data: {type(e).__name__}: {e}", path=self.path, row=row) from None

    def close(self) -> None:
        try:
            self._pf.close()
        except AttributeError:
            pass


# ---- WebDataset tar -------------------------------------------------------------------------------

_NPY_MAGIC = b"\x93NUMPY"
_NPY_DESCR = re.compile(rb"""['"]descr['"]\s*:\s*['"]([^'"]+)['"]""")
_NPY_SHAPE = re.compile(rb"""['"]shape['"]\s*:\s*\(([^)]*)\)""")
_NPY_FORTRAN = re.compile(rb"""['"]fortran_order['"]\s*:\s*(True|False)""")
_NPY_FAST = re.compile(
    rb"\x93NUMPY\x01\x00(..)\{'descr': '([<|][iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}",
    re.S,
)
_ITEMSIZE = {b"<i1": 1, b"|i1": 1, b"<u1": 1, b"|u1": 1, b"<i2": 2, b"<u2": 2, b"<i4": 4, b"<u4": 4,
             b"<i8": 8, b"<u8": 8}
_DESCR_STR = {k: np.dtype(k.decode()).str for k in _ITEMSIZE}


def _walk_tar_py(buf):
    """Walk the 512-byte tar headers of ``buf`` (uint8): (header positions, sizes, type flags, error code,
    error byte offset). Error codes: 1 truncated header, 2 bad number field, 3 bad checksum, 4 member data
    past the end, 5 no end-of-archive (zero) block after the last member. Compiled with Numba on first use (cached)."""
    n = buf.size
    cap = 64
    pos = np.empty(cap, np.int64)
    size = np.empty(cap, np.int64)
    flag = np.empty(cap, np.uint8)
    m = 0
    p = 0
    err = 0
    ended = False
    while p < n:
        if p + 512 > n:
            err = 1
            break
        zero = True
        for j in range(512):
            if buf[p + j] != 0:
                zero = False
                break
        if zero:
            ended = True
            break
        # stored checksum: octal digits, ended by NUL or space
        stored = 0
        bad = False
        seen = False
        for j in range(148, 156):
            c = buf[p + j]
            if c >= 48 and c <= 55:
                stored = stored * 8 + (c - 48)
                seen = True
            elif c == 0 or c == 32:
                if seen:
                    break
            else:
                bad = True
                break
        if bad:
            err = 2
            break
        total = 256  # the checksum field counts as 8 spaces
        for j in range(148):
            total += buf[p + j]
        for j in range(156, 512):
            total += buf[p + j]
        if total != stored:
            err = 3
            break
        sz = 0
        if buf[p + 124] & 0x80:  # GNU base-256
            sz = buf[p + 124] & 0x7F
            for j in range(125, 136):
                sz = sz * 256 + buf[p + j]
        else:
            seen = False
            for j in range(124, 136):
                c = buf[p + j]
                if c >= 48 and c <= 55:
                    sz = sz * 8 + (c - 48)
                    seen = True
                elif c == 0 or c == 32:
                    if seen:
                        break
                else:
                    bad = True
                    break
            if bad:
                err = 2
                break
        if p + 512 + sz > n:
            err = 4
            break
        if m == cap:
            cap *= 2
            pos2 = np.empty(cap, np.int64)
            size2 = np.empty(cap, np.int64)
            flag2 = np.empty(cap, np.uint8)
            pos2[:m] = pos[:m]
            size2[:m] = size[:m]
            flag2[:m] = flag[:m]
            pos, size, flag = pos2, size2, flag2
        pos[m] = p
        size[m] = sz
        flag[m] = buf[p + 156]
        m += 1
        p += 512 + ((sz + 511) // 512) * 512
    if err == 0 and p > n:  # the last member's padding is cut off: the file was truncated
        err = 4
        p = pos[m - 1]
    elif err == 0 and not ended:  # no zero block after the last member: cut at a member boundary
        err = 5
    return pos[:m].copy(), size[:m].copy(), flag[:m].copy(), err, p


_walk_tar_jit = None


def _walk_tar(buf):
    global _walk_tar_jit
    if _walk_tar_jit is None:
        from packloader._numba import njit_cached

        _walk_tar_jit = njit_cached(nogil=True)(_walk_tar_py)
    return _walk_tar_jit(buf)


class TarShard(Shard):
    """A WebDataset tar shard of ``.npy`` token arrays, memory-mapped and indexed once.

    Each sample is the run of consecutive members sharing a key (the member name up to the first dot of
    its base name, as in webdataset): ``KEY.input_ids.npy`` (or ``KEY.npy``) holds the 1-D integer
    token array, ``KEY.labels.npy`` the optional labels; other members (``.json``, ``.txt``, ...) are
    ignored. Tar headers are parsed directly from the memory map (checksums verified), so the file is
    read once and the token arrays are copied straight from the page cache into each batch.

    Args:
        path: the ``.tar`` file.
        token_column: member extension stem of the tokens (``KEY.<token_column>.npy``). Default
            ``"input_ids"``.
        labels_column: member extension stem of the labels; None to ignore labels.
        batch_rows: samples per yielded batch.

    Raises:
        DataError: corrupt or truncated tar (bad header checksum, member beyond the end of the file),
            a sample without a token member, a member that is not a 1-D integer ``.npy`` array, or
            labels whose length differs from the tokens'; the message names the member and row.

    Example::

        >>> shard = TarShard("shard-000.tar")                       # doctest: +SKIP
        >>> shard.keys[:2]                                         # doctest: +SKIP
        ['sample000000', 'sample000001']
    """

    format = "tar"

    def __init__(self, path, token_column: str = "input_ids", labels_column: str | None = "labels",
                 *, batch_rows: int = DEFAULT_BATCH_ROWS):
        self.path = os.fspath(path)
        self.token_column = token_column
        self.labels_column = labels_column
        self.batch_rows = int(batch_rows)
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            self._mm = None
            self._buf = np.zeros(0, np.uint8)
        else:
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        try:
            self._index()
        except BaseException:
            self.close()
            raise

    # -- indexing --

    def _index(self) -> None:
        buf, mm, path = self._buf, self._mm, self.path
        tok_ext = f"{self.token_column}.npy".lower().encode()
        lab_ext = None if self.labels_column is None else f"{self.labels_column}.npy".lower().encode()
        if not len(buf):
            raise DataError("0-byte file: not a tar archive (an empty archive is two 512-byte zero blocks)",
                            path=path)
        pos, sizes, flags, err, err_at = _walk_tar(buf)
        if not err and buf[err_at:].any():  # only zeros may follow the end-of-archive block
            err = 6
        m = len(pos)
        if m and not err:  # the common case in one vectorised pass (packloader._tarindex), else member by member
            from packloader._tarindex import index_common_case

            fast = index_common_case(buf, pos, sizes, flags, tok_ext, lab_ext)
            if fast is not None:
                self.__dict__.update(fast)
                return
        names = buf[pos[:, None] + np.arange(100)].view("S100").ravel().tolist() if m else []
        if err:
            prev = names[-1].decode("utf-8", "replace") if names else None
            if err == 6:
                raise DataError(
                    f"corrupt tar: non-zero bytes after the end-of-archive (zero) block at byte {err_at}: a "
                    f"damaged member header? (last member before it: {prev!r})", path=path, member=prev)
            if err == 5:
                raise DataError(
                    "truncated tar: no end-of-archive block (a tar ends with two 512-byte zero blocks); the file "
                    f"ends right after member {prev!r} (the last complete member: later members are lost)",
                    path=path, member=prev)
            what = {1: "truncated header", 2: "bad number field in the header", 3: "bad header checksum",
                    4: "member data runs past the end of the file"}[err]
            if err == 4:
                raise DataError(f"corrupt tar: {what} (truncated file?)", path=path,
                                member=buf[err_at:err_at + 100].tobytes().split(b"\0", 1)[0].decode("utf-8", "replace"))
            raise DataError(f"corrupt tar: {what} at byte {err_at} (after member {prev!r})", path=path)
        # ustar prefix field (names > 100 bytes)
        if m:
            has_prefix = np.flatnonzero((buf[pos + 345] != 0) & (buf[pos + 257] == ord("u")))
            for i in has_prefix.tolist():
                prefix = mm[pos[i] + 345:pos[i] + 500].split(b"\0", 1)[0]
                names[i] = prefix + b"/" + names[i]
        # GNU long names and pax headers name the member that follows them
        skip = np.zeros(m, bool)
        if m:
            special = np.flatnonzero(np.isin(flags, np.frombuffer(b"LxXg", np.uint8)))
            for i in special.tolist():
                skip[i] = True
                data = int(pos[i]) + 512
                block = mm[data:data + int(sizes[i])]
                if i + 1 < m:
                    if flags[i] == ord("L"):
                        names[i + 1] = block.split(b"\0", 1)[0]
                    elif flags[i] in (ord("x"), ord("X")):
                        p = self._pax_path(block)
                        if p is not None:
                            names[i + 1] = p
        regular = (flags == ord("0")) | (flags == 0) | (flags == ord("7"))
        keep = np.flatnonzero(regular & ~skip).tolist()

        keys: list[bytes] = []
        tok_off: list[int] = []   # byte offset of the array data
        tok_n: list[int] = []
        tok_dt: list[str] = []
        lab_off: list[int] = []
        lab_n: list[int] = []
        lab_dt: list[str] = []
        cur_key = None
        cur_tok = cur_lab = None
        cur_first = cur_lab_name = None
        posl = pos.tolist()
        sizel = sizes.tolist()
        npy = self._npy

        def finish():
            row = len(keys)
            if cur_tok is None:
                raise DataError(
                    f"sample {cur_key.decode('utf-8', 'replace')!r} has no {tok_ext.decode()!r} (or '.npy') "
                    "member", path=path, member=cur_first.decode("utf-8", "replace"), row=row,
                )
            keys.append(cur_key)
            tok_off.append(cur_tok[0]); tok_n.append(cur_tok[1]); tok_dt.append(cur_tok[2])
            if cur_lab is not None:
                if cur_lab[1] != cur_tok[1]:
                    raise DataError(
                        f"sample {cur_key.decode('utf-8', 'replace')!r} has {cur_lab[1]} labels for "
                        f"{cur_tok[1]} tokens", path=path, member=cur_lab_name.decode("utf-8", "replace"), row=row,
                    )
                lab_off.append(cur_lab[0]); lab_n.append(cur_lab[1]); lab_dt.append(cur_lab[2])
            else:
                lab_off.append(-1); lab_n.append(0); lab_dt.append("")

        for i in keep:
            name = names[i]
            slash = name.rfind(b"/")
            dot = name.find(b".", slash + 1)
            if dot <= slash + 1:
                continue  # no extension, or a hidden file: not part of a sample (webdataset skips it too)
            key = name[:dot]
            ext = name[dot + 1:].lower()
            if key != cur_key:
                if cur_key is not None:
                    finish()
                cur_key, cur_tok, cur_lab, cur_first = key, None, None, name
            if ext == tok_ext or (ext == b"npy" and cur_tok is None):  # KEY.npy: bare tokens
                cur_tok = npy(posl[i] + 512, sizel[i], name, len(keys))
            elif lab_ext is not None and ext == lab_ext:
                cur_lab = npy(posl[i] + 512, sizel[i], name, len(keys))
                cur_lab_name = name
        if cur_key is not None:
            finish()
        self.keys = [k.decode("utf-8", "replace") for k in keys]
        self._tok_off = np.asarray(tok_off, np.int64)
        self._tok_n = np.asarray(tok_n, np.int64)
        self._tok_dt = tok_dt
        self._lab_off = np.asarray(lab_off, np.int64)
        self._lab_n = np.asarray(lab_n, np.int64)
        self._lab_dt = lab_dt
        self.has_labels = bool(len(self._lab_off)) and bool((self._lab_off >= 0).any())
        self._fast_tok = all(d == "<i4" for d in tok_dt) and not (self._tok_off % 4).any()
        self._fast_lab = (
            self.has_labels and all(d == "<i4" for d, o in zip(lab_dt, lab_off) if o >= 0)
            and not (self._lab_off[self._lab_off >= 0] % 4).any()
        )

    @staticmethod
    def _pax_path(block: bytes) -> bytes | None:
        out = None
        i = 0
        while i < len(block):
            sp = block.find(b" ", i)
            if sp < 0:
                break
            try:
                n = int(block[i:sp])
            except ValueError:
                break
            rec = block[sp + 1:i + n - 1]
            if rec.startswith(b"path="):
                out = rec[5:]
            i += n if n > 0 else len(block)
        return out

    def _npy(self, data: int, msize: int, member: bytes, row: int):
        """(data byte offset, item count, dtype str) of a 1-D integer .npy member."""
        mm = self._mm
        head = mm[data:data + 128]
        m = _NPY_FAST.match(head)  # the header numpy writes for a 1-D little-endian int array
        if m is not None and m.end() <= msize:
            descr, n, hlen = m.group(2), int(m.group(3)), m.group(1)
            off = data + 10 + int.from_bytes(hlen, "little")
            itemsize = _ITEMSIZE.get(descr)
            if itemsize is not None and off <= data + msize and off + n * itemsize == data + msize:
                return off, n, _DESCR_STR[descr]
        return self._npy_slow(data, msize, member.decode("utf-8", "replace"), row)

    def _npy_slow(self, data: int, msize: int, member: str, row: int):
        mm, path = self._mm, self.path
        if msize < 10 or mm[data:data + 6] != _NPY_MAGIC:
            raise DataError("member is not a .npy array (bad magic)", path=path, member=member, row=row)
        major = mm[data + 6]
        if major == 1:
            hlen = int.from_bytes(mm[data + 8:data + 10], "little")
            hstart = data + 10
        else:
            hlen = int.from_bytes(mm[data + 8:data + 12], "little")
            hstart = data + 12
        header = mm[hstart:hstart + hlen]
        d = _NPY_DESCR.search(header)
        s = _NPY_SHAPE.search(header)
        if d is None or s is None or hstart + hlen > data + msize:
            raise DataError("member has a corrupt .npy header", path=path, member=member, row=row)
        descr = d.group(1).decode("latin-1")
        try:
            dtype = np.dtype(descr)
        except (TypeError, ValueError):
            raise DataError(f"member has an unknown dtype {descr!r}", path=path, member=member, row=row) from None
        if dtype.kind not in "iu":
            raise DataError(
                f"member holds {dtype} values; token ids must be integers", path=path, member=member, row=row
            )
        try:
            dims = [int(x) for x in s.group(1).replace(b" ", b"").split(b",") if x]
        except ValueError:
            raise DataError("member has a corrupt .npy shape", path=path, member=member, row=row) from None
        if len(dims) > 1 and sum(1 for x in dims if x != 1) > 1:
            raise DataError(f"member has shape {tuple(dims)}; expected a 1-D array", path=path,
                            member=member, row=row)
        n = int(np.prod(dims)) if dims else 1
        off = hstart + hlen
        if off + n * dtype.itemsize != data + msize:  # a damaged shape must not drop or invent tokens
            raise DataError(
                f"member {'is truncated' if off + n * dtype.itemsize > data + msize else 'has extra bytes'}: "
                f"shape {tuple(dims)} needs {n * dtype.itemsize} bytes, {data + msize - off} present",
                path=path, member=member, row=row,
            )
        return off, n, dtype.str

    # -- reading --

    def __len__(self) -> int:
        return len(self.keys)

    def lengths(self) -> np.ndarray:
        return self._tok_n.copy()

    def _gather(self, offs, counts, dtypes, fast, rows, row0, column, allow_negative, out_offsets):
        total = int(out_offsets[-1])
        if fast:
            src = self._buf[: len(self._buf) // 4 * 4].view(np.int32)
            from packloader._tarindex import gather_runs

            vals = gather_runs(src, offs // 4, counts, total)
            if not allow_negative and total and int(vals.min()) < 0:
                _to_int32(self.path, vals, out_offsets, column, row0, allow_negative=False)
            return vals
        vals = np.empty(total, np.int32)
        for i, (o, c, dt) in enumerate(zip(offs.tolist(), counts.tolist(), dtypes)):
            if o < 0:
                continue
            a = np.frombuffer(self._mm, dtype=np.dtype(dt), count=c, offset=o)
            a = _to_int32(self.path, a, np.array([0, c]), column, row0 + i, allow_negative=allow_negative)
            vals[out_offsets[i]:out_offsets[i + 1]] = a
        if not allow_negative and total and int(vals.min()) < 0:
            _to_int32(self.path, vals, out_offsets, column, row0, allow_negative=False)
        return vals

    def read_all(self) -> SequenceBatch:
        batches = list(self._iter(0, max(1, len(self))))
        return _concat_batches(batches)

    def iter_batches(self, start: int = 0) -> Iterator[SequenceBatch]:
        return self._iter(self._check_start(start), self.batch_rows)

    def _iter(self, start: int, batch_rows: int) -> Iterator[SequenceBatch]:
        n = len(self)
        for row0 in range(start, n, batch_rows):
            row1 = min(n, row0 + batch_rows)
            counts = self._tok_n[row0:row1]
            offsets = np.zeros(len(counts) + 1, np.int64)
            np.cumsum(counts, out=offsets[1:])
            tokens = self._gather(self._tok_off[row0:row1], counts, self._tok_dt[row0:row1], self._fast_tok,
                                  None, row0, self.token_column, False, offsets)
            labels = None
            if self.has_labels:
                loff = self._lab_off[row0:row1]
                missing = loff < 0
                if missing.all():
                    labels = tokens.copy()
                else:
                    fast = self._fast_lab and not missing.any()
                    labels = self._gather(loff, counts, self._lab_dt[row0:row1], fast, None, row0,
                                          self.labels_column, True, offsets)
                    for i in np.flatnonzero(missing).tolist():
                        labels[offsets[i]:offsets[i + 1]] = tokens[offsets[i]:offsets[i + 1]]
            yield self._check_vocab(SequenceBatch(row0, offsets, tokens, labels))

    def close(self) -> None:
        self._buf = np.zeros(0, np.uint8)
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a batch still views the map; it is released with the last view
                pass
        self._file.close()
