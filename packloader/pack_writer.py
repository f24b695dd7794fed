"""Offline pre-packing: token shards in, packed Arrow IPC rows out (``packloader pack``).

:func:`pack_dataset` reads each source shard (Arrow IPC, Parquet, WebDataset tar; see
:mod:`packloader.sources`), plans its rows with :func:`packer_algos.pack`, places the tokens into a
``[rows, capacity]`` buffer (:func:`packloader.place.place_pieces`), and writes that buffer zero-copy as an
uncompressed Arrow IPC file (format: :mod:`packloader.prepacked`). It returns a :class:`~packloader.report.PackingReport`.

Stages, each small:

1. ``resolve_sources`` -> shard paths; a cheap content digest per shard (size, mtime, sampled blake2b).
2. One *job* per shard (default, restartable, parallel with ``workers``), or one job over all shards
   (``global_packing=True``: rows may mix sequences of different shards).
3. A job: a record ``.packloader/job-<hash>.json`` ("writing") -> lengths -> overflow check -> plan ->
   read tokens -> scatter -> ``part-*-<hash>.arrow`` files written in ``.packloader/tmp/`` and renamed
   into place -> each file's checksum -> the record rewritten as "done" with its files.
4. ``index.json`` is written last (atomically): the commit point. A re-run with the same inputs and
   settings finds the index (or the finished jobs' records) and skips the work; a changed input or
   setting writes new files (their names carry the job hash) and only then swaps the index and removes
   the old files, so a failing run never damages a finished directory.

What ``pack`` may remove (see :mod:`packloader._outdir`): only files it provably wrote, i.e. files listed
in its own earlier ``index.json`` or named after one of its recorded jobs
(``part-<digits>-<job hash>.arrow``), and its temp files. It writes only into an empty directory or one it
owns, unless ``allow_nonempty=True``; even then other files are never overwritten or removed. Every
cleanup, including the one a killed run missed, runs again on the next run, also when the directory is
already up to date.

Example::

    >>> from packloader import pack_dataset
    >>> report = pack_dataset(["data/shard-{000..007}.arrow"], "packed/", capacity=4096,
    ...                       algorithm="bfd")                                     # doctest: +SKIP
    >>> print(report)                                                              # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from packloader._log import Progress, log
import packloader._numba  # noqa: F401  (first: Numba's cache fallback, before packer_algos compiles)

from packer_algos import ALGORITHMS  # isort: skip
from packer_algos import OVERFLOW_POLICIES as OVERFLOW  # isort: skip
from packloader._outdir import (STATE_DIR, atomic_path, atomic_write_text, claim_output_dir, file_checksum,
                                remove_file, remove_stale_temps)
from packloader.batch import IGNORE_INDEX
from packloader.errors import DataError
from packloader.place import place_pieces, row_layout
from packloader.prepacked import FORMAT, INDEX_NAME, VERSION, check_capacity, check_fits, packed_schema
from packloader.report import PackingReport
from packloader.sources import SequenceBatch, open_shard, resolve_sources

__all__ = ["pack_dataset", "scatter_rows", "write_packed_file", "source_digest", "ALGORITHMS", "OVERFLOW"]

#: a job's record in STATE_DIR
_JOB_RE = re.compile(r"^job-([0-9a-f]{24})\.json$")
#: bytes of input_ids per Arrow record batch written (labels take as much again)
RECORD_BATCH_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------------
# rows of a plan (tokens placed by packloader.place)


def scatter_rows(batch: SequenceBatch, plan, b0: int = 0, b1: int | None = None):
    """Fill rows ``[b0, b1)`` of ``plan`` with the tokens of ``batch`` (:func:`packloader.place.place_pieces`).

    Args:
        batch: all sequences the plan's ``item_ids`` index (``item_ids[p]`` is sequence ``p`` of the
            batch).
        plan: a :class:`packer_algos.PackPlan`.
        b0, b1: the row range (default: all rows).

    Returns:
        ``(input_ids, labels)``: int32 ``[(b1 - b0) * capacity]`` flat arrays; padding is 0 in
        ``input_ids``; ``labels`` are the batch's labels (or its tokens), with ``IGNORE_INDEX`` at each
        piece's first position and on padding.
    """
    b1 = plan.n_bins if b1 is None else b1
    cap = plan.capacity
    out_ids = np.empty((b1 - b0, cap), np.int32)
    out_lab = np.empty((b1 - b0, cap), np.int32)
    p0, p1 = int(plan.bin_offsets[b0]), int(plan.bin_offsets[b1])
    length = plan.lengths[p0:p1]
    dst_row, dst_col, fill = row_layout(plan.bin_offsets[b0:b1 + 1], length)
    src_start = np.asarray(batch.offsets, np.int64)[plan.item_ids[p0:p1]] + plan.starts[p0:p1]
    tokens = np.ascontiguousarray(batch.tokens, dtype=np.int32)
    labels = None if batch.labels is None else np.ascontiguousarray(batch.labels, dtype=np.int32)
    place_pieces(tokens, labels, src_start, length, dst_row, dst_col, out_ids, out_lab, mask_starts=True,
                 pad_from=fill)
    return out_ids.reshape(-1), out_lab.reshape(-1)


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()),
                                    pa.array(values, type=value_type))


def write_packed_file(path, batch: SequenceBatch, plan, b0: int, b1: int, *, source_file: np.ndarray,
                      source_row: np.ndarray, metadata: dict | None = None) -> int:
    """Write rows ``[b0, b1)`` of ``plan`` as one uncompressed Arrow IPC file, atomically.

    The file is written as ``DIR/.packloader/tmp/NAME.tmp-<pid>``, flushed to disk and renamed to ``path``
    once complete (:func:`packloader._outdir.atomic_path`).

    Args:
        path: destination.
        batch: the sequences ``plan`` indexes (see :func:`scatter_rows`).
        plan: the :class:`packer_algos.PackPlan`.
        b0, b1: the rows to write.
        source_file: int32 per sequence of ``batch``: its index in the index's ``sources``.
        source_row: int64 per sequence of ``batch``: its row in that source file.
        metadata: optional str -> str schema metadata.

    Returns:
        The size of the written file in bytes.
    """
    cap = plan.capacity
    schema = packed_schema(cap)
    if metadata:
        schema = schema.with_metadata({str(k): str(v) for k, v in metadata.items()})
    step = max(1, RECORD_BATCH_BYTES // (4 * cap))
    path = os.fspath(path)
    with atomic_path(path, fsync=False) as tmp:  # (its size and checksum in index.json reveal a torn file)
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for r0 in range(b0, b1, step):
                r1 = min(b1, r0 + step)
                ids, lab = scatter_rows(batch, plan, r0, r1)
                p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
                offs = plan.bin_offsets[r0:r1 + 1] - p0
                items = plan.item_ids[p0:p1]
                cols = [
                    pa.FixedSizeListArray.from_arrays(pa.array(ids), cap),
                    pa.FixedSizeListArray.from_arrays(pa.array(lab), cap),
                    _list_array(offs, plan.lengths[p0:p1].astype(np.int32), pa.int32()),
                    _list_array(offs, source_file[items], pa.int32()),
                    _list_array(offs, source_row[items], pa.int64()),
                    _list_array(offs, plan.starts[p0:p1].astype(np.int32), pa.int32()),
                ]
                writer.write_batch(pa.record_batch(cols, schema=schema))
        size = os.path.getsize(tmp)
    return size


# --------------------------------------------------------------------------------------------------
# hashing, atomic files


def source_digest(path) -> str:
    """A cheap content digest of a file: size, mtime and a blake2b of sampled 64 KiB blocks (all of a
    file up to 1 MiB; else the first, the last and 14 blocks in between: 1 MiB read per file, so hashing
    costs little next to packing)."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    block = 1 << 16
    with open(path, "rb") as f:
        if st.st_size <= 16 * block:
            h.update(f.read())
        else:
            for k in range(16):
                f.seek((st.st_size - block) * k // 15)
                h.update(f.read(block))
    return h.hexdigest()


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


_atomic_write_text = atomic_write_text


# --------------------------------------------------------------------------------------------------
# jobs


@dataclass
class _Job:
    index: int                 # job number (shard number when per shard)
    paths: list                # source paths of this job
    source_ids: list           # their indices in the index's "sources"
    job_hash: str
    out_dir: str
    settings: dict
    rows_per_file: int | None
    allow_empty: bool
    files: list = field(default_factory=list)


def _check_shard(shard, settings, allow_empty: bool) -> np.ndarray:
    """The shard's lengths, after the checks: one rule for empty shards (no sequence, or only zero-length
    ones: no token at all) and the overflow policy."""
    lengths = shard.lengths()
    if not allow_empty and (len(lengths) == 0 or not lengths.any()):
        what = "no sequences" if len(lengths) == 0 else f"{len(lengths)} sequence(s), all of length 0"
        raise DataError(f"empty shard ({what}: no tokens); pass allow_empty=True (--allow-empty) to skip it",
                        path=shard.path)
    check_fits(lengths, settings["capacity"], settings["overflow"], path=shard.path)
    return lengths


def _run_job(job: _Job) -> dict:
    """Pack one job; returns its state dict (files + report). Runs in a worker process or inline."""
    from packer_algos import pack

    s = job.settings
    cap = s["capacity"]
    t0 = time.perf_counter()
    _write_record(job, {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "writing"})
    shards = []
    try:
        for p in job.paths:
            shards.append(open_shard(p, s["token_column"], s["labels_column"], vocab_size=s.get("vocab_size")))
        lengths_list = [_check_shard(sh, s, job.allow_empty) for sh in shards]
        lengths = np.concatenate(lengths_list) if lengths_list else np.zeros(0, np.int64)
        row_base = np.zeros(len(shards) + 1, np.int64)
        np.cumsum([len(x) for x in lengths_list], out=row_base[1:])
        t1 = time.perf_counter()
        plan = pack(lengths, cap, s["algorithm"], overflow=s["overflow"],
                    max_items_per_bin=s["max_items_per_bin"], buffer_size=s["buffer_size"], seed=s["seed"])
        t2 = time.perf_counter()
        batches = [sh.read_all() for sh in shards]  # validates every token (negative ids, nulls, ...)
        if len(batches) == 1:
            batch = batches[0]
        else:
            from packloader.sources import _concat_batches

            batch = _concat_batches([b for b in batches if len(b)]) if any(len(b) for b in batches) else batches[0]
        t3 = time.perf_counter()
        item_shard = np.repeat(np.arange(len(shards)), [len(x) for x in lengths_list])
        source_file = np.asarray(job.source_ids, np.int32)[item_shard] if len(item_shard) else np.zeros(0, np.int32)
        source_row = np.arange(len(lengths), dtype=np.int64) - row_base[item_shard]
        n_rows = plan.n_bins
        per_file = job.rows_per_file or max(1, n_rows)
        if s["global_packing"] and not job.rows_per_file:
            per_file = max(1, -(-n_rows // max(1, len(shards))))
        ranges = [(r, min(n_rows, r + per_file)) for r in range(0, n_rows, per_file)]
        files = []
        stem = f"part-{job.index:05d}" if not s["global_packing"] else "part"
        for k, (r0, r1) in enumerate(ranges):
            if s["global_packing"]:
                name = f"part-{k:05d}-{job.job_hash[:10]}.arrow"
            elif len(ranges) == 1:
                name = f"{stem}-{job.job_hash[:10]}.arrow"
            else:
                name = f"{stem}-{k:03d}-{job.job_hash[:10]}.arrow"
            full = os.path.join(job.out_dir, name)
            size = write_packed_file(
                full, batch, plan, r0, r1, source_file=source_file,
                source_row=source_row, metadata={"packloader.job_hash": job.job_hash},
            )
            p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
            files.append({"name": name, "rows": r1 - r0, "tokens": int(plan.lengths[p0:p1].sum()),
                          "bytes": size, "checksum": file_checksum(full), "job": job.index})
        t4 = time.perf_counter()
        lost = int(lengths[plan.dropped_ids].sum()) + int((lengths[plan.truncated_ids] - cap).sum())
        report = PackingReport.from_lengths(
            lengths, cap, s["algorithm"], row_fills=plan.bin_lengths(),
            pieces_per_row=np.diff(plan.bin_offsets), split=plan.split_ids.size,
            truncated=plan.truncated_ids.size, dropped=plan.dropped_ids.size, lost_tokens=lost,
            overflow=s["overflow"], global_packing=s["global_packing"], sources=len(shards), files=len(files),
            read_seconds=(t1 - t0) + (t3 - t2), plan_seconds=t2 - t1, write_seconds=t4 - t3,
            total_seconds=t4 - t0,
        )
    finally:
        for sh in shards:
            sh.close()
    state = {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "done", "files": files,
             "report": report.to_dict()}
    _write_record(job, state)
    return state


def _write_record(job: _Job, record: dict) -> None:
    atomic_write_text(_state_path(job.out_dir, job.job_hash), json.dumps(record))


def _state_path(out_dir: str, job_hash: str) -> str:
    return os.path.join(out_dir, STATE_DIR, f"job-{job_hash[:24]}.json")


def _job_file_re(job_hash: str) -> re.Pattern:
    """Names of the files a job writes: ``part-<digits>[-<digits>]-<hash10>.arrow``."""
    return re.compile(rf"^part-\d+(?:-\d+)?-{re.escape(job_hash[:10])}\.arrow$")


def _finished_state(job: _Job) -> dict | None:
    """The state of an earlier identical run of ``job`` when all its files are intact, else None."""
    path = _state_path(job.out_dir, job.job_hash)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if state.get("job_hash") != job.job_hash or state.get("status", "done") != "done":
        return None
    for entry in state.get("files", []):
        p = os.path.join(job.out_dir, entry["name"])
        if not os.path.isfile(p) or os.path.getsize(p) != entry["bytes"]:
            return None
    return state


def _read_index_raw(out_dir: str) -> dict | None:
    """``index.json`` of ``out_dir`` when it is a packloader index (files not checked), else None."""
    try:
        with open(os.path.join(out_dir, INDEX_NAME), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("files"), list):
        return None
    return index


def _read_existing_index(out_dir: str) -> dict | None:
    index = _read_index_raw(out_dir)
    if index is None or index.get("version") != VERSION:
        return None
    for entry in index.get("files", []):
        p = os.path.join(out_dir, entry.get("name", ""))
        if not os.path.isfile(p) or os.path.getsize(p) != entry.get("bytes"):
            return None
    return index


def _recorded_jobs(out_dir: str) -> dict:
    """{record file name: job hash} of the job records in ``out_dir/.packloader``."""
    sdir = os.path.join(out_dir, STATE_DIR)
    out = {}
    if os.path.isdir(sdir):
        for name in os.listdir(sdir):
            if _JOB_RE.match(name):
                try:
                    with open(os.path.join(sdir, name), encoding="utf-8") as f:
                        h = json.load(f).get("job_hash")
                except (OSError, ValueError, AttributeError):
                    h = None
                out[name] = h if isinstance(h, str) and h.startswith(_JOB_RE.match(name).group(1)) else None
    return out


def _written_by_us(out_dir: str, old_index: dict | None) -> set:
    """Names of the files in ``out_dir`` that pack provably wrote: listed in its earlier index, or named
    after one of its recorded jobs."""
    names = set()
    if old_index is not None:
        names.update(e.get("name") for e in old_index.get("files", []) if isinstance(e, dict))
    pats = [_job_file_re(h) for h in _recorded_jobs(out_dir).values() if h]
    if pats:
        for name in os.listdir(out_dir):
            if any(p.match(name) for p in pats):
                names.add(name)
    return {n for n in names if isinstance(n, str) and os.path.basename(n) == n}


def _cleanup(out_dir: str, keep_files: set, keep_states: set, old_index: dict | None) -> None:
    """Remove what an earlier run wrote and the new index does not list: its part files (from the old
    index or named after a recorded job), then the job records, and temp files of dead processes.
    Files pack did not write are never touched. Safe to run again after a kill at any point."""
    for name in sorted(_written_by_us(out_dir, old_index) - keep_files):
        remove_file(os.path.join(out_dir, name))
    sdir = os.path.join(out_dir, STATE_DIR)
    for name in _recorded_jobs(out_dir):
        if name not in keep_states:
            remove_file(os.path.join(sdir, name))
    remove_stale_temps(out_dir)


# --------------------------------------------------------------------------------------------------
# the public function


def _check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def _check_sources_not_outputs(paths, out_dir: str, old_index: dict | None) -> None:
    """Refuse to read a file this directory's own packing wrote (it would be removed or replaced)."""
    real_out = os.path.realpath(out_dir)
    ours = None
    for p in paths:
        d = os.path.realpath(os.path.dirname(os.path.abspath(p)))
        if d == os.path.join(real_out, STATE_DIR) or d.startswith(os.path.join(real_out, STATE_DIR) + os.sep):
            raise DataError("source lies in the output directory's state folder", path=p)
        if d == real_out:
            if ours is None:
                ours = _written_by_us(out_dir, old_index)
            if os.path.basename(p) in ours:
                raise DataError("source is an output of this very pack directory (--out); pack into another "
                                "directory", path=p)


def _die_with_parent(parent_pid: int) -> None:
    """Worker initializer: exit when the parent process dies (also by SIGKILL), so a killed ``pack``
    leaves no worker behind. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; everywhere: a thread that
    polls the parent's pid once a second."""
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="packloader-parent-watch", daemon=True).start()


def pack_dataset(
    sources,
    out_dir,
    *,
    capacity: int = 4096,
    algorithm: str = "bfd",
    overflow: str = "error",
    token_column: str = "input_ids",
    labels_column: str | None = "labels",
    global_packing: bool = False,
    max_items_per_bin: int | None = None,
    buffer_size: int | None = None,
    seed: int | None = None,
    rows_per_file: int | None = None,
    allow_empty: bool = False,
    workers: int = 1,
    quiet: bool = False,
    progress: bool | None = None,
    allow_nonempty: bool = False,
    vocab_size: int | None = None,
) -> PackingReport:
    """Pack token shards into fixed-capacity rows, written as Arrow IPC files plus ``index.json``.

    Args:
        sources: shard paths or patterns (globs, braces ``shard-{000..127}.tar``, directories); see
            :func:`packloader.sources.resolve_sources`.
        out_dir: the output directory (created if needed).
        capacity: tokens per packed row, at most :data:`packloader.prepacked.MAX_CAPACITY` (2**24).
            Default 4096.
        algorithm: ``"bfd"`` (default), ``"ffd"``, ``"first_fit"``, ``"next_fit"`` or ``"online"``
            (see :func:`packer_algos.pack`).
        overflow: sequences longer than ``capacity``: ``"error"`` (default; a DataError naming the file
            and row), ``"split"``, ``"truncate"`` or ``"drop"``.
        token_column: the token column / tar member stem. Default ``"input_ids"``.
        labels_column: the optional labels column / member (``-100`` = no loss); when a shard lacks it
            its labels are its tokens. None ignores labels.
        global_packing: pack all shards together (rows may mix shards; all tokens are held in memory
            at once) instead of shard by shard (default: independent, parallel, restartable jobs).
        max_items_per_bin: optional cap on sequences per row.
        buffer_size: the ``"online"`` algorithm's buffer.
        seed: tie-breaking seed for ``"bfd"`` / ``"ffd"``.
        rows_per_file: split a job's rows into files of at most this many rows (default: one file per
            shard; with ``global_packing``, as many files as shards).
        allow_empty: skip shards without tokens (no sequences, or only zero-length ones) instead of
            raising.
        workers: processes packing shards in parallel (per-shard packing only; an int >= 1). Default 1.
            Worker processes die with the calling process (a killed ``pack`` leaves none behind).
        quiet: print nothing.
        progress: True for a tqdm bar, False for log lines, None (default) for a bar on a terminal.
        allow_nonempty: write into a non-empty directory that ``pack`` did not create (its files are
            never overwritten or removed). Default False: such a directory is refused.
        vocab_size: optional; a token id ``>= vocab_size`` is a DataError naming the file and row.

    Returns:
        The :class:`~packloader.report.PackingReport` of the whole directory (also stored in
        ``index.json``).

    Raises:
        DataError: bad input (missing column, wrong type, empty shard, corrupt file, negative ids, a
            sequence longer than ``capacity`` with ``overflow="error"``), naming the file and row; an
            output directory that is not empty and was not written by ``pack`` (see
            ``allow_nonempty``); a source that is an output of ``out_dir`` itself. A finished directory
            in ``out_dir`` is left intact.
        ValueError: bad settings (naming the argument).

    Example::

        >>> rep = pack_dataset("tok/*.arrow", "packed", capacity=2048, algorithm="bfd")  # doctest: +SKIP
        >>> rep.efficiency                                                             # doctest: +SKIP
        0.9987
    """
    t_start = time.perf_counter()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if overflow not in OVERFLOW:
        raise ValueError(f"unknown overflow policy {overflow!r}; choose one of {OVERFLOW}")
    capacity = check_capacity(capacity)
    _check_int("rows_per_file", rows_per_file, 1, optional=True)
    _check_int("workers", workers, 1)
    _check_int("seed", seed, 0, optional=True)
    _check_int("max_items_per_bin", max_items_per_bin, 1, optional=True)
    _check_int("buffer_size", buffer_size, 1, optional=True)
    _check_int("vocab_size", vocab_size, 1, optional=True)
    paths = resolve_sources(sources)
    out_dir = os.fspath(out_dir)
    settings = {
        "capacity": int(capacity), "algorithm": algorithm, "overflow": overflow, "token_column": token_column,
        "labels_column": labels_column, "global_packing": bool(global_packing),
        "max_items_per_bin": max_items_per_bin, "buffer_size": buffer_size, "seed": seed,
        "rows_per_file": rows_per_file, "allow_empty": bool(allow_empty), "format_version": VERSION,
    }
    if vocab_size is not None:  # (absent otherwise: directories packed before keep their content hash)
        settings["vocab_size"] = int(vocab_size)
    digests = [source_digest(p) for p in paths]
    content_hash = _hash({"settings": settings, "sources": [[os.path.abspath(p), d] for p, d in zip(paths, digests)]})

    claim_output_dir(out_dir, "pack", allow_nonempty=allow_nonempty, reserved=(INDEX_NAME,))
    old_index = _read_index_raw(out_dir)
    _check_sources_not_outputs(paths, out_dir, old_index)
    existing = _read_existing_index(out_dir)
    if existing is not None and existing.get("content_hash") == content_hash and "report" in existing:
        # an earlier run may have been killed after its index swap, before its cleanup: finish that
        kept = {e["name"] for e in existing["files"]}
        kept_states = {os.path.basename(_state_path(out_dir, h)) for h in existing.get("job_hashes", [])}
        if "job_hashes" in existing:
            _cleanup(out_dir, kept, kept_states, None)
        log(f"{out_dir}: up to date (same inputs and settings); nothing to do", quiet=quiet)
        report = PackingReport.from_dict(existing["report"])
        report.reused_files = len(existing["files"])
        return report

    if global_packing:
        jobs = [_Job(0, paths, list(range(len(paths))), content_hash, out_dir, settings, rows_per_file,
                     allow_empty)]
    else:
        jobs = [
            _Job(i, [p], [i], _hash({"settings": settings, "i": i, "path": os.path.abspath(p), "digest": d}),
                 out_dir, settings, rows_per_file, allow_empty)
            for i, (p, d) in enumerate(zip(paths, digests))
        ]

    states: dict[int, dict] = {}
    todo = []
    for job in jobs:
        st = _finished_state(job)
        if st is not None:
            states[job.index] = st
        else:
            todo.append(job)
    bar = Progress(len(jobs), f"packing {len(paths)} shard(s) -> {out_dir}", "job", quiet=quiet, bar=progress)
    if states:
        bar.update(len(states), note=f"{len(states)} finished earlier, skipped")

    def done(st):
        r = st["report"]
        bar.update(1, note=f"{os.path.basename(st['paths'][0])}{'...' if len(st['paths']) > 1 else ''}: "
                           f"{r['rows']:,} rows, {100 * r['efficiency']:.2f} % full")

    try:
        if workers > 1 and len(todo) > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=mp.get_context("spawn"),
                                     initializer=_die_with_parent, initargs=(os.getpid(),)) as ex:
                for job, st in zip(todo, ex.map(_run_job, todo)):
                    states[job.index] = st
                    done(st)
        else:
            for job in todo:
                st = _run_job(job)
                states[job.index] = st
                done(st)
    finally:
        bar.close()

    ordered = [states[j.index] for j in jobs]
    files = [f for st in ordered for f in st["files"]]
    reused = sum(len(states[j.index]["files"]) for j in jobs if j not in todo)
    parts = [PackingReport.from_dict(st["report"]) for st in ordered]
    report = PackingReport.combine(
        parts, algorithm=algorithm, overflow=overflow, global_packing=bool(global_packing),
        sources=len(paths), files=len(files), total_seconds=time.perf_counter() - t_start, reused_files=reused,
    ) if parts else PackingReport(capacity=int(capacity), algorithm=algorithm)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "capacity": int(capacity),
        "algorithm": algorithm,
        "overflow": overflow,
        "global_packing": bool(global_packing),
        "token_column": token_column,
        "labels_column": labels_column,
        "settings": settings,
        "files": files,
        "sources": [os.path.abspath(p) for p in paths],
        "source_paths": "absolute",  # resolved at pack time (before: as given, relative to pack's directory)
        "source_digests": digests,
        "content_hash": content_hash,
        "job_hashes": [j.job_hash for j in jobs],
        "total_rows": int(sum(f["rows"] for f in files)),
        "total_tokens": int(sum(f["tokens"] for f in files)),
        "total_sequences": report.sequences,
        "total_pieces": report.pieces,
        "ignore_index": IGNORE_INDEX,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "report": report.to_dict(),
    }
    atomic_write_text(os.path.join(out_dir, INDEX_NAME), json.dumps(index, indent=1))  # the commit point
    _cleanup(out_dir, {f["name"] for f in files},
             {os.path.basename(_state_path(out_dir, j.job_hash)) for j in jobs}, old_index)
    log(f"{out_dir}: {report.rows:,} rows in {len(files)} file(s), efficiency {100 * report.efficiency:.2f} %, "
        f"{report.total_seconds:.2f} s", quiet=quiet)
    return report
