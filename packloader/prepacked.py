"""The pre-packed directory format: its schema, and :class:`PrepackedDataset`, its zero-copy reader.

``packloader pack`` (:func:`packloader.pack_writer.pack_dataset`) writes a directory::

    out/
      part-00000.arrow      uncompressed Arrow IPC files, one packed row per Arrow row
      part-00001.arrow
      index.json            written last: files, rows, capacity, algorithm, token counts, content hash,
                            the packing report

Columns of every file (``C`` = capacity):

==================  ==============================  =====================================================
column              type                            meaning
==================  ==============================  =====================================================
``input_ids``       ``fixed_size_list<int32>[C]``   the packed tokens, padding 0
``labels``          ``fixed_size_list<int32>[C]``   labels, -100 at each sequence's first position and on
                                                    padding (not shifted: the model shifts)
``seq_lens``        ``list<int32>``                 lengths of the pieces in the row, in order
``source_file``     ``list<int32>``                 per piece: index into ``index.json["sources"]``
``source_row``      ``list<int64>``                 per piece: sequence (row) index in that source file
``source_start``    ``list<int32>``                 per piece: token offset in the source sequence (>0
                                                    only for the tail pieces of a split sequence)
==================  ==============================  =====================================================

A directory without ``index.json``, or whose ``index.json`` disagrees with the files (a missing file,
another row count, size or schema), is refused with a :class:`~packloader.errors.DataError`. Each file
entry of ``index.json`` records ``rows``, ``bytes`` and ``checksum`` (``"crc32:<hex>"`` of the
file, computed when it was written), and each file carries the hash of the job that wrote it
(``packloader.job_hash`` schema metadata, listed in ``index.json["job_hashes"]``): sizes, row counts and
job hashes are checked on every open, the checksums with ``PrepackedDataset(dir, verify=True)``,
``PackedDataLoader(dir, verify=True)`` and ``packloader report DIR --verify``.

Capacity: at most :data:`MAX_CAPACITY` tokens per row (:func:`check_capacity`).

The loader reads a directory through :class:`PrepackedRows` (a row source, see :mod:`packloader.rows`).
This module holds the whole format (schema, index, checks, reader, row source: about 570 lines) because
its parts change together whenever the format does; the writer is :mod:`packloader.pack_writer`.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
import pyarrow as pa

from packloader.batch import IGNORE_INDEX  # noqa: F401  (re-exported: the format stores it in index.json)
from packloader.batch import raw_alloc
from packloader.errors import DataError
from packloader.place import place_pieces
from packloader.rows import SALT_ROWS, Built, epoch_rng

__all__ = [
    "PrepackedDataset",
    "FORMAT",
    "VERSION",
    "INDEX_NAME",
    "packed_schema",
    "read_index",
    "check_capacity",
    "MAX_CAPACITY",
    "unfinished_pack_dir",
    "is_prepacked_dir",
    "PrepackedRows",
]

FORMAT = "packloader-packed"
VERSION = 1
INDEX_NAME = "index.json"
#: the largest capacity (tokens per packed row) accepted anywhere in packloader: 2**24 (16,777,216)
#: tokens, 64 MiB of int32 ids per row. Rows are allocated whole, and Arrow's fixed-size lists and
#: the packed files' int32 sequence lengths need the capacity well inside int32.
MAX_CAPACITY = 1 << 24


def check_fits(lengths, capacity: int, overflow: str, path=None) -> tuple[int, int]:
    """The one check of sequence lengths against ``capacity`` (``pack`` and ``PackedDataLoader``):
    ``(sequences longer than capacity, their tokens)``.

    Raises:
        DataError: with ``overflow="error"``, when a sequence is longer: names the file (``path``), the
            first such row, its length and how many there are, and the other policies.
    """
    lengths = np.asarray(lengths)
    over = np.flatnonzero(lengths > capacity)
    if over.size and overflow == "error":
        row = int(over[0])
        raise DataError(f"sequence of {int(lengths[row])} tokens is longer than capacity {capacity} "
                        f"({over.size} such sequence(s) in this file); overflow='error' is the default: pass "
                        "overflow='split', 'truncate' or 'drop' (--overflow)", path=path, row=row)
    return int(over.size), int(lengths[over].sum())


def check_capacity(value, name: str = "capacity") -> int:
    """``value`` as an int in ``[1, MAX_CAPACITY]``.

    Raises:
        ValueError: not an int (a bool is not one), or outside that range; names ``name``.
    """
    import numpy as _np

    if isinstance(value, bool) or not isinstance(value, (int, _np.integer)):
        raise ValueError(f"{name} must be an int in [1, {MAX_CAPACITY}], got {value!r}")
    if not 1 <= int(value) <= MAX_CAPACITY:
        raise ValueError(f"{name} must be an int in [1, {MAX_CAPACITY}] (MAX_CAPACITY), got {int(value)}")
    return int(value)


def unfinished_pack_dir(directory) -> bool:
    """Whether ``directory`` was written by ``packloader pack`` but holds no ``index.json`` yet (packing
    still running, killed or failed)."""
    from packloader._outdir import owner_of

    d = os.fspath(directory)
    return os.path.isdir(d) and not os.path.isfile(os.path.join(d, INDEX_NAME)) and owner_of(d) == "pack"


def packed_schema(capacity: int) -> pa.Schema:
    """The Arrow schema of a pre-packed file of the given capacity."""
    c = int(capacity)
    return pa.schema([
        pa.field("input_ids", pa.list_(pa.int32(), c), nullable=False),
        pa.field("labels", pa.list_(pa.int32(), c), nullable=False),
        pa.field("seq_lens", pa.list_(pa.int32()), nullable=False),
        pa.field("source_file", pa.list_(pa.int32()), nullable=False),
        pa.field("source_row", pa.list_(pa.int64()), nullable=False),
        pa.field("source_start", pa.list_(pa.int32()), nullable=False),
    ])


def read_index(directory) -> dict:
    """Read and check ``DIR/index.json`` of a pre-packed directory (format, version, required keys).

    Raises:
        DataError: the directory or its index is missing, unreadable or not a packloader index.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise DataError("not a directory", path=directory)
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        raise DataError(
            f"no {INDEX_NAME}: not a finished pre-packed directory (packing incomplete, failed, or still "
            "running)", path=directory,
        )
    try:
        with open(path, "r", encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"unreadable index: {e}", path=path) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"not a {FORMAT} index (format={index.get('format') if isinstance(index, dict) else None!r})",
                        path=path)
    if index.get("version") != VERSION:
        raise DataError(f"unsupported version {index.get('version')!r} (this reader reads {VERSION})", path=path)
    for key in ("capacity", "files", "total_rows"):
        if key not in index:
            raise DataError(f"index lacks {key!r}", path=path)
    cap = index["capacity"]
    if not isinstance(cap, int) or cap <= 0:
        raise DataError(f"bad capacity {cap!r}", path=path)
    if not isinstance(index["files"], list):
        raise DataError("index 'files' is not a list", path=path)
    return index


