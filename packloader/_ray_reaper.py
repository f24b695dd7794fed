"""Reaper of a local Ray instance: no Ray process outlives the ``pack`` that started it (Linux).

Ray's own fate-sharing is not enough: when the driver that started a local instance is killed
(SIGKILL), its raylet and GCS go with it, but the per-node agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) notice it, log "Raylet is dead! Exiting" and then hang, reparented to init,
for good (measured with Ray 2.60 on Linux).

:mod:`packloader.ray_engine` therefore runs this file as a small process (standard library only, run by
path so that it imports nothing of packloader) before it starts Ray. Every ``POLL_S`` it records the
Ray processes among the driver's descendants (command line naming ``ray``) and all their descendants,
with their start times. When its stdin reaches end of file (the driver closed it after
``ray.shutdown()``, or the driver died, which closes it too) or its parent changes, it stops every
recorded process still alive (SIGSTOP, so none can start another), adds their children, and kills them
all (SIGKILL); then it exits. A process is matched by pid *and* start time, so a reused pid is never
hit.

Usage (internal): ``python _ray_reaper.py DRIVER_PID`` with a pipe on stdin.
"""
from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 0.2


def proc_stats() -> dict:
    """{pid: the fields of /proc/<pid>/stat after the command name} of the live, non-zombie processes (field 0 is
    the state, 1 the parent pid, 3 the session id, 19 the start time)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] != b"Z":
            out[int(d)] = fields
    return out


def _procs() -> dict:
    """{pid: (ppid, start time)} of the live, non-zombie processes."""
    return {pid: (int(f[1]), int(f[19])) for pid, f in proc_stats().items()}


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return cmd.startswith(b"ray::") or b"/ray/" in cmd


def _children_closure(procs: dict, roots: set) -> set:
    """``roots`` and all their live descendants."""
    kids: dict = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    seen, stack = set(), [p for p in roots if p in procs]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(kids.get(p, ()))
    return seen


def _scan(driver: int, tracked: dict) -> None:
    procs = _procs()
    me = os.getpid()
    under_driver = _children_closure(procs, {driver}) - {driver, me}
    roots = {p for p in under_driver if p in tracked or _is_ray(p)}
    roots |= {p for p, st in tracked.items() if procs.get(p, (None, None))[1] == st}
    for p in _children_closure(procs, roots) - {driver, me}:
        tracked.setdefault(p, procs[p][1])


def _session_of(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[3])


def _orphans(sid, since: int) -> dict:
    """Ray processes of session ``sid`` reparented to init that started after ``since``: the driver's
    children born after the last scan, before it died."""
    out = {}
    if sid is None:
        return out
    for p, (ppid, st) in _procs().items():
        if ppid == 1 and st >= since and _session_of(p) == sid and _is_ray(p):
            out[p] = st
    return out


def _reap(tracked: dict) -> int:
    """Stop, then kill, every tracked process still alive (and the children they had meanwhile)."""
    stopped: set = set()
    for _ in range(10):  # until no new child appears (stopped processes cannot fork)
        procs = _procs()
        alive = {p for p, st in tracked.items() if procs.get(p, (None, None))[1] == st}
        new = _children_closure(procs, alive) - alive - {os.getpid()}
        for p in new:
            tracked[p] = procs[p][1]
        todo = (alive | new) - stopped
        if not todo:
            break
        for p in todo:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        stopped |= todo
    n = 0
    procs = _procs()
    for p in stopped:
        if procs.get(p, (None, None))[1] == tracked.get(p):
            try:
                os.kill(p, signal.SIGKILL)
                n += 1
            except OSError:
                pass
    return n


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    driver = int(argv[0])
    sid = _session_of(driver)
    since = _procs().get(os.getpid(), (0, 0))[1]
    tracked: dict = {}
    while True:
        if os.getppid() != driver:
            break
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
        _scan(driver, tracked)
    for p, st in _orphans(sid, since).items():
        tracked.setdefault(p, st)
    _reap(tracked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
