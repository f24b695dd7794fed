"""Output directories written by packloader tools: ownership, temp files, atomic replacement, checksums.

One helper for every tool that writes files (``packloader pack``, ``packloader prepare``), so that all of
them follow the same rules:

* **Ownership.** A tool writes only into an empty (or new) directory, or into one it owns: one holding
  ``.packloader/owner.json`` naming the same tool (directories written by older versions are recognised
  by their ``.packloader/`` state or their ``prepare.json``). A non-empty directory it does not own is
  refused with a :class:`~packloader.errors.DataError` unless the caller passes ``allow_nonempty=True``
  (``--allow-nonempty``); even then no file the tool did not write is ever overwritten or removed, and a
  directory owned by the *other* tool is refused (its owner record is never rewritten).
* **One writer at a time.** A tool writes under the directory's lock (:mod:`packloader._dirlock`): a
  second run into the same directory fails at once, naming the first.
* **Manifest.** A tool removes only files it can prove it wrote: names listed in its own manifest
  (``index.json`` / ``prepare.json``) or carrying the id of one of its recorded jobs.
* **Temp files** live in ``.packloader/tmp/`` as ``NAME.tmp-<pid>`` and are renamed into place
  (``os.replace``, atomic) once complete and flushed. Temp files of dead processes are removed by
  :func:`remove_stale_temps`; nothing outside ``.packloader/tmp/`` is touched by it.
* **Checksums.** :func:`file_checksum` is the per-file checksum recorded at write time (``crc32`` of the
  file's bytes: it catches any flipped bit or damaged block, and at about 1.5 GB/s it is the fastest
  check the standard library offers; it is not meant against deliberate tampering). A writer computes it
  on the bytes as it writes them (:class:`ChecksumFile`), so recording it costs no second read of the
  file; :func:`file_checksum` reads a file back to verify it.
* **Durability.** Small files (manifests, job records, the owner file) are flushed to disk (``fsync``)
  before they are renamed into place; large data files are not by default (``atomic_path(fsync=False)``):
  after a power loss a data file may be incomplete, which its size and checksum in the manifest reveal.

Layout::

    out/
      .packloader/owner.json        {"tool": "pack" | "prepare", "owner_format": 1}
      .packloader/tmp/NAME.tmp-PID  files being written
      .packloader/...               the tool's own state (job records)
      ...                           the tool's outputs and its manifest
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import zlib

from packloader.errors import DataError

__all__ = [
    "STATE_DIR", "check_output_dir", "claim_output_dir", "owner_of", "temp_path", "atomic_path", "atomic_write_text",
    "fsync_file",
    "fsync_dir",
    "remove_stale_temps", "remove_file", "file_checksum", "ChecksumFile", "pid_alive", "CHECKSUM_ALGO",
]

STATE_DIR = ".packloader"
OWNER_NAME = "owner.json"
TMP_DIR = "tmp"
CHECKSUM_ALGO = "crc32"
_TMP_RE = re.compile(r"\.tmp-(\d+)$")
_LEGACY_MARKERS = {"pack": None, "prepare": "prepare.json"}


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists and runs: a killed process its parent has not reaped yet (a
    zombie, which ``kill(pid, 0)`` still reaches) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(pid)
    return stat is None or stat[0] not in ("Z", "X")


def _proc_stat(pid: int):
    """(state letter, start time in seconds since the epoch) of ``pid`` from Linux's ``/proc``, or None
    where it cannot be read (another system, or the process just ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # after the command name, which may hold spaces
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return fields[0], btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


#: a process that started this much later than a temp file was last written did not write it (its pid was
#: reused); the slack covers /proc's one-second boot time and clock steps
_PID_REUSE_SLACK_S = 5.0


def _writer_alive(pid: int, path: str) -> bool:
    """Whether the process that wrote temp file ``path`` (named after ``pid``) may still be writing it."""
    if not pid_alive(pid):
        return False
    stat = _proc_stat(pid)
    try:
        written = os.stat(path).st_mtime
    except OSError:
        return False
    return stat is None or stat[1] <= written + _PID_REUSE_SLACK_S


def remove_file(path: str) -> None:
    """Remove ``path``; a missing file is fine."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def owner_of(out_dir) -> str | None:
    """The tool that owns ``out_dir`` (``"pack"``, ``"prepare"``), or None."""
    out_dir = os.fspath(out_dir)
    try:
        with open(os.path.join(out_dir, STATE_DIR, OWNER_NAME), encoding="utf-8") as f:
            tool = json.load(f).get("tool")
        return tool if isinstance(tool, str) else None
    except (OSError, ValueError, AttributeError):
        pass
    # directories written before owner.json existed
    sdir = os.path.join(out_dir, STATE_DIR)
    if os.path.isdir(sdir) and any(n.startswith("job-") for n in os.listdir(sdir)):
        return "pack"
    if os.path.isfile(os.path.join(out_dir, "prepare.json")):
        try:
            with open(os.path.join(out_dir, "prepare.json"), encoding="utf-8") as f:
                if "settings_key" in json.load(f):
                    return "prepare"
        except (OSError, ValueError, TypeError):
            pass
    return None


def check_output_dir(out_dir, tool: str, *, allow_nonempty: bool = False, reserved=()) -> bool:
    """Whether ``tool`` may write into ``out_dir`` (the checks of :func:`claim_output_dir`, writing
    nothing); returns True when the directory is already ``tool``'s (no owner record to write).

    Raises:
        DataError: as :func:`claim_output_dir`.
    """
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError("output path exists and is not a directory", path=out_dir)
    if not os.path.isdir(out_dir):
        return False
    owner = owner_of(out_dir)
    if owner == tool:
        return True
    if owner is not None:
        # never rewrite another tool's marker, even with allow_nonempty: the directory would then be
        # maintained by neither tool (each removes only what its own manifest and records list)
        raise DataError(f"output directory belongs to 'packloader {owner}' (its {STATE_DIR}/{OWNER_NAME} says "
                        f"so), not 'packloader {tool}'; --allow-nonempty writes beside foreign files but never "
                        f"into another packloader tool's directory, whose state and cleanup would clash with "
                        f"this tool's; choose another directory", path=out_dir)
    foreign = [n for n in os.listdir(out_dir) if n != STATE_DIR]
    clash = sorted(set(foreign) & set(reserved))
    if clash:
        raise DataError(f"output directory holds a {clash[0]!r} that 'packloader {tool}' did not write; "
                        "choose another directory", path=out_dir)
    if foreign and not allow_nonempty:
        shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DataError(f"output directory is not empty ({len(foreign)} entries: {shown}) and was not "
                        f"written by 'packloader {tool}'; choose an empty directory, or pass "
                        "allow_nonempty=True (--allow-nonempty) to write beside those files (they are "
                        "never overwritten or removed)", path=out_dir)
    return False


def claim_output_dir(out_dir, tool: str, *, allow_nonempty: bool = False, reserved=()) -> str:
    """Make ``out_dir`` the output directory of ``tool``: create it if needed and record the owner.

    A writing tool calls it under the directory's lock (:func:`packloader._dirlock.claimed_output_dir`).

    Args:
        out_dir: the directory.
        tool: ``"pack"`` or ``"prepare"``.
        allow_nonempty: accept a non-empty directory that no packloader tool owns (its files are left
            alone). A directory owned by the other tool is refused even so: its owner record is never
            rewritten.
        reserved: names the tool must write itself (its manifest): a foreign file of such a name is
            refused even with ``allow_nonempty``.

    Returns:
        ``out_dir`` as a str.

    Raises:
        DataError: ``out_dir`` is a file, a directory owned by another packloader tool, or a non-empty
            directory not owned by ``tool`` and ``allow_nonempty`` is False (the message says how to
            proceed).
    """
    out_dir = os.fspath(out_dir)
    owned = check_output_dir(out_dir, tool, allow_nonempty=allow_nonempty, reserved=reserved)
    os.makedirs(os.path.join(out_dir, STATE_DIR), exist_ok=True)
    if not owned:
        atomic_write_text(os.path.join(out_dir, STATE_DIR, OWNER_NAME),
                          json.dumps({"tool": tool, "owner_format": 1}))
    return out_dir


def temp_path(path, *, beside: bool = False) -> str:
    """Where ``path`` is written before it is renamed into place: ``DIR/.packloader/tmp/NAME.tmp-PID``
    (a tool's output directory, where :func:`remove_stale_temps` finds it after a kill), or with
    ``beside=True`` the hidden ``DIR/.NAME.tmp-PID`` (a single file the user names, e.g. a plot)."""
    path = os.fspath(path)
    d, name = os.path.split(path)
    if beside:
        return os.path.join(d, f".{name}.tmp-{os.getpid()}")
    tdir = os.path.join(d, TMP_DIR) if os.path.basename(d) == STATE_DIR else os.path.join(d, STATE_DIR, TMP_DIR)
    os.makedirs(tdir, exist_ok=True)
    return os.path.join(tdir, f"{name}.tmp-{os.getpid()}")


def fsync_file(path) -> None:
    """Flush a written file's data to disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(d) -> None:
    """Flush a directory's entries (renames) to disk, where the platform allows it."""
    try:
        fd = os.open(os.fspath(d) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path, *, fsync: bool = True, beside: bool = False):
    """Write ``path`` atomically: yields a temp path to write (:func:`temp_path`); on success the temp
    file is flushed to disk (``fsync=True``) and renamed to ``path`` (``os.replace``); on any exception
    it is removed and ``path`` is untouched.

    This is packloader's one temp-file-and-rename helper; a tool that commits several files at once
    (``prepare``) stages them with :func:`temp_path`, flushes them with :func:`fsync_file` and renames
    them after writing its manifest.

    Args:
        path: the file to write.
        fsync: flush the file and its directory to disk (default). False for large data files whose
            manifest records their size and checksum (a torn file is detected, not prevented).
        beside: the temp file sits next to ``path`` (see :func:`temp_path`) instead of in the
            directory's ``.packloader/tmp/``.

    Example::

        >>> with atomic_path("out/part-00000.arrow") as tmp:       # doctest: +SKIP
        ...     write_something(tmp)
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temp_path(path, beside=beside)
    try:
        yield tmp
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_file(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path))


def atomic_write_text(path, text: str, *, beside: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably (see :func:`atomic_path`)."""
    with atomic_path(path, beside=beside) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def remove_stale_temps(out_dir) -> int:
    """Remove the temp files of dead processes under ``out_dir/.packloader/tmp``; returns how many. A
    process counts as dead once it has exited (a zombie too), and where its pid has since gone to a process
    started after the file's last write. The temp directory itself is removed when it ends up empty."""
    tdir = os.path.join(os.fspath(out_dir), STATE_DIR, TMP_DIR)
    if not os.path.isdir(tdir):
        return 0
    n = 0
    for name in os.listdir(tdir):
        m = _TMP_RE.search(name)
        path = os.path.join(tdir, name)
        if m is None or int(m.group(1)) == os.getpid() or not _writer_alive(int(m.group(1)), path):
            remove_file(path)
            n += 1
    try:
        os.rmdir(tdir)
    except OSError:
        pass
    return n


def _format_checksum(crc: int) -> str:
    return f"{CHECKSUM_ALGO}:{crc:08x}"


#: writes at least this large are checksummed on a second thread while they are written
_PARALLEL_CRC_BYTES = 1 << 20
_CRC_THREAD = None


def _crc_thread():
    global _CRC_THREAD
    if _CRC_THREAD is None or getattr(_CRC_THREAD, "_pid", None) != os.getpid():  # (not a fork's copy)
        from concurrent.futures import ThreadPoolExecutor

        _CRC_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packloader-crc32")
        _CRC_THREAD._pid = os.getpid()
    return _CRC_THREAD


class ChecksumFile:
    """A binary file opened for writing that checksums every byte written to it, in order: when it is
    closed, :attr:`checksum` equals :func:`file_checksum` of the file, without reading it again.

    It is a plain Python file object (``write``, ``flush``, ``close``), so pyarrow writes through it with
    ``pa.PythonFile(ChecksumFile(tmp), mode="w")``.

    Example::

        >>> with atomic_path("out/part.arrow") as tmp, ChecksumFile(tmp) as f:   # doctest: +SKIP
        ...     f.write(b"data")
        >>> f.checksum, f.size                                                   # doctest: +SKIP
        ('crc32:adf3f363', 4)
    """

    def __init__(self, path):
        self._file = open(path, "wb")
        self._crc = 0
        self.size = 0

    @property
    def closed(self) -> bool:
        return self._file.closed

    @property
    def checksum(self) -> str:
        """``"crc32:<8 hex digits>"`` of the bytes written so far."""
        return _format_checksum(self._crc)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _PARALLEL_CRC_BYTES:
            # zlib.crc32 releases the GIL: checksum on a second core while this one copies the bytes
            # into the file; both finish before returning (the caller may reuse its buffer afterwards)
            crc = _crc_thread().submit(zlib.crc32, view, self._crc)
            try:
                self._file.write(view)  # (a buffered file writes all of it or raises)
            finally:
                self._crc = crc.result()
        else:
            self._crc = zlib.crc32(view, self._crc)
            self._file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def writable(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def file_checksum(path, *, block: int = 8 << 20) -> str:
    """``"crc32:<8 hex digits>"`` of a file's bytes (the checksum recorded in ``index.json``)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return _format_checksum(crc)