class _PackedFile:
    """One memory-mapped packed file: its record batches and their row offsets."""

    __slots__ = ("path", "source", "batches", "rows")

    def __init__(self, path: str, capacity: int, expect_rows: int | None, expect_bytes: int | None,
                 checksum: str | None = None, job_hash: str | None = None):
        self.path = path
        if not os.path.isfile(path):
            raise DataError("file listed in index.json is missing", path=path)
        if expect_bytes is not None and os.path.getsize(path) != expect_bytes:
            raise DataError(
                f"file has {os.path.getsize(path)} bytes, index.json says {expect_bytes} (replaced or "
                "damaged after packing?)", path=path,
            )
        if checksum is not None:
            from packloader._outdir import file_checksum

            got = file_checksum(path)
            if got != checksum:
                raise DataError(f"checksum mismatch: file has {got}, index.json says {checksum} (the file was "
                                "damaged or changed after packing; pack again)", path=path)
        try:
            self.source = pa.memory_map(path, "r")
            reader = pa.ipc.open_file(self.source)
            self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"corrupt or unreadable packed Arrow file: {e}", path=path) from None
        want = packed_schema(capacity)
        got = reader.schema
        for field in want:
            idx = got.get_field_index(field.name)
            if idx < 0:
                raise DataError(f"packed file lacks column {field.name!r}", path=path)
            if got.field(idx).type != field.type:
                raise DataError(
                    f"column {field.name!r} has type {got.field(idx).type}, expected {field.type}", path=path
                )
        if job_hash is not None:  # the job that wrote it, recorded in the file and in index.json
            got_hash = (got.metadata or {}).get(b"packloader.job_hash", b"").decode("utf-8", "replace")
            if got_hash != job_hash:
                raise DataError(f"file was written by another packing job (job hash {got_hash[:10] or 'none'}, "
                                f"index.json says {job_hash[:10]}): replaced after packing? pack again", path=path)
        self.rows = np.cumsum([0] + [b.num_rows for b in self.batches]).astype(np.int64)
        if expect_rows is not None and int(self.rows[-1]) != expect_rows:
            raise DataError(f"file has {int(self.rows[-1])} rows, index.json says {expect_rows}", path=path)

    def close(self):
        self.batches = []
        self.source.close()


