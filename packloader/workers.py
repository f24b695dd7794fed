"""The main-process side of the loader's iteration: batches counted as handed out, lost workers named.

:class:`LoaderIterator` wraps torch's DataLoader iterator: it collates each raw batch (the worker sends one
int32 buffer, :mod:`packloader.batch`), counts the batches handed to the training loop (what
:meth:`packloader.PackedDataLoader.state_dict` saves; prefetched batches are not consumed), and turns a
worker that died or stopped into one :class:`~packloader.errors.WorkerError` naming it
(:class:`WorkerWatch`).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from packloader.errors import WorkerError

__all__ = ["LoaderIterator", "WorkerWatch"]


class LoaderIterator:
    """Counts batches as they are handed to the training loop (prefetched ones are not consumed)."""

    def __init__(self, loader, it, epoch: int, start: int, n: int, gen: int):
        self._loader, self._it = loader, it
        self._epoch, self._pos, self._n, self._gen = epoch, start, n, gen
        workers = list(getattr(it, "_workers", None) or [])
        self._watch = WorkerWatch(workers, loader.timeout) if workers else None

    def __del__(self):
        if getattr(self, "_watch", None) is not None:
            self._watch.stop.set()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._n - self._pos

    def __next__(self) -> dict[str, Any]:
        watch = self._watch
        try:
            if watch is not None:
                watch.waiting_since = time.monotonic()
            batch = next(self._it)
        except StopIteration:
            if watch is not None:
                watch.stop.set()
            raise
        except Exception as e:
            for _ in range(20):
                try:
                    self._fail(e, watch)  # always raises
                except RuntimeError as again:
                    # torch's SIGCHLD handler raises asynchronously wherever the main thread is when a
                    # worker dies; here it only repeats what _fail is reporting: do it again
                    if type(again) is RuntimeError and again is not e and "DataLoader worker" in str(again):
                        continue
                    raise
            raise
        finally:
            if watch is not None:
                watch.waiting_since = None
        loader = self._loader
        batch = loader.dataset.collate(batch, loader.pin_memory)
        self._pos += 1
        if loader._iter_gen == self._gen and loader._epoch == self._epoch:
            loader._consumed = self._pos
        return batch

    def _fail(self, e: Exception, watch) -> None:
        """After ``next()`` of torch's iterator raised ``e``: stop the workers now (the epoch cannot go on;
        otherwise the traceback keeps torch's iterator alive until the cyclic garbage collector runs, and
        torch's worker shutdown run from there waits 5 s per worker), then raise one WorkerError naming
        a dead or stopped worker, or ``e`` itself."""
        transport = isinstance(e, (EOFError, ConnectionError)) or (
            type(e) is RuntimeError and ("DataLoader worker" in str(e) or "timed out" in str(e)))
        if not hasattr(self, "_fault"):  # (once: a retry must not see the workers the shutdown ended)
            # an exception raised by the worker's own code (torch re-raises it here: "Caught ... in DataLoader
            # worker process N") is the story; the other workers may be exiting by then (status 0) and must not
            # be reported instead of it. Only a lost worker (transport errors, timeouts) is looked for.
            self._fault = watch.fault_safely(wait=True) if (watch is not None and transport) else None
        fault = self._fault
        if watch is not None:
            watch.stop.set()
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
            dl = self._loader._dl
            if getattr(dl, "_iterator", None) is self._it:  # persistent workers: start afresh next time
                dl._iterator = None
        if fault is not None:
            worker, pid, sig, what = fault
            raise WorkerError(
                f"PackedDataLoader worker {worker} (pid {pid}) {what}; this iteration cannot go on "
                f"({type(e).__name__} in the main process). {self._pos} batch(es) of epoch {self._epoch} "
                "were handed out: build a fresh loader with the same settings and load_state_dict("
                "state_dict()) to continue exactly.", worker=worker, pid=pid, signal=sig) from None
        raise e


def _proc_state(pid: int) -> str | None:
    """The state letter of a process in /proc (``"T"``: stopped), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3].decode()
    except (OSError, ValueError):
        return None


class WorkerWatch:
    """Watches the DataLoader workers of one iterator (holds no reference to the iterator or loader).

    While the main process waits for a batch longer than ``timeout``, a stopped worker (``SIGSTOP``;
    torch would otherwise block the main process forever, receiving a tensor's file descriptor from it)
    is killed, which makes the main process's wait fail at once; :meth:`fault` then names the worker."""

    def __init__(self, workers: list, timeout: float):
        self.workers, self.timeout = workers, timeout
        self.waiting_since: float | None = None
        self.stopped: dict[int, int] = {}    # worker number -> pid, of workers found stopped and killed
        self.stop = threading.Event()
        if timeout > 0:
            threading.Thread(target=self._run, name="packloader-worker-watch", daemon=True).start()

    def _kill_stopped(self) -> None:
        for i, w in enumerate(self.workers):
            pid = w.pid
            if pid is not None and i not in self.stopped and _proc_state(pid) in ("T", "t"):
                self.stopped[i] = pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _run(self) -> None:
        while not self.stop.wait(min(0.25, self.timeout / 4)):
            since = self.waiting_since
            if since is not None and time.monotonic() - since > self.timeout:
                self._kill_stopped()

    def fault_safely(self, wait: bool = True):
        """:meth:`fault`, retried when torch's SIGCHLD handler raises (it reports the same death)."""
        for _ in range(10):
            try:
                return self.fault(wait)
            except RuntimeError:
                continue
        return None

    def fault(self, wait: bool = True):
        """``(worker, pid, signal name or None, description)`` of the first failed worker, or None.
        ``wait``: give a worker whose connection just broke up to 2 s to be seen dead."""
        self._kill_stopped()
        deadline = time.monotonic() + (2.0 if wait else 0.0)
        while True:
            for i in sorted(self.stopped):
                return (i, self.stopped[i], "SIGSTOP",
                        f"was stopped (SIGSTOP) and sent nothing for {self.timeout:g} s (timeout); it was killed")
            codes = [(i, w.pid, w.exitcode) for i, w in enumerate(self.workers)]
            # any exit before the iterator ends is unexpected; a signal first, then an error status
            for i, pid, code in sorted((c for c in codes if c[2] is not None), key=lambda c: (c[2] >= 0, c[2] == 0)):
                if code < 0:
                    try:
                        name = signal.Signals(-code).name
                    except ValueError:
                        name = f"signal {-code}"
                    return i, pid, name, f"was killed by {name}"
                if code == 0:  # observed: a torch worker sent SIGTERM exits with status 0
                    return i, pid, None, "exited unexpectedly with status 0 (as a worker does on SIGTERM)"
                return i, pid, None, f"exited unexpectedly with status {code}"
            if time.monotonic() > deadline:  # not a worker fault (e.g. an error raised in the worker)
                return None
            time.sleep(0.05)
