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

What ``pack`` may remove (see :mod:`packloader._outdir`; the bookkeeping lives in :mod:`packloader._packdir`): only files it provably wrote, i.e. files listed
in its own earlier ``index.json`` or named after one of its recorded jobs
(``part-<digits>-<job hash>.arrow``), and its temp files. It writes only into an empty directory or one it
owns, unless ``allow_nonempty=True``; even then other files are never overwritten or removed. Every
cleanup, including the one a killed run missed, runs again on the next run, also when the directory is
already up to date.

Size: about 790 lines, over the ~500 of one concept. The writer's parts form one pipeline: placing rows and
writing Arrow files; the restartable jobs that both engines run (per shard, and the parts of a global plan, with
their records); :func:`run_tasks`; and ``pack_dataset`` with its argument checks and documentation. The
output-directory bookkeeping lives in :mod:`packloader._packdir` and the Ray side in :mod:`packloader.ray_engine`.
The jobs are the next candidate for a module of their own; tests patch them here, so they have not moved yet.

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
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from packloader._log import Progress, log
import packloader._numba  # noqa: F401  (first: Numba's cache fallback, before packer_algos compiles)

from packer_algos import ALGORITHMS  # isort: skip
from packer_algos import OVERFLOW_POLICIES as OVERFLOW  # isort: skip
from packer_algos import PackPlan  # isort: skip
from packloader._dirlock import claimed_output_dir
from packloader._outdir import ChecksumFile, atomic_path, atomic_write_text
from packloader.batch import IGNORE_INDEX
from packloader._packdir import (check_sources_not_outputs, cleanup, read_existing_index, read_index_raw,
                                state_path)
from packloader.errors import DataError
from packloader.place import place_pieces, row_layout
from packloader.prepacked import FORMAT, INDEX_NAME, VERSION, check_capacity, check_fits, packed_schema
from packloader.report import PackingReport
from packloader.sources import SequenceBatch, concat_batches, open_shard, resolve_sources
from packloader.sources import uri as _uri

__all__ = ["pack_dataset", "run_tasks", "ENGINES", "scatter_rows", "write_packed_file", "source_digest", "ALGORITHMS",
           "OVERFLOW"]

#: where pack's tasks run (see :func:`run_tasks`)
ENGINES = ("local", "ray")
#: bytes of input_ids per Arrow record batch written (labels take as much again)
RECORD_BATCH_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------------
# rows of a plan (tokens placed by packloader.place)


def scatter_rows(batch: SequenceBatch, plan, b0: int = 0, b1: int | None = None, out=None):
    """Fill rows ``[b0, b1)`` of ``plan`` with the tokens of ``batch`` (:func:`packloader.place.place_pieces`).

    Args:
        batch: all sequences the plan's ``item_ids`` index (``item_ids[p]`` is sequence ``p`` of the
            batch).
        plan: a :class:`packer_algos.PackPlan`.
        b0, b1: the row range (default: all rows).
        out: optional ``(ids, labels)`` int32 buffers of at least ``(b1 - b0) * capacity`` elements to
            fill (reused from call to call by :func:`write_packed_file`: fresh memory costs a page fault
            per 4 KiB); default: new arrays.

    Returns:
        ``(input_ids, labels)``: int32 ``[(b1 - b0) * capacity]`` flat arrays (views of ``out`` when
        given); padding is 0 in ``input_ids``; ``labels`` are the batch's labels (or its tokens), with
        ``IGNORE_INDEX`` at each piece's first position and on padding.
    """
    b1 = plan.n_bins if b1 is None else b1
    cap = plan.capacity
    n = (b1 - b0) * cap
    if out is None:
        out_ids = np.empty(n, np.int32)
        out_lab = np.empty(n, np.int32)
    else:
        out_ids, out_lab = out[0][:n], out[1][:n]
        if out_ids.dtype != np.int32 or out_lab.dtype != np.int32 or out_ids.size < n or out_lab.size < n:
            raise ValueError(f"scatter_rows: out must be two int32 arrays of >= {n} elements")
    p0, p1 = int(plan.bin_offsets[b0]), int(plan.bin_offsets[b1])
    length = plan.lengths[p0:p1]
    dst_row, dst_col, fill = row_layout(plan.bin_offsets[b0:b1 + 1], length)
    src_start = np.asarray(batch.offsets, np.int64)[plan.item_ids[p0:p1]] + plan.starts[p0:p1]
    tokens = np.ascontiguousarray(batch.tokens, dtype=np.int32)
    labels = None if batch.labels is None else np.ascontiguousarray(batch.labels, dtype=np.int32)
    place_pieces(tokens, labels, src_start, length, dst_row, dst_col, out_ids.reshape(b1 - b0, cap),
                 out_lab.reshape(b1 - b0, cap), mask_starts=True, pad_from=fill)
    return out_ids, out_lab


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()),
                                    pa.array(values, type=value_type))


