"""What ``packloader pack`` owns in its output directory: its index, its job records, the files it
provably wrote, and the cleanup of everything else it wrote (see :mod:`packloader.pack_writer`, stage 4, and
:mod:`packloader._outdir` for the rules every tool follows)."""
from __future__ import annotations

import json
import os
import re

from packloader._outdir import STATE_DIR, remove_file, remove_stale_temps
from packloader.errors import DataError
from packloader.prepacked import FORMAT, INDEX_NAME, VERSION

__all__ = ["state_path", "job_file_re", "read_index_raw", "read_existing_index", "recorded_jobs", "written_by_us",
           "cleanup", "check_sources_not_outputs"]

#: a job's record in STATE_DIR
_JOB_RE = re.compile(r"^job-([0-9a-f]{24})\.json$")


def state_path(out_dir: str, job_hash: str) -> str:
    return os.path.join(out_dir, STATE_DIR, f"job-{job_hash[:24]}.json")


def job_file_re(job_hash: str) -> re.Pattern:
    """Names of the files a job writes: ``part-<digits>[-<digits>]-<hash10>.arrow``."""
    return re.compile(rf"^part-\d+(?:-\d+)?-{re.escape(job_hash[:10])}\.arrow$")


def read_index_raw(out_dir: str) -> dict | None:
    """``index.json`` of ``out_dir`` when it is a packloader index (files not checked), else None."""
    try:
        with open(os.path.join(out_dir, INDEX_NAME), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("files"), list):
        return None
    return index


def read_existing_index(out_dir: str) -> dict | None:
    index = read_index_raw(out_dir)
    if index is None or index.get("version") != VERSION:
        return None
    for entry in index.get("files", []):
        p = os.path.join(out_dir, entry.get("name", ""))
        if not os.path.isfile(p) or os.path.getsize(p) != entry.get("bytes"):
            return None
    return index


def recorded_jobs(out_dir: str) -> dict:
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


def written_by_us(out_dir: str, old_index: dict | None) -> set:
    """Names of the files in ``out_dir`` that pack provably wrote: listed in its earlier index, or named
    after one of its recorded jobs."""
    names = set()
    if old_index is not None:
        names.update(e.get("name") for e in old_index.get("files", []) if isinstance(e, dict))
    pats = [job_file_re(h) for h in recorded_jobs(out_dir).values() if h]
    if pats:
        for name in os.listdir(out_dir):
            if any(p.match(name) for p in pats):
                names.add(name)
    return {n for n in names if isinstance(n, str) and os.path.basename(n) == n}


def cleanup(out_dir: str, keep_files: set, keep_states: set, old_index: dict | None) -> None:
    """Remove what an earlier run wrote and the new index does not list: its part files (from the old
    index or named after a recorded job), then the job records, and temp files of dead processes.
    Files pack did not write are never touched. Safe to run again after a kill at any point."""
    for name in sorted(written_by_us(out_dir, old_index) - keep_files):
        remove_file(os.path.join(out_dir, name))
    sdir = os.path.join(out_dir, STATE_DIR)
    for name in recorded_jobs(out_dir):
        if name not in keep_states:
            remove_file(os.path.join(sdir, name))
    remove_stale_temps(out_dir)


def check_sources_not_outputs(paths, out_dir: str, old_index: dict | None) -> None:
    """Refuse to read a file this directory's own packing wrote (it would be removed or replaced)."""
    real_out = os.path.realpath(out_dir)
    ours = None
    for p in paths:
        d = os.path.realpath(os.path.dirname(os.path.abspath(p)))
        if d == os.path.join(real_out, STATE_DIR) or d.startswith(os.path.join(real_out, STATE_DIR) + os.sep):
            raise DataError("source lies in the output directory's state folder", path=p)
        if d == real_out:
            if ours is None:
                ours = written_by_us(out_dir, old_index)
            if os.path.basename(p) in ours:
                raise DataError("source is an output of this very pack directory (--out); pack into another "
                                "directory", path=p)
