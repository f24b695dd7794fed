"""Pack's tasks on Ray (``packloader pack --engine ray``; ``pip install 'packloader[ray]'``).

:func:`run_ray_tasks` runs the very functions the local engine runs (one task per shard, or, under
global packing, one task per group of output files of the plan made centrally by the driver) as Ray
tasks, and returns their results to :func:`packloader.pack_writer.pack_dataset`, which merges them into one
``index.json`` and one report exactly as it does for the local engine. Ray only schedules; the output
layout never depends on it (no Ray Data, no repartitioning), so the bytes are those of the local engine
whatever the number of Ray workers.

Faults:

* A task whose worker process dies (SIGKILL, node lost) is run again by Ray (``max_retries``,
  :data:`MAX_RETRIES`). Its files are written under ``.packloader/tmp/`` and renamed into place only
  once complete, so a torn file is never visible; the retry writes the same bytes under the same name.
* An exception raised by a task (bad input: a :class:`~packloader.errors.DataError` naming the file and
  row) is not retried: the tasks still running are cancelled and the error is raised as it was raised
  in the task (not wrapped in Ray's ``RayTaskError``).
* A killed driver leaves the finished jobs' files and records: the next run skips them. A local Ray
  instance started by the driver goes with it: Ray's raylet and GCS share its fate, and a small
  reaper process (:mod:`packloader._ray_reaper`) kills the agents that would hang on (Linux).

Where it runs::

    ray_address=None    the cluster ``ray.init`` already connected to in this process; else
                        $RAY_ADDRESS; else a new local Ray instance with ``workers`` CPUs, shut down
                        when the job ends
    ray_address="auto"  the cluster ``ray start`` runs on this machine
    ray_address="ray://head:10001"   a remote cluster (Ray Client)

On a cluster every node must import the same packloader version (install it in the nodes' image, or
pass a ``runtime_env`` to your own ``ray.init`` before calling ``pack``); every shard must be readable
from every node under its name (a path on a shared filesystem, or a URI such as ``s3://bucket/tok/x.arrow``,
which each task opens with pyarrow and its node's own credentials: :mod:`packloader.sources.uri`), and the
output directory must be the same directory on every node (a shared filesystem); see docs/cluster.md.

Example::

    >>> import ray                                                               # doctest: +SKIP
    >>> ray.init(address="auto")                                                 # doctest: +SKIP
    >>> from packloader import pack_dataset
    >>> pack_dataset("/shared/tok/*.arrow", "/shared/packed", engine="ray", workers=64)  # doctest: +SKIP
    >>> pack_dataset("s3://bucket/tok/shard-{000..999}.arrow", "/shared/packed2", engine="ray",
    ...              workers=64)                                                    # doctest: +SKIP
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from packloader._log import log

try:  # optional extra: the call site decides
    import ray
except ImportError:  # pragma: no cover - exercised when ray is not installed
    ray = None

__all__ = ["run_ray_tasks", "require_ray", "MAX_RETRIES", "INSTALL_HINT"]

#: how often Ray runs a task again whose worker died (system failures; exceptions are not retried)
MAX_RETRIES = 3
INSTALL_HINT = "pip install 'packloader[ray]'"


def require_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    if ray is None:
        raise ImportError(f"engine='ray' needs Ray, which is not installed: {INSTALL_HINT}")
    return ray


def _start_reaper():
    """The process that kills what is left of a local Ray instance once this process ends or closes
    its stdin (:mod:`packloader._ray_reaper`; Linux only, else None)."""
    if not sys.platform.startswith("linux"):
        return None
    from packloader import _ray_reaper

    return subprocess.Popen([sys.executable, "-S", _ray_reaper.__file__, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def _stop_reaper(reaper) -> None:
    if reaper is None:
        return
    try:
        reaper.stdin.close()
        reaper.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        reaper.kill()
        reaper.wait()


def _connect(workers: int, address: str | None, quiet: bool):
    """Connect to (or start) Ray. Returns None when it was connected already (nothing to undo), else
    ``(reaper or None,)``: disconnect at the end (and, for a local instance started here, reap it)."""
    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS") or None
    kw = {"logging_level": logging.ERROR if quiet else logging.WARNING, "log_to_driver": not quiet,
          "configure_logging": True}
    if address:
        log(f"connecting to the Ray cluster at {address}", quiet=quiet)
        ray.init(address=address, **kw)  # (disconnects at the end; the cluster keeps running)
        return (None,)
    log(f"starting a local Ray instance with {workers} CPU(s) (ray {ray.__version__})", quiet=quiet)
    reaper = _start_reaper()
    try:
        ray.init(num_cpus=workers, include_dashboard=False, **kw)
    except BaseException:
        _stop_reaper(reaper)
        raise
    return (reaper,)


def run_ray_tasks(fn, tasks: list, *, workers: int = 1, address: str | None = None, on_done=None,
                  max_retries: int = MAX_RETRIES, quiet: bool = True) -> list:
    """Run ``fn(task)`` for every task as a Ray task, at most ``workers`` in flight; return the results in
    task order. ``on_done(result)`` is called in this process as each finishes.

    Args:
        fn: a module-level function (importable on the workers) of one picklable task.
        tasks: the tasks.
        workers: tasks in flight at once (>= 1); also the CPUs of a local instance started here.
        address: the cluster (see the module docstring); None: the connected one, ``$RAY_ADDRESS``, or
            a new local instance.
        on_done: optional callback.
        max_retries: Ray's retries of a task whose worker died.
        quiet: Ray's own logging at ERROR level and no worker output on the driver.

    Raises:
        ImportError: Ray is not installed (the message names ``pip install 'packloader[ray]'``).
        The first exception a task raised, as it was raised (its other tasks are cancelled).
    """
    if not tasks:
        return []
    require_ray()
    started = _connect(workers, address, quiet)
    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(fn)
    results: list = [None] * len(tasks)
    pending: dict = {}
    nxt = 0
    try:
        while nxt < len(tasks) or pending:
            while nxt < len(tasks) and len(pending) < workers:
                pending[remote.remote(tasks[nxt])] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, BaseException):
                        raise cause from None
                    raise
                if on_done is not None:
                    on_done(results[i])
    finally:
        for ref in pending:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - best effort: the task may have just finished
                pass
        if started is not None:
            try:
                ray.shutdown()
            finally:
                _stop_reaper(started[0])
    return results