def write_packed_file(path, batch: SequenceBatch, plan, b0: int, b1: int, *, source_file: np.ndarray,
                      source_row: np.ndarray, metadata: dict | None = None) -> tuple[int, str]:
    """Write rows ``[b0, b1)`` of ``plan`` as one uncompressed Arrow IPC file, atomically.

    The file is written as ``DIR/.packloader/tmp/NAME.tmp-<pid>`` and renamed to ``path`` once complete
    (:func:`packloader._outdir.atomic_path`; not fsynced: its size and checksum in ``index.json`` reveal
    a file torn by a power loss). Its checksum is computed on the bytes as they are written
    (:class:`packloader._outdir.ChecksumFile`), not by reading the file back.

    Args:
        path: destination.
        batch: the sequences ``plan`` indexes (see :func:`scatter_rows`).
        plan: the :class:`packer_algos.PackPlan`.
        b0, b1: the rows to write.
        source_file: int32 per sequence of ``batch``: its index in the index's ``sources``.
        source_row: int64 per sequence of ``batch``: its row in that source file.
        metadata: optional str -> str schema metadata.

    Returns:
        ``(size, checksum)``: the file's size in bytes and its ``"crc32:<hex>"`` checksum (as
        :func:`packloader._outdir.file_checksum` would compute it).
    """
    cap = plan.capacity
    schema = packed_schema(cap)
    if metadata:
        schema = schema.with_metadata({str(k): str(v) for k, v in metadata.items()})
    step = max(1, RECORD_BATCH_BYTES // (4 * cap))
    path = os.fspath(path)
    buffers = (np.empty(min(step, max(0, b1 - b0)) * cap, np.int32),
               np.empty(min(step, max(0, b1 - b0)) * cap, np.int32))
    with atomic_path(path, fsync=False) as tmp:  # (its size and checksum in index.json reveal a torn file)
        with ChecksumFile(tmp) as raw, pa.PythonFile(raw, mode="w") as sink, \
                pa.ipc.new_file(sink, schema) as writer:
            for r0 in range(b0, b1, step):
                r1 = min(b1, r0 + step)
                # (the buffers are reused: write_batch has copied the previous batch into the file)
                ids, lab = scatter_rows(batch, plan, r0, r1, out=buffers)
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
                del cols, ids, lab
        size = os.path.getsize(tmp)
        if size != raw.size:
            raise OSError(f"{path}: wrote {raw.size} bytes but the file holds {size}")
    return size, raw.checksum


# --------------------------------------------------------------------------------------------------
# hashing, atomic files


def source_digest(path) -> str:
    """A cheap content digest of a file: size, mtime and a blake2b of sampled 64 KiB blocks (all of a
    file up to 1 MiB; else the first, the last and 14 blocks in between: 1 MiB read per file, so hashing
    costs little next to packing). An object named by URI: :func:`packloader.sources.uri.object_digest`
    (size, mtime, its first and last 64 KiB: two round trips)."""
    if _uri.is_uri(path):
        return _uri.object_digest(path)
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


def _source_digests(paths: list) -> list:
    """:func:`source_digest` of every source; objects named by URI in 16 threads (one round trip each)."""
    if not any(_uri.is_uri(p) for p in paths):
        return [source_digest(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=16) as ex:
        return list(ex.map(source_digest, paths))


def _source_id(path: str) -> str:
    """How a source is named in the index and the hashes: its absolute path, or its URI."""
    return path if _uri.is_uri(path) else os.path.abspath(path)


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
    digests: list = field(default_factory=list)  # the driver's source_digest of each of ``paths``


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


def _read_lengths(job: _Job, shards) -> tuple[np.ndarray, np.ndarray]:
    """All sequence lengths of ``shards`` (after :func:`_check_shard`), and ``row_base`` (int64
    ``[len(shards) + 1]``: the first sequence number of each shard in the concatenated lengths)."""
    lengths_list = [_check_shard(sh, job.settings, job.allow_empty) for sh in shards]
    lengths = np.concatenate(lengths_list) if lengths_list else np.zeros(0, np.int64)
    row_base = np.zeros(len(shards) + 1, np.int64)
    np.cumsum([len(x) for x in lengths_list], out=row_base[1:])
    return lengths, row_base


def _make_plan(lengths: np.ndarray, s: dict):
    from packer_algos import pack

    return pack(lengths, s["capacity"], s["algorithm"], overflow=s["overflow"],
                max_items_per_bin=s["max_items_per_bin"], buffer_size=s["buffer_size"], seed=s["seed"])


def _job_report(job: _Job, lengths, plan, n_files: int, **seconds) -> PackingReport:
    s = job.settings
    cap = s["capacity"]
    lost = int(lengths[plan.dropped_ids].sum()) + int((lengths[plan.truncated_ids] - cap).sum())
    return PackingReport.from_lengths(
        lengths, cap, s["algorithm"], row_fills=plan.bin_lengths(),
        pieces_per_row=np.diff(plan.bin_offsets), split=plan.split_ids.size,
        truncated=plan.truncated_ids.size, dropped=plan.dropped_ids.size, lost_tokens=lost,
        overflow=s["overflow"], global_packing=s["global_packing"], sources=len(job.paths), files=n_files,
        **seconds,
    )


def _file_entry(name: str, plan, r0: int, r1: int, size: int, checksum: str, job_index: int) -> dict:
    p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
    return {"name": name, "rows": r1 - r0, "tokens": int(plan.lengths[p0:p1].sum()), "bytes": size,
            "checksum": checksum, "job": job_index}


def _open_shards(paths, s: dict) -> list:
    shards = []
    try:
        for p in paths:
            shards.append(open_shard(p, s["token_column"], s["labels_column"], vocab_size=s.get("vocab_size")))
    except BaseException:
        for sh in shards:
            sh.close()
        raise
    return shards


def _check_objects_unchanged(job: _Job, which=None) -> None:
    """After reading shards named by URI (``which``: their numbers in ``job.paths``; default all): each
    object is still the one the driver fingerprinted, so the bytes read are those the index's digest
    names (an object replaced in the bucket mid-run is an error, not a silent mix). Local files: not
    checked (their digest costs a 1 MiB read)."""
    for i in range(len(job.paths)) if which is None else which:
        p = job.paths[i]
        if _uri.is_uri(p) and i < len(job.digests) and source_digest(p) != job.digests[i]:
            raise DataError("the object changed while pack was running (its size, modification time or "
                            "content differs from when pack listed it); run pack again", path=p)


def _run_job(job: _Job) -> dict:
    """Pack one shard (a per-shard job); returns its state dict (files + report), also written as its
    record. The unit of work of both engines (a process-pool worker, a Ray task, or inline)."""
    s = job.settings
    t0 = time.perf_counter()
    _write_record(job, {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "writing"})
    shards = _open_shards(job.paths, s)
    try:
        lengths, _ = _read_lengths(job, shards)
        t1 = time.perf_counter()
        plan = _make_plan(lengths, s)
        t2 = time.perf_counter()
        batch = shards[0].read_all()  # validates every token (negative ids, nulls, ...)
        _check_objects_unchanged(job)
        t3 = time.perf_counter()
        source_file = np.full(len(lengths), job.source_ids[0], np.int32)
        source_row = np.arange(len(lengths), dtype=np.int64)
        n_rows = plan.n_bins
        per_file = job.rows_per_file or max(1, n_rows)
        ranges = [(r, min(n_rows, r + per_file)) for r in range(0, n_rows, per_file)]
        files = []
        for k, (r0, r1) in enumerate(ranges):
            if len(ranges) == 1:
                name = f"part-{job.index:05d}-{job.job_hash[:10]}.arrow"
            else:
                name = f"part-{job.index:05d}-{k:03d}-{job.job_hash[:10]}.arrow"
            full = os.path.join(job.out_dir, name)
            size, checksum = write_packed_file(full, batch, plan, r0, r1, source_file=source_file,
                                               source_row=source_row, metadata={"packloader.job_hash": job.job_hash})
            files.append(_file_entry(name, plan, r0, r1, size, checksum, job.index))
        t4 = time.perf_counter()
        report = _job_report(job, lengths, plan, len(files), read_seconds=(t1 - t0) + (t3 - t2),
                             plan_seconds=t2 - t1, write_seconds=t4 - t3, total_seconds=t4 - t0)
    finally:
        for sh in shards:
            sh.close()
    state = {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "done", "files": files,
             "report": report.to_dict()}
    _write_record(job, state)
    return state


# --------------------------------------------------------------------------------------------------
# global packing: one plan made centrally from the lengths, its files written in parallel


@dataclass
class _Part:
    """One output file of a global job: rows ``[0, n_rows)`` of a slice of the central plan (its
    ``bin_offsets`` rebased to 0), with the global sequence numbers of its pieces. It has its own record
    (``part_hash``), so that a re-run skips the files already written."""
    index: int                 # file number k: part-<k:05d>-<job hash 10>.arrow
    part_hash: str
    job: _Job
    bin_offsets: np.ndarray
    item_ids: np.ndarray       # global sequence numbers (into the job's concatenated shards)
    starts: np.ndarray
    lengths: np.ndarray
    row_base: np.ndarray       # [n_shards + 1]: first global sequence number of each shard
    read_shards: list          # shard numbers this part reads (those its rows use, or validation only)

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}-{self.job.job_hash[:10]}.arrow"


def _part_hash(job_hash: str, k: int) -> str:
    return _hash({"job": job_hash, "file": k})


def _plan_global(job: _Job) -> tuple[list, dict]:
    """The driver's step of a global job: record it as "writing", read every shard's lengths, check
    them, make the plan, cut it into files. Returns ``(parts, info)`` (``info``: what
    :func:`_finish_global` needs for the report)."""
    s = job.settings
    t0 = time.perf_counter()
    _write_record(job, {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "writing"})
    shards = _open_shards(job.paths, s)
    try:
        lengths, row_base = _read_lengths(job, shards)
    finally:
        for sh in shards:
            sh.close()
    _check_objects_unchanged(job)
    t1 = time.perf_counter()
    plan = _make_plan(lengths, s)
    t2 = time.perf_counter()
    n_rows = plan.n_bins
    per_file = job.rows_per_file or max(1, -(-n_rows // max(1, len(job.paths))))
    parts = []
    for k, r0 in enumerate(range(0, n_rows, per_file)):
        r1 = min(n_rows, r0 + per_file)
        p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
        items = plan.item_ids[p0:p1]
        used = np.unique(np.searchsorted(row_base, items, side="right") - 1).tolist()
        parts.append(_Part(k, _part_hash(job.job_hash, k), job, plan.bin_offsets[r0:r1 + 1] - p0, items,
                           plan.starts[p0:p1], plan.lengths[p0:p1], row_base, used))
    # shards no row uses (all dropped, or empty) are still read once: every token is validated
    unread = sorted(set(range(len(job.paths))) - {i for p in parts for i in p.read_shards})
    if unread and parts:
        parts[-1].read_shards = sorted(parts[-1].read_shards + unread)
    info = {"lengths": lengths, "plan": plan, "read_seconds": t1 - t0, "plan_seconds": t2 - t1, "t0": t0}
    return parts, info


def _write_parts(parts: list) -> list:
    """Write a group of parts of one global job (skipping those already written); returns their states.
    The unit of work of both engines under global packing. Each shard the group needs is read once."""
    todo = [p for p in parts if _finished_record(p.job.out_dir, p.part_hash) is None]
    states = {}
    if todo:
        job = todo[0].job
        t0 = time.perf_counter()
        need = sorted({i for p in todo for i in p.read_shards})
        shards = _open_shards([job.paths[i] for i in need], job.settings)
        try:
            batches = [sh.read_all() for sh in shards]  # validates every token (negative ids, nulls, ...)
        finally:
            for sh in shards:
                sh.close()
        _check_objects_unchanged(job, need)
        nonempty = [b for b in batches if len(b)]
        batch = concat_batches(nonempty) if nonempty else batches[0]
        read_s = time.perf_counter() - t0
        counts = np.array([len(b) for b in batches], np.int64)
        local_base = np.full(len(job.paths), -1, np.int64)  # first local sequence number of a read shard
        local_base[need] = np.concatenate(([0], np.cumsum(counts)[:-1]))
        local_shard = np.repeat(np.asarray(need, np.int64), counts)
        row_base = todo[0].row_base
        source_file = np.asarray(job.source_ids, np.int32)[local_shard]
        source_row = np.arange(len(local_shard), dtype=np.int64) - local_base[local_shard]
        for p in todo:
            t1 = time.perf_counter()
            shard_of = np.searchsorted(row_base, p.item_ids, side="right") - 1
            local_ids = p.item_ids - row_base[shard_of] + local_base[shard_of]
            sub = PackPlan(job.settings["capacity"], p.bin_offsets, local_ids, p.starts, p.lengths)
            n = sub.n_bins
            full = os.path.join(job.out_dir, p.name)
            size, checksum = write_packed_file(full, batch, sub, 0, n, source_file=source_file,
                                               source_row=source_row, metadata={"packloader.job_hash": job.job_hash})
            state = {"job_hash": p.part_hash, "job": job.index, "part": p.index, "status": "done",
                     "files": [_file_entry(p.name, sub, 0, n, size, checksum, job.index)],
                     "read_seconds": read_s if p is todo[0] else 0.0,
                     "write_seconds": time.perf_counter() - t1}
            atomic_write_text(state_path(job.out_dir, p.part_hash), json.dumps(state))
            states[p.index] = state
    return [states.get(p.index) or _finished_record(p.job.out_dir, p.part_hash) for p in parts]


def _finish_global(job: _Job, info: dict, part_states: list) -> dict:
    """The driver's last step of a global job: its report and its "done" record."""
    files = [f for st in part_states for f in st["files"]]
    plan = info["plan"]
    report = _job_report(job, info["lengths"], plan, len(files),
                         read_seconds=info["read_seconds"] + sum(st.get("read_seconds", 0.0) for st in part_states),
                         plan_seconds=info["plan_seconds"],
                         write_seconds=sum(st.get("write_seconds", 0.0) for st in part_states),
                         total_seconds=time.perf_counter() - info["t0"])
    state = {"job_hash": job.job_hash, "job": job.index, "paths": job.paths, "status": "done", "files": files,
             "report": report.to_dict()}
    _write_record(job, state)
    return state


def _groups(items: list, n: int) -> list:
    """``items`` cut into ``n`` contiguous groups of near-equal size (fewer when there are fewer items)."""
    n = max(1, min(n, len(items)))
    bounds = [len(items) * g // n for g in range(n + 1)]
    return [items[bounds[g]:bounds[g + 1]] for g in range(n)]


def _write_record(job: _Job, record: dict) -> None:
    atomic_write_text(state_path(job.out_dir, job.job_hash), json.dumps(record))


def _finished_state(job: _Job) -> dict | None:
    """The state of an earlier identical run of ``job`` when all its files are intact, else None."""
    return _finished_record(job.out_dir, job.job_hash)


def _finished_record(out_dir: str, job_hash: str) -> dict | None:
    """The record ``job_hash`` (a job or a part of a global job) when it is "done" and all its files are
    intact, else None."""
    path = state_path(out_dir, job_hash)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("job_hash") != job_hash or state.get("status", "done") != "done":
        return None
    for entry in state.get("files", []):
        p = os.path.join(out_dir, entry["name"])
        if not os.path.isfile(p) or os.path.getsize(p) != entry["bytes"]:
            return None
    return state


# --------------------------------------------------------------------------------------------------
# the public function


def _check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")


def _local_out_dir(out_dir) -> str:
    """The output directory as a filesystem path (a ``file://`` URI is one); any other URI is refused
    with what to do instead: the commit protocol (temp file, atomic rename, ``index.json`` last) needs
    a filesystem, and object stores have no atomic rename."""
    out_dir = os.fspath(out_dir)
    if _uri.is_uri(out_dir):
        local = _uri.local_path(out_dir)
        if local is None:
            raise DataError("output directory is a URI; pack writes to a filesystem path only (local, or shared "
                            "by the nodes: NFS, Lustre, ...): pack there, then upload the finished directory "
                            "(index.json last); shards may be URIs; see docs/cluster.md", path=out_dir)
        return local
    return out_dir


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


def run_tasks(fn, tasks: list, *, engine: str = "local", workers: int = 1, on_done=None,
              ray_address: str | None = None, quiet: bool = True) -> list:
    """Run ``fn`` on every task, return the results in task order; ``on_done(result)`` is called in the
    calling process as each one finishes. The one place where pack's engines differ:

    * ``"local"``: inline (``workers == 1`` or one task) or a pool of ``workers`` spawned processes that
      die with the calling process;
    * ``"ray"``: Ray tasks, at most ``workers`` in flight (:mod:`packloader.ray_engine`).

    ``fn`` is a pure function of its task that writes its outputs atomically under deterministic names
    (:func:`_run_job`, :func:`_write_parts`), so either engine, any ``workers``, and any retry of a
    killed task write the same bytes.
    """
    if engine == "ray":
        from packloader.ray_engine import run_ray_tasks

        return run_ray_tasks(fn, tasks, workers=workers, address=ray_address, on_done=on_done, quiet=quiet)
    if engine != "local":
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    results = []
    if workers > 1 and len(tasks) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=mp.get_context("spawn"),
                                 initializer=_die_with_parent, initargs=(os.getpid(),)) as ex:
            for r in ex.map(fn, tasks):
                results.append(r)
                if on_done is not None:
                    on_done(r)
    else:
        for t in tasks:
            r = fn(t)
            results.append(r)
            if on_done is not None:
                on_done(r)
    return results


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
    engine: str = "local",
    ray_address: str | None = None,
) -> PackingReport:
    """Pack token shards into fixed-capacity rows, written as Arrow IPC files plus ``index.json``.

    Args:
        sources: shard paths or patterns (globs, braces ``shard-{000..127}.tar``, directories), or URIs
            read through pyarrow filesystems (``s3://bucket/tok/shard-{000..127}.arrow``, ``gs://...``;
            credentials from the filesystem's environment, on every worker); see
            :func:`packloader.sources.resolve_sources` and :mod:`packloader.sources.uri`.
        out_dir: the output directory (created if needed): a filesystem path (or ``file://`` URI); other
            URIs are refused (pack there, then upload the finished directory).
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
        workers: jobs run in parallel (an int >= 1; with ``global_packing``, groups of output files
            written in parallel from the one plan, each group holding the shards its rows use in
            memory). Default 1. Local worker processes die with the
            calling process (a killed ``pack`` leaves none behind); with ``engine="ray"``, the Ray tasks
            in flight at once (and the CPUs of the local Ray instance it starts, if any).
        quiet: print nothing.
        progress: True for a tqdm bar, False for log lines, None (default) for a bar on a terminal.
        allow_nonempty: write into a non-empty directory that ``pack`` did not create (its files are
            never overwritten or removed). Default False: such a directory is refused.
        vocab_size: optional; a token id ``>= vocab_size`` is a DataError naming the file and row.
        engine: ``"local"`` (default: this process, or a process pool) or ``"ray"`` (Ray tasks; needs
            ``pip install 'packloader[ray]'``; see :mod:`packloader.ray_engine`). Both run the same
            functions and write the same bytes.
        ray_address: the Ray cluster for ``engine="ray"`` (``"auto"``, ``"ray://host:10001"``, ...);
            default: the one ``ray.init`` already connected to, else ``$RAY_ADDRESS``, else a local Ray
            instance with ``workers`` CPUs, shut down at the end.

    Returns:
        The :class:`~packloader.report.PackingReport` of the whole directory (also stored in
        ``index.json``).

    Raises:
        DataError: bad input (missing column, wrong type, empty shard, corrupt file, negative ids, a
            sequence longer than ``capacity`` with ``overflow="error"``), naming the file and row; an
            output directory that is not empty and was not written by ``pack`` (see
            ``allow_nonempty``), or one owned by ``packloader prepare``; a source that is an output of
            ``out_dir`` itself; another run writing ``out_dir`` at the same time (the error names its
            host and pid: one writer at a time, see :mod:`packloader._dirlock`). A finished directory in
            ``out_dir`` is left intact.
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
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    out_dir = _local_out_dir(out_dir)
    paths = resolve_sources(sources)
    settings = {
        "capacity": int(capacity), "algorithm": algorithm, "overflow": overflow, "token_column": token_column,
        "labels_column": labels_column, "global_packing": bool(global_packing),
        "max_items_per_bin": max_items_per_bin, "buffer_size": buffer_size, "seed": seed,
        "rows_per_file": rows_per_file, "allow_empty": bool(allow_empty), "format_version": VERSION,
    }
    if vocab_size is not None:  # (absent otherwise: directories packed before keep their content hash)
        settings["vocab_size"] = int(vocab_size)
    digests = _source_digests(paths)
    content_hash = _hash({"settings": settings, "sources": [[_source_id(p), d] for p, d in zip(paths, digests)]})

    with claimed_output_dir(out_dir, "pack", allow_nonempty=allow_nonempty, reserved=(INDEX_NAME,),
                            quiet=quiet):  # one writer at a time (packloader._dirlock)
        old_index = read_index_raw(out_dir)
        check_sources_not_outputs([p for p in paths if not _uri.is_uri(p)], out_dir, old_index)
        existing = read_existing_index(out_dir)
        if existing is not None and existing.get("content_hash") == content_hash and "report" in existing:
            # an earlier run may have been killed after its index swap, before its cleanup: finish that
            kept = {e["name"] for e in existing["files"]}
            kept_states = {os.path.basename(state_path(out_dir, h)) for h in existing.get("job_hashes", [])}
            if "job_hashes" in existing:
                cleanup(out_dir, kept, kept_states, None)
            log(f"{out_dir}: up to date (same inputs and settings); nothing to do", quiet=quiet)
            report = PackingReport.from_dict(existing["report"])
            report.reused_files = len(existing["files"])
            return report

        if global_packing:
            jobs = [_Job(0, paths, list(range(len(paths))), content_hash, out_dir, settings, rows_per_file,
                         allow_empty, digests=digests)]
        else:
            jobs = [
                _Job(i, [p], [i], _hash({"settings": settings, "i": i, "path": _source_id(p), "digest": d}),
                     out_dir, settings, rows_per_file, allow_empty, digests=[d])
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
        part_hashes, reused_parts = [], 0
        if global_packing and todo:
            file_parts, info = _plan_global(todo[0])
            part_hashes = [p.part_hash for p in file_parts]
            reused_parts = sum(_finished_record(out_dir, h) is not None for h in part_hashes)
            tasks, fn, n_units = _groups(file_parts, workers), _write_parts, len(file_parts)
        else:
            tasks, fn, n_units = todo, _run_job, len(jobs)
            if global_packing:  # finished earlier: keep its parts' records
                part_hashes = [_part_hash(jobs[0].job_hash, k) for k in range(len(states[0]["files"]))]
        bar = Progress(n_units, f"packing {len(paths)} shard(s) -> {out_dir}", "job" if fn is _run_job else "file",
                       quiet=quiet, bar=progress)
        if states:
            bar.update(len(states), note=f"{len(states)} finished earlier, skipped")

        def done(result):
            if fn is _write_parts:
                bar.update(len(result), note=f"{result[-1]['files'][0]['name']} ({len(result)} file(s) of a group)")
                return
            r = result["report"]
            bar.update(1, note=f"{os.path.basename(result['paths'][0])}{'...' if len(result['paths']) > 1 else ''}: "
                               f"{r['rows']:,} rows, {100 * r['efficiency']:.2f} % full")

        try:
            results = run_tasks(fn, tasks, engine=engine, workers=workers, on_done=done, ray_address=ray_address,
                                quiet=quiet)
        finally:
            bar.close()
        if fn is _write_parts:
            states[0] = _finish_global(todo[0], info, [st for group in results for st in group])
        else:
            for job, st in zip(tasks, results):
                states[job.index] = st

        ordered = [states[j.index] for j in jobs]
        files = [f for st in ordered for f in st["files"]]
        reused = sum(len(states[j.index]["files"]) for j in jobs if j not in todo) + reused_parts
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
            "sources": [_source_id(p) for p in paths],
            # resolved at pack time (before: as given, relative to pack's directory); a shard read by URI: its URI
            "source_paths": "absolute",
            "source_digests": digests,
            "content_hash": content_hash,
            "job_hashes": [j.job_hash for j in jobs] + part_hashes,
            "total_rows": int(sum(f["rows"] for f in files)),
            "total_tokens": int(sum(f["tokens"] for f in files)),
            "total_sequences": report.sequences,
            "total_pieces": report.pieces,
            "ignore_index": IGNORE_INDEX,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "report": report.to_dict(),
        }
        atomic_write_text(os.path.join(out_dir, INDEX_NAME), json.dumps(index, indent=1))  # the commit point
        cleanup(out_dir, {f["name"] for f in files},
                {os.path.basename(state_path(out_dir, h)) for h in index["job_hashes"]}, old_index)
        log(f"{out_dir}: {report.rows:,} rows in {len(files)} file(s), efficiency {100 * report.efficiency:.2f} %, "
            f"{report.total_seconds:.2f} s", quiet=quiet)
        return report
