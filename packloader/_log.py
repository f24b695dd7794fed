"""Progress and log output: a tqdm bar on a terminal, plain log lines otherwise, nothing when quiet."""
from __future__ import annotations

import sys
import time


def log(msg: str, *, quiet: bool = False, stream=None) -> None:
    """Print one line to ``stream`` (default stderr) unless ``quiet``."""
    if quiet:
        return
    stream = stream or sys.stderr
    print(msg, file=stream, flush=True)


class Progress:
    """Progress over ``total`` units.

    Args:
        total: the number of units (e.g. shards).
        desc: a short label.
        unit: the unit's name.
        quiet: print nothing.
        bar: True for a tqdm bar, False for plain lines, None (default) for a bar exactly when
            ``stream`` is a terminal.
        stream: where to write (default stderr).

    Plain lines are printed at most every ``interval`` (2) seconds, and at the end.
    ``update(n, note)`` advances; ``write(msg)`` prints a line without breaking the bar; ``close()``
    ends it. Usable as a context manager.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", *, quiet: bool = False, bar: bool | None = None,
                 stream=None):
        self.total, self.desc, self.unit, self.quiet = int(total), desc, unit, quiet
        self.stream = stream or sys.stderr
        self.n = 0
        self._t0 = time.perf_counter()
        self._bar = None
        self._last = -1e9
        self.interval = 2.0
        if quiet:
            return
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.n += n
        if self.quiet:
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
        else:
            now = time.perf_counter()
            if now - self._last < self.interval and self.n < self.total:
                return
            self._last = now
            elapsed = now - self._t0
            tail = f" {note}" if note else ""
            log(f"{self.desc}: {self.n}/{self.total} {self.unit} ({elapsed:.1f} s){tail}", stream=self.stream)

    def write(self, msg: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        else:
            log(msg, stream=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
