"""Errors raised by packloader on bad input data.

:class:`DataError` is a :class:`ValueError` whose message names the file and, where it applies, the
row (sequence index inside the shard) or tar member that is wrong, so a user can find the bad record::

    >>> from packloader.errors import DataError
    >>> raise DataError("token column has a negative id (-3)", path="shard-007.arrow", row=1234)
    Traceback (most recent call last):
    ...
    packloader.errors.DataError: shard-007.arrow, row 1234: token column has a negative id (-3)
"""
from __future__ import annotations

import os

__all__ = ["DataError", "WorkerError"]


class DataError(ValueError):
    """Bad input data: a missing column, a wrong type, a corrupt file, an over-long sequence, ...

    Args:
        message: what is wrong.
        path: the file concerned (str or path-like), or None.
        row: the 0-based sequence (row) index inside ``path``, or None.
        member: for tar shards, the member (or sample key) concerned, or None.

    The attributes ``path``, ``row`` and ``member`` keep the values given, and ``reason`` the bare
    message; ``str(err)`` prefixes the location: ``"FILE, row R: message"``.
    """

    def __init__(self, message: str, *, path=None, row: int | None = None, member: str | None = None):
        self.reason = message
        self.path = os.fspath(path) if path is not None else None
        # a file name that is not valid UTF-8 (surrogate escapes) is shown with backslash escapes
        shown = None if self.path is None else _printable(self.path)
        self.row = None if row is None else int(row)
        self.member = member
        where = []
        if shown is not None:
            where.append(shown)
        if self.member is not None:
            where.append(f"member {self.member!r}")
        if self.row is not None:
            where.append(f"row {self.row}")
        text = f"{', '.join(where)}: {message}" if where else message
        super().__init__(text)

    def __reduce__(self):  # keep the keyword arguments through pickling (multiprocessing workers)
        return (_rebuild, (self.reason, self.path, self.row, self.member))


def _rebuild(reason, path, row, member):
    return DataError(reason, path=path, row=row, member=member)


def _printable(path: str) -> str:
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class WorkerError(RuntimeError):
    """A :class:`~packloader.PackedDataLoader` worker process died or stopped answering.

    The message names the worker (its number and pid) and what happened to it (the signal that killed
    or stopped it, or its exit status). The loader's :meth:`~packloader.PackedDataLoader.state_dict`
    still counts exactly the batches handed out, so a fresh loader given that state continues exactly.

    Attributes:
        worker: the worker number (0-based), or None.
        pid: its process id, or None.
        signal: the signal name (``"SIGKILL"``, ``"SIGSTOP"``, ...), or None.
    """

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 signal: str | None = None):
        super().__init__(message)
        self.worker, self.pid, self.signal = worker, pid, signal
