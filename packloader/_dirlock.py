"""One writer at a time per output directory: the lock ``packloader pack`` and ``packloader prepare`` hold
while they write (see :mod:`packloader._outdir` for the other rules every writing tool follows).

**The choice: a second run fails at once, with an error naming the first.** Two runs writing one
directory at once (two ranks of a job that both start the pre-pack step, two ``prepare`` commands with
other shard sizes) would each commit their own manifest and clean up after themselves, leaving files of
the other run behind or removing files the other's manifest lists. Waiting instead would hide the
mistake and, with other settings, silently replace the output the first run just finished (which the
first run's caller may already be reading). So the second run stops before it writes anything, and
says which process holds the directory; run the step on one process (e.g. rank 0, the others waiting
at a barrier), or give each run its own ``--out``.

The lock is ``DIR/.packloader/lock``, locked with ``flock`` (an advisory lock the kernel holds for the
open file: it is released when the process ends, however it ends, so a crashed run never blocks the
next one; on Linux NFS clients ``flock`` is a lock on the server, seen by every node). The file holds
its owner's tool, host, pid and start time, read by a second run for its error message. A run that
takes the lock and finds such a record left behind (its writer was killed before it removed the file)
says so, naming the dead run, and takes over (*stale-lock detection*: whether the lock is held is asked of
the kernel, never guessed from a pid, which another process may have reused). A finished run removes the
file while it still holds the lock; a run that locked a file which was removed meanwhile (it opened it
just before) sees that the path no longer names its file and tries again, so two runs can never both
hold the directory.

A filesystem without locks (``flock`` fails with ``ENOLCK`` / ``EOPNOTSUPP`` / ``ENOSYS``: some Lustre
mounts without ``-o flock``) cannot detect a second run: the tool says so once and goes on
(``docs/reliability.md``, known limits).

Example::

    >>> with output_dir_lock("packed/", "pack"):        # doctest: +SKIP
    ...     write_the_directory()
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time

from packloader._log import log
from packloader._outdir import STATE_DIR, check_output_dir, claim_output_dir, remove_file
from packloader.errors import DataError

__all__ = ["claimed_output_dir", "output_dir_lock", "lock_holder", "LOCK_NAME"]

LOCK_NAME = "lock"
#: flock errors that mean "this filesystem has no locks" (not "someone else holds it")
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _lock_path(out_dir: str) -> str:
    return os.path.join(out_dir, STATE_DIR, LOCK_NAME)


def _read_record(fd: int) -> dict | None:
    """The owner record in the open lock file ``fd``, or None (empty, unreadable)."""
    try:
        raw = os.pread(fd, 4096, 0)
        rec = json.loads(raw.decode("utf-8")) if raw else None
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def lock_holder(out_dir) -> dict | None:
    """The owner record of ``out_dir``'s lock file (``tool``, ``host``, ``pid``, ``started``), or None
    when there is none. The record alone does not say that its run is alive: see :func:`output_dir_lock`."""
    try:
        fd = os.open(_lock_path(os.fspath(out_dir)), os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _describe(rec: dict | None) -> str:
    if not rec:
        return "another process (it has not written its name yet)"
    return (f"'packloader {rec.get('tool', '?')}' (pid {rec.get('pid', '?')} on host {rec.get('host', '?')}, "
            f"started {rec.get('started', '?')})")


def _acquire(out_dir: str, tool: str, quiet: bool) -> int | None:
    """Lock ``out_dir``; returns the locked file's descriptor (None: no locks on this filesystem)."""
    import fcntl

    path = _lock_path(out_dir)
    for _ in range(1000):  # (another try only when a finishing run removed the file we opened)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_record(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise DataError(
                    f"output directory is in use by {_describe(holder)}: two runs cannot write one directory at "
                    f"once; wait for that run to finish, or give this one another output directory (the lock "
                    f"is {os.path.join(STATE_DIR, LOCK_NAME)}, held while a run writes; a process that ends "
                    "releases it)", path=out_dir) from None
            if e.errno in _NO_LOCKS:
                log(f"warning: {out_dir}: this filesystem does not support file locks ({os.strerror(e.errno)}): a "
                    f"second 'packloader' run writing this directory at the same time would not be detected",
                    quiet=quiet)
                return None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:  # a finishing run removed this file after we opened it: lock the current one
            os.close(fd)
            continue
        stale = _read_record(fd)
        if stale and stale.get("pid") != os.getpid():
            log(f"{out_dir}: the run that held this directory before, {_describe(stale)}, ended without releasing "
                "it (killed?); taking over, its leftovers are cleaned up", quiet=quiet)
        record = {"tool": tool, "host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        data = json.dumps(record).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return fd
    raise DataError("cannot take the output directory's lock (its lock file keeps being replaced)", path=out_dir)


@contextlib.contextmanager
def output_dir_lock(out_dir, tool: str, *, quiet: bool = False):
    """Hold ``out_dir``'s write lock (see the module docstring) for the ``with`` block.

    Args:
        out_dir: an existing output directory (its ``.packloader/`` is created if needed).
        tool: ``"pack"`` or ``"prepare"``, named in a second run's error.
        quiet: print nothing (the notes on a stale lock, on a filesystem without locks).

    Raises:
        DataError: another process holds the lock; the message names its tool, host, pid and start time.
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(os.path.join(out_dir, STATE_DIR), exist_ok=True)
    fd = _acquire(out_dir, tool, quiet)
    try:
        yield
    finally:
        if fd is not None:
            remove_file(_lock_path(out_dir))  # while still holding it (see _acquire)
            os.close(fd)


@contextlib.contextmanager
def claimed_output_dir(out_dir, tool: str, *, allow_nonempty: bool = False, reserved=(), quiet: bool = False):
    """``out_dir`` checked, locked and claimed for ``tool`` for the ``with`` block (yields it as a str):
    the ownership checks first (a refused directory gets no ``.packloader/``), then the lock
    (:func:`output_dir_lock`), then :func:`packloader._outdir.claim_output_dir` again under the lock.

    Raises:
        DataError: as :func:`packloader._outdir.claim_output_dir`, or another run holds the directory.
    """
    out_dir = os.fspath(out_dir)
    check_output_dir(out_dir, tool, allow_nonempty=allow_nonempty, reserved=reserved)
    os.makedirs(out_dir, exist_ok=True)
    with output_dir_lock(out_dir, tool, quiet=quiet):
        yield claim_output_dir(out_dir, tool, allow_nonempty=allow_nonempty, reserved=reserved)
