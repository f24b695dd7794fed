"""Kill ``packloader pack`` at random moments and check what is left (used by ``test_fault_injection.py``
and ``benchmarks/fault_injection.py``).

One trial: start ``python -m packloader.cli pack`` (its own session), SIGKILL it after a random delay in
``[0, 0.9 T]`` (``T``: the wall time of an uninterrupted run), then check

1. no process of its session is left (workers, resource tracker) after at most ``ORPHAN_WAIT_S``;
2. ``mode="repack"`` (the directory held a finished pack with other settings): the directory still
   opens and holds exactly one of the two finished outputs, never a mix or a damaged one;
3. a re-run finishes, and then every file of the directory equals the uninterrupted run's byte for byte
   (``index.json`` and the job records up to their timing fields and creation time, which differ from
   run to run by nature), with nothing left behind (no temp file, no stale part, no extra record).

With ``engine="ray"`` the killed run is ``pack --engine ray`` (a local Ray instance started by the
run, in its session: raylet, GCS, agents, workers), the re-run too, and the reference stays the
uninterrupted *local* run; ``kill_workers=True`` also SIGKILLs one Ray worker that is running a pack
task (``ray::_run_job`` / ``ray::_write_parts``) at a random moment before the driver's kill.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

from tests.packloader.conftest import random_sequences, write_arrow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "packloader.cli"]
ORPHAN_WAIT_S = 5.0
#: index.json / record keys that differ between two identical runs (times, dates)
VOLATILE = ("created", "reused_files", "tokens_per_second")


def make_sources(d, *, n_shards: int = 6, n_seqs: int = 4000, seed: int = 0) -> list[str]:
    os.makedirs(d, exist_ok=True)
    return [write_arrow(os.path.join(d, f"shard-{k:03d}.arrow"), random_sequences(n_seqs, seed=seed + k, max_len=600),
                        batch_rows=997) for k in range(n_shards)]


def pack_cmd(sources, out, workers: int, capacity: int, engine: str = "local") -> list[str]:
    return CLI + ["pack", *sources, "--capacity", str(capacity), "--workers", str(workers), "--out", str(out), "-q",
                  "--rows-per-file", "300", "--engine", engine]


def run_pack(sources, out, workers: int, capacity: int, engine: str = "local") -> float:
    """An uninterrupted run; returns its wall time."""
    t0 = time.perf_counter()
    r = subprocess.run(pack_cmd(sources, out, workers, capacity, engine), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"pack failed: {r.stderr}")
    return time.perf_counter() - t0


def _normalise(obj):
    if isinstance(obj, dict):
        return {k: _normalise(v) for k, v in obj.items() if k not in VOLATILE and not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [_normalise(v) for v in obj]
    return obj


def snapshot(d) -> dict:
    """{relative path: bytes, or normalised JSON for .json files} of every file under ``d``."""
    out = {}
    for r, dirs, names in os.walk(d):
        for n in names:
            p = os.path.join(r, n)
            rel = os.path.relpath(p, d)
            data = open(p, "rb").read()
            out[rel] = _normalise(json.loads(data)) if n.endswith(".json") else data
        for n in dirs:
            out.setdefault(os.path.relpath(os.path.join(r, n), d) + "/", None)
    return out


def diff(a: dict, b: dict) -> list[str]:
    problems = [f"only in the re-run: {k}" for k in sorted(set(a) - set(b))]
    problems += [f"missing after the re-run: {k}" for k in sorted(set(b) - set(a))]
    problems += [f"differs: {k}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    return problems


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    from packloader._ray_reaper import proc_stats

    return [pid for pid, f in proc_stats().items() if int(f[3]) == sid]


#: process titles of Ray workers running a pack task
RAY_TASK_TITLES = (b"ray::_run_job", b"ray::_write_parts")


def ray_task_workers(sid: int) -> list[int]:
    """Ray worker processes of session ``sid`` that are running a pack task."""
    out = []
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(RAY_TASK_TITLES):
            out.append(pid)
    return out


def _kill_a_worker(sid: int, stop: threading.Event, rng: random.Random, killed: list) -> None:
    """Once a Ray worker of session ``sid`` is seen running a pack task, wait a random 0-0.5 s and SIGKILL
    one that runs one then (polling until ``stop`` is set); appends its pid to ``killed``."""
    armed = None
    while not stop.is_set():
        pids = ray_task_workers(sid)
        if pids and armed is None:
            armed = time.monotonic() + rng.uniform(0, 0.5)
        if pids and time.monotonic() >= armed:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                continue
            return
        time.sleep(0.005)


def _wait_for_tasks(sid: int, proc, rng: random.Random, spread: float) -> None:
    """Return a random 0-``spread`` s after a Ray worker of session ``sid`` is first seen running a pack
    task (or when ``proc`` ends)."""
    while proc.poll() is None and not ray_task_workers(sid):
        time.sleep(0.005)
    time.sleep(rng.uniform(0, spread))


def stage_of(out) -> str:
    """What the killed run had written: nothing, temp files / job records, or its index."""
    if not os.path.isdir(out):
        return "before any output"
    try:
        with open(os.path.join(out, "index.json")) as f:
            if json.load(f)["settings"]["capacity"] == _CURRENT["capacity"]:
                return "after its index"
    except (OSError, ValueError, KeyError):
        pass
    tdir = os.path.join(out, ".packloader", "tmp")
    if os.path.isdir(tdir) and os.listdir(tdir):
        return "while writing a file"
    return "between files"


_CURRENT: dict = {}


def _opened_matches(out, refs: list[dict]) -> bool:
    """The directory opens and its index and listed files equal one of the reference runs."""
    from packloader.prepacked import PrepackedDataset

    with PrepackedDataset(out) as ds:
        names = list(ds.file_names)
    got = {n: open(os.path.join(out, n), "rb").read() for n in names}
    index = _normalise(json.load(open(os.path.join(out, "index.json"))))
    return any(index == ref["index.json"] and all(got[n] == ref.get(n) for n in names) for ref in refs)


def trial(sources, work, *, workers: int, mode: str, refs: dict, wall: dict, rng: random.Random,
          engine: str = "local", kill_workers: bool = False) -> dict:
    """One kill trial (see the module docstring). ``refs[capacity]``: snapshot of an uninterrupted (local)
    run; ``wall[workers]`` (``wall[(engine, workers)]`` for another engine): its wall time. Returns a dict
    describing the outcome."""
    key = workers if engine == "local" else (engine, workers)
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    cap_old, cap_new = sorted(refs)
    if mode == "repack":
        shutil.copytree(refs[cap_old]["__dir__"], out)
    _CURRENT["capacity"] = cap_new
    delay = rng.uniform(0, 0.9 * wall[key])  # (most delays inside a run, whose time varies with load)
    # Ray: a local instance takes most of a short run to start; half the kills come while tasks run
    after_tasks = engine == "ray" and rng.random() < 0.5
    proc = subprocess.Popen(pack_cmd(sources, out, workers, cap_new, engine), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_start = time.monotonic()
    killed_workers: list = []
    killer, stop = None, threading.Event()
    if kill_workers:
        killer = threading.Thread(target=_kill_a_worker, daemon=True,
                                  args=(proc.pid, stop, random.Random(rng.random()), killed_workers))
        killer.start()
    if after_tasks:
        _wait_for_tasks(proc.pid, proc, rng, 1.5)
        delay = time.monotonic() - t_start
    else:
        time.sleep(delay)
    finished = proc.poll() is not None
    if not finished:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    if killer is not None:
        killer.join()
    t0 = time.monotonic()
    while session_pids(proc.pid) and time.monotonic() - t0 < ORPHAN_WAIT_S:
        time.sleep(0.02)
    orphans = session_pids(proc.pid)
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    result = {"engine": engine, "workers": workers, "mode": mode, "delay_s": round(delay, 3), "killed": not finished,
              "workers_killed": len(killed_workers),
              "stage": "finished before the kill" if finished else stage_of(out), "orphans": len(orphans),
              "problems": []}
    if mode == "repack":
        try:
            ok = _opened_matches(out, [refs[cap_old], refs[cap_new]])
        except Exception as e:  # noqa: BLE001 - any failure to open is a damaged directory
            ok, result["problems"] = False, [f"directory does not open after the kill: {e}"]
        if not ok and not result["problems"]:
            result["problems"].append("directory after the kill is neither the old nor the new output")
    rerun_s = run_pack(sources, out, workers, cap_new, engine)
    if mode == "fresh" and result["stage"] != "after its index":  # (a full run: keep T near the current load)
        wall[key] = 0.5 * (wall[key] + rerun_s)
    result["problems"] += diff(snapshot(out), {k: v for k, v in refs[cap_new].items() if k != "__dir__"})
    if orphans:
        result["problems"].append(f"{len(orphans)} process(es) of the killed run still alive after {ORPHAN_WAIT_S} s")
    return result


def prepare_refs(work, sources, capacities=(640, 1024), workers=(1, 2), ray_workers=()) -> tuple[dict, dict]:
    """Uninterrupted runs: ``refs[capacity]`` (snapshots, and ``"__dir__"``) and ``wall[workers]`` (the
    wall time of a run with the new capacity), ``wall[("ray", w)]`` for each of ``ray_workers``. The
    2-worker run and the Ray runs must equal the 1-worker local one."""
    refs, wall = {}, {}
    cap_old, cap_new = capacities
    for cap in capacities:
        d = os.path.join(work, f"ref-{cap}")
        shutil.rmtree(d, ignore_errors=True)
        t = run_pack(sources, d, 1, cap)
        refs[cap] = snapshot(d)
        refs[cap]["__dir__"] = d
        if cap == cap_new:
            wall[1] = t
    for w in workers:
        if w == 1:
            continue
        d = os.path.join(work, f"ref-{cap_new}-w{w}")
        shutil.rmtree(d, ignore_errors=True)
        wall[w] = run_pack(sources, d, w, cap_new)
        problems = diff(snapshot(d), {k: v for k, v in refs[cap_new].items() if k != "__dir__"})
        assert not problems, f"{w} workers give another output than 1: {problems}"
    for w in ray_workers:
        d = os.path.join(work, f"ref-{cap_new}-ray{w}")
        shutil.rmtree(d, ignore_errors=True)
        wall[("ray", w)] = run_pack(sources, d, w, cap_new, "ray")
        problems = diff(snapshot(d), {k: v for k, v in refs[cap_new].items() if k != "__dir__"})
        assert not problems, f"--engine ray --workers {w} gives another output than local: {problems}"
    return refs, wall


def campaign(work, *, trials_per_case: int, seed: int = 0, workers=(1, 2), modes=("fresh", "repack"),
             n_shards: int = 6, n_seqs: int = 4000, ray_trials_per_case: int = 0, ray_workers=(2,)) -> list[dict]:
    """All trials: ``trials_per_case`` for each (workers, mode) of the local engine, and
    ``ray_trials_per_case`` for each (Ray workers, mode) of ``--engine ray`` (driver and a Ray worker
    killed)."""
    rng = random.Random(seed)
    sources = make_sources(os.path.join(work, "src"), n_shards=n_shards, n_seqs=n_seqs, seed=seed)
    refs, wall = prepare_refs(work, sources, workers=workers, ray_workers=ray_workers if ray_trials_per_case else ())
    results = []
    for w in workers:
        for mode in modes:
            for _ in range(trials_per_case):
                results.append(trial(sources, work, workers=w, mode=mode, refs=refs, wall=wall, rng=rng))
    for w in ray_workers if ray_trials_per_case else ():
        for mode in modes:
            for _ in range(ray_trials_per_case):
                results.append(trial(sources, work, workers=w, mode=mode, refs=refs, wall=wall, rng=rng,
                                     engine="ray", kill_workers=True))
    return results