def _fixed_rows(arr: pa.FixedSizeListArray, capacity: int, lo: int, hi: int) -> np.ndarray:
    # .values ignores a slice offset: index through arr.offset explicitly
    flat = arr.values.to_numpy(zero_copy_only=True)
    base = arr.offset
    return flat.reshape(-1, capacity)[base + lo:base + hi]


def _list_rows(arr: pa.ListArray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    offs = arr.offsets.to_numpy()  # respects the slice; absolute into .values
    values = arr.values.to_numpy(zero_copy_only=False)
    a, b = int(offs[lo]), int(offs[hi])
    return (offs[lo:hi + 1] - a).astype(np.int64), values[a:b]


class PrepackedDataset:
    """Random access to a pre-packed directory: rows of ``capacity`` tokens as numpy views.

    Opens every file listed in ``index.json`` memory-mapped and checks it against the index (presence,
    byte size, row count, schema, and the job hash each file carries in its schema metadata: a file
    replaced by another valid packed file is refused), so a half-written or foreign directory is refused
    up front. These checks read no data; ``verify=True`` adds the checksums.

    Args:
        directory: the output directory of ``packloader pack``.
        verify: also hash every file and compare with the checksum recorded in ``index.json`` at write
            time (reads all the data once; default False: sizes and row counts only). A directory
            written before checksums were recorded fails verification.

    Attributes:
        directory: the directory (str).
        index: the parsed ``index.json``.
        capacity: tokens per row.
        algorithm: the packing algorithm recorded in the index.
        sources: the source shard paths (``source_file`` indexes this list).
        file_names: the packed files, in order.
        file_offsets: int64 ``[n_files + 1]``: global row index of each file's first row.

    Example::

        >>> ds = PrepackedDataset("packed/")                                  # doctest: +SKIP
        >>> len(ds), ds.capacity                                             # doctest: +SKIP
        (1220, 2048)
        >>> ids, labels, seq_offsets, seq_lens = ds.read_rows(0, 8)          # doctest: +SKIP
        >>> ids.shape, seq_lens[seq_offsets[0]:seq_offsets[1]]               # doctest: +SKIP
        ((8, 2048), array([812, 640, 590], dtype=int32))

    Raises:
        DataError: no ``index.json``, a bad index, or a file that disagrees with it.
    """

    def __init__(self, directory, *, verify: bool = False):
        self.directory = os.fspath(directory)
        self._verify = bool(verify)
        self._open()

    def _open(self):
        self.index = read_index(self.directory)
        self.capacity = int(self.index["capacity"])
        self.algorithm = self.index.get("algorithm")
        self.sources = list(self.index.get("sources", []))
        self.file_names = []
        self._files: list[_PackedFile] = []
        opened = []
        try:
            for entry in self.index["files"]:
                if not isinstance(entry, dict) or "name" not in entry:
                    raise DataError(f"bad file entry {entry!r}", path=os.path.join(self.directory, INDEX_NAME))
                name = entry["name"]
                if os.path.basename(name) != name:
                    raise DataError(f"file entry {name!r} is not a plain file name",
                                    path=os.path.join(self.directory, INDEX_NAME))
                checksum = None
                if self._verify:
                    checksum = entry.get("checksum")
                    if not isinstance(checksum, str):
                        raise DataError(f"index.json records no checksum for {name!r} (packed by an older "
                                        "version?): cannot verify; pack again",
                                        path=os.path.join(self.directory, INDEX_NAME))
                pf = _PackedFile(os.path.join(self.directory, name), self.capacity,
                                 entry.get("rows"), entry.get("bytes"), checksum, self._job_hash(entry))
                opened.append(pf)
                self.file_names.append(name)
        except BaseException:
            for pf in opened:
                pf.close()
            raise
        self._files = opened
        self.file_offsets = np.cumsum([0] + [int(f.rows[-1]) for f in opened]).astype(np.int64)
        total = int(self.file_offsets[-1])
        if total != int(self.index["total_rows"]):
            raise DataError(f"files hold {total} rows, index.json says {self.index['total_rows']}",
                            path=os.path.join(self.directory, INDEX_NAME))

    def _job_hash(self, entry: dict) -> str | None:
        """The job hash ``entry``'s file must carry (its ``packloader.job_hash`` schema metadata), from
        ``index.json``'s ``job_hashes`` and the entry's ``job``; None when the index does not record it."""
        hashes, job = self.index.get("job_hashes"), entry.get("job")
        if (not isinstance(hashes, list) or isinstance(job, bool) or not isinstance(job, int)
                or not 0 <= job < len(hashes)):
            return None
        h = hashes[job]
        return h if isinstance(h, str) and h else None

    # pickling (e.g. DataLoader workers with spawn): reopen from the directory
    def __getstate__(self):
        return {"directory": self.directory}

    def __setstate__(self, state):
        self.directory = state["directory"]
        self._verify = False
        self._open()

    def __len__(self) -> int:
        return int(self.file_offsets[-1])

    def __repr__(self) -> str:
        return (f"PrepackedDataset({self.directory!r}, rows={len(self)}, capacity={self.capacity}, "
                f"files={len(self._files)})")

    @property
    def total_tokens(self) -> int:
        """Real (non-padding) tokens in the directory, from the index."""
        return int(self.index.get("total_tokens", 0))

    @property
    def report(self):
        """The :class:`~packloader.report.PackingReport` stored in the index."""
        from packloader.report import PackingReport

        return PackingReport.from_dict(self.index["report"])

    def file_rows(self, i: int) -> int:
        """Rows in the ``i``-th file."""
        return int(self.file_offsets[i + 1] - self.file_offsets[i])

    def _chunks(self, start: int, stop: int) -> Iterator[tuple[pa.RecordBatch, int, int]]:
        """(record batch, lo, hi) pieces covering global rows [start, stop)."""
        f = int(np.searchsorted(self.file_offsets, start, side="right") - 1)
        pos = start
        while pos < stop:
            pf = self._files[f]
            local = pos - int(self.file_offsets[f])
            bi = int(np.searchsorted(pf.rows, local, side="right") - 1)
            while bi < len(pf.batches) and pos < stop:
                b0 = int(pf.rows[bi])
                lo = local - b0
                hi = min(int(pf.rows[bi + 1]) - b0, lo + (stop - pos))
                if hi > lo:
                    yield pf.batches[bi], lo, hi
                    pos += hi - lo
                    local += hi - lo
                bi += 1
            f += 1

    def _check_range(self, start: int, stop: int | None) -> tuple[int, int]:
        n = len(self)
        stop = n if stop is None else stop
        start, stop = int(start), int(stop)
        if not (0 <= start <= stop <= n):
            raise IndexError(f"rows [{start}, {stop}) out of range for {n} rows")
        return start, stop

    def read_rows(self, start: int, stop: int | None = None):
        """Rows ``[start, stop)``.

        Args:
            start: first row (global, across files).
            stop: one past the last row; None for the end.

        Returns:
            ``(input_ids, labels, seq_lens_offsets, seq_lens)``: int32 ``[n, C]``, int32 ``[n, C]``,
            int64 ``[n + 1]`` (row ``i``'s pieces are ``seq_lens[offs[i]:offs[i+1]]``), int32 ``[m]``.
            ``input_ids`` and ``labels`` are read-only views of the memory map when the range lies in
            one record batch (the usual case), else fresh arrays.
        """
        start, stop = self._check_range(start, stop)
        c = self.capacity
        parts = list(self._chunks(start, stop))
        if len(parts) == 1:
            b, lo, hi = parts[0]
            ids = _fixed_rows(b.column(0), c, lo, hi)
            lab = _fixed_rows(b.column(1), c, lo, hi)
            offs, lens = _list_rows(b.column(2), lo, hi)
            return ids, lab, offs, lens.astype(np.int32, copy=False)
        if not parts:
            return (np.zeros((0, c), np.int32), np.zeros((0, c), np.int32), np.zeros(1, np.int64),
                    np.zeros(0, np.int32))
        ids = np.concatenate([_fixed_rows(b.column(0), c, lo, hi) for b, lo, hi in parts])
        lab = np.concatenate([_fixed_rows(b.column(1), c, lo, hi) for b, lo, hi in parts])
        offs_list, lens_list = zip(*[_list_rows(b.column(2), lo, hi) for b, lo, hi in parts])
        offs, base = [np.zeros(1, np.int64)], 0
        for o in offs_list:
            offs.append(o[1:] + base)
            base += int(o[-1])
        return ids, lab, np.concatenate(offs), np.concatenate(lens_list).astype(np.int32, copy=False)

    def read_sources(self, start: int, stop: int | None = None):
        """Provenance of the pieces of rows ``[start, stop)``.

        Returns:
            ``(offsets, source_file, source_row, source_start)``: int64 ``[n + 1]`` piece offsets per row,
            then per piece int32 index into :attr:`sources`, int64 sequence index in that source,
            int32 token offset in that sequence.
        """
        start, stop = self._check_range(start, stop)
        out = {3: [], 4: [], 5: []}
        offs, base = [np.zeros(1, np.int64)], 0
        for b, lo, hi in self._chunks(start, stop):
            for col in (3, 4, 5):
                o, v = _list_rows(b.column(col), lo, hi)
                out[col].append(v)
            offs.append(o[1:] + base)
            base += int(o[-1])
        cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in out.items()}
        return (np.concatenate(offs), cat[3].astype(np.int32, copy=False), cat[4].astype(np.int64, copy=False),
                cat[5].astype(np.int32, copy=False))

    def __getitem__(self, i: int) -> dict:
        """Row ``i`` as a dict of numpy arrays: ``input_ids``, ``labels`` [C], ``seq_lens``, and the
        provenance ``source_file``, ``source_row``, ``source_start`` per piece."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        ids, lab, _, lens = self.read_rows(i, i + 1)
        _, sf, sr, ss = self.read_sources(i, i + 1)
        return {"input_ids": ids[0], "labels": lab[0], "seq_lens": lens, "source_file": sf,
                "source_row": sr, "source_start": ss}

    def iter_rows(self, batch_rows: int = 1024, start: int = 0, stop: int | None = None):
        """Yield :meth:`read_rows` results over ``[start, stop)`` in blocks of at most ``batch_rows``
        rows, never crossing a record batch (so every block is zero-copy)."""
        start, stop = self._check_range(start, stop)
        for b, lo, hi in self._chunks(start, stop):
            for a in range(lo, hi, batch_rows):
                z = min(hi, a + batch_rows)
                offs, lens = _list_rows(b.column(2), a, z)
                yield (_fixed_rows(b.column(0), self.capacity, a, z), _fixed_rows(b.column(1), self.capacity, a, z),
                       offs, lens.astype(np.int32, copy=False))

    def close(self) -> None:
        """Release the memory maps (arrays returned earlier must not be used afterwards)."""
        for pf in self._files:
            pf.close()
        self._files = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def is_prepacked_dir(source) -> bool:
    """Whether ``source`` is a directory holding a pre-packed ``index.json``."""
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        return os.path.isdir(p) and os.path.isfile(os.path.join(p, INDEX_NAME))
    return False


class PrepackedRows:
    """The rows of a pre-packed directory as a row source of the loader (:mod:`packloader.rows`): the
    epoch's plan is the directory's rows in an order shuffled by ``(seed, epoch)``; a batch is built
    from the memory-mapped files (:class:`PrepackedDataset`), one placement per record batch it reads.

    Args:
        directory: written by ``packloader pack``.
        verify: also check every file's checksum when the directory is opened (see
            :class:`PrepackedDataset`).

    Raises:
        DataError: not a pre-packed directory, or it holds no rows.
    """

    def __init__(self, directory, *, verify: bool = False):
        import hashlib

        self.directory = os.fspath(directory)
        self._ds = ds = PrepackedDataset(self.directory, verify=verify)
        self.capacity = int(ds.capacity)
        index = ds.index
        self.n_rows = len(ds)
        if self.n_rows == 0:
            raise DataError("pre-packed directory holds no rows", path=self.directory)
        self.algorithm = index.get("algorithm")
        self.overflow = index.get("overflow")
        rep = index.get("report") if isinstance(index.get("report"), dict) else {}
        self.overflow_counts = {"policy": self.overflow,
                                **{k: int(rep.get(k) or 0) for k in ("split", "truncated", "dropped")},
                                "split_tokens": None,  # not recorded by ``pack``
                                "lost_tokens": int(rep.get("lost_tokens") or 0)}
        self.fingerprint = "prepacked:" + str(index.get("content_hash") or hashlib.sha256(
            repr((index.get("files"), index.get("total_tokens"))).encode()).hexdigest()[:24])
        self._blocks = None
        self._order: tuple | None = None
        self.row_tokens = self._load_blocks()[2]

    def __getstate__(self):  # workers reopen the files
        d = dict(self.__dict__)
        d["_ds"] = d["_blocks"] = None
        return d

    def _dataset(self) -> PrepackedDataset:
        if self._ds is None:
            self._ds = PrepackedDataset(self.directory)
        return self._ds

    def _load_blocks(self):
        """``(first row of each block int64 [k + 1], blocks, row_tokens int64 [N])``: one zero-copy block
        ``(input_ids, labels, seq_lens_offsets, seq_lens)`` per record batch, and the real tokens of
        every row."""
        if self._blocks is None:
            ds = self._dataset()
            firsts, blocks, tokens = [0], [], []
            for block in ds.iter_rows(batch_rows=max(1, len(ds))):  # (never crosses a record batch)
                soff = np.asarray(block[2], np.int64)
                csum = np.concatenate([[0], np.cumsum(block[3], dtype=np.int64)])
                tokens.append(csum[soff[1:]] - csum[soff[:-1]])
                blocks.append((block[0], block[1], soff, block[3]))
                firsts.append(firsts[-1] + len(block[0]))
            self._blocks = (np.asarray(firsts, np.int64), blocks, np.concatenate(tokens))
        return self._blocks

    def order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """int64 [N]: the directory row of each plan row (the epoch's latest order is kept)."""
        key = (int(seed), int(epoch), bool(shuffle))
        if self._order is None or self._order[0] != key:
            order = (epoch_rng(seed, epoch, SALT_ROWS).permutation(self.n_rows).astype(np.int64) if shuffle
                     else np.arange(self.n_rows, dtype=np.int64))
            if self.overflow == "carry" and shuffle:  # chains' rows after their predecessors again
                from packer_algos.chains import carry_row_order, permute_rows

                off, doc, start, _ = self._pieces()
                p_off, p_doc, p_start = permute_rows(off, order, doc, start)
                order = order[carry_row_order(p_off, p_doc, p_start)]
            order.setflags(write=False)   # kept for the whole epoch: no caller may change it
            self._order = (key, order)
        return self._order[1]

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        return self.row_tokens[self.order(seed, epoch, shuffle)]

    def _pieces(self):
        """``(row_offsets, doc_key, start, length)`` of the directory's pieces in directory order (doc keys:
        :func:`packloader.carry.doc_keys` of the provenance columns), read once."""
        if getattr(self, "_piece_cache", None) is None:
            from packloader.carry import doc_keys

            off, sf, sr, ss = self._dataset().read_sources(0, self.n_rows)
            lengths = np.concatenate([b[3] for b in self._load_blocks()[1]]).astype(np.int64)
            self._piece_cache = (off, doc_keys(sf, sr), ss.astype(np.int64), lengths)
        return self._piece_cache

    def epoch_pieces(self, seed: int, epoch: int, shuffle: bool):
        """``(row_offsets, doc_key, start, length)`` of the epoch's plan pieces, in plan order."""
        from packer_algos.chains import permute_rows

        off, doc, start, length = self._pieces()
        return permute_rows(off, self.order(seed, epoch, shuffle), doc, start, length)

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False) -> Built:
        """The plan rows ``rows`` (``-1``: a padding row) as a :class:`~packloader.rows.Built`; with
        ``want_ids`` also ``row_ids`` (the directory row of each batch row, -1: padding) and
        ``sample_ids`` (row in batch, source file index into ``index.json["sources"]``, sequence, start,
        length of each piece, from the provenance columns)."""
        firsts, blocks, _ = self._load_blocks()
        rows = np.asarray(rows, dtype=np.int64)
        gids = np.full(len(rows), -1, dtype=np.int64)
        real = np.flatnonzero(rows >= 0)
        gids[real] = self.order(seed, epoch, shuffle)[rows[real]]
        block = np.searchsorted(firsts, gids, side="right") - 1
        local = gids - firsts[block]
        counts = np.zeros(len(rows), np.int64)
        for b in real.tolist():
            soff = blocks[block[b]][2]
            counts[b] = soff[local[b] + 1] - soff[local[b]]
        buf, ids, labels, seq_off, seq_lens = raw_alloc(len(rows), self.capacity, int(counts.sum()), True)
        np.cumsum(counts, out=seq_off[1:])
        cap = self.capacity
        for k in np.unique(block[real]).tolist():  # whole rows, one placement per record batch
            b_ids, b_lab, soff, slen = blocks[k]
            dst = real[block[real] == k]
            place_pieces(b_ids.reshape(-1), b_lab.reshape(-1), local[dst] * cap, np.full(len(dst), cap), dst,
                         np.zeros(len(dst), np.int64), ids, labels)
            for b in dst.tolist():
                i = int(local[b])
                seq_lens[seq_off[b]:seq_off[b + 1]] = slen[int(soff[i]):int(soff[i + 1])]
        if not want_ids:
            return Built(buf, {})
        ds = self._dataset()
        parts = [np.zeros((0, 5), np.int64)]
        for b in real.tolist():
            _, sf, sr, ss = ds.read_sources(int(gids[b]), int(gids[b]) + 1)
            n = seq_lens[seq_off[b]:seq_off[b + 1]]
            parts.append(np.stack([np.full(len(sf), b), sf, sr, ss, n]).T.astype(np.int64))
        return Built(buf, {"row_ids": gids, "sample_ids": np.concatenate(parts)})
