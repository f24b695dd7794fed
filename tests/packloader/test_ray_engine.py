"""``pack --engine ray`` (packloader.ray_engine, issue 17): same bytes as the local engine, faults.

The tests that need Ray share one local Ray instance (``ray.init(num_cpus=2)``, started once per
session: it takes about 10 s on 2 cores); the driver-kill trials start their own, in a subprocess.
Without Ray installed they skip, saying so; the tests of the error that names the extra run anyway.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from packloader import pack_dataset
from packloader.errors import DataError
from tests.packloader import fault_harness as fh
from tests.packloader.conftest import random_sequences, write_arrow

try:
    import ray
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="ray is not installed (pip install 'packloader[ray]')")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray instance (2 CPUs) for the session; yields its temp dir (names its processes)."""
    if ray is None:
        pytest.skip("ray is not installed (pip install 'packloader[ray]')")
    import logging

    temp = str(tmp_path_factory.mktemp("ray"))
    if len(temp) > 60:  # (Ray's unix sockets live under it: paths are limited to 107 bytes)
        import tempfile

        temp = tempfile.mkdtemp(prefix="plr-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             _temp_dir=temp)
    yield temp
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    return [write_arrow(str(d / f"s{k}.arrow"), random_sequences(1500, seed=10 + k, max_len=700), batch_rows=500)
            for k in range(4)]


def _body(d) -> dict:
    """Every file under ``d``: bytes, or JSON without its timing fields (``fh.snapshot``)."""
    return fh.snapshot(d)


# ----------------------------------------------------------------------------------------------------
# without Ray


def test_import_packloader_does_not_import_ray():
    code = ("import sys, packloader, packloader.pack_writer, packloader.cli; "
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_ray_without_ray_names_the_extra(monkeypatch, shards, tmp_path):
    from packloader import ray_engine

    monkeypatch.setattr(ray_engine, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'packloader\[ray\]'"):
        pack_dataset(shards[:2], tmp_path / "o", capacity=1024, engine="ray", quiet=True)
    assert not os.path.exists(tmp_path / "o" / "index.json")
    # the CLI says it as an error line, status 1
    from packloader.cli import main

    assert main(["pack", *shards[:2], "--capacity", "1024", "--engine", "ray", "--out", str(tmp_path / "c"),
                 "-q"]) == 1


def test_unknown_engine(shards, tmp_path):
    with pytest.raises(ValueError, match="engine"):
        pack_dataset(shards, tmp_path / "o", engine="spark")


@pytest.mark.parametrize("uri", ["s3://bucket/packed", "gs://b/packed", "hdfs://host:8020/packed"])
def test_out_uri_is_refused_with_what_to_do(shards, tmp_path, uri):
    """Shards may be URIs (tests/packloader/test_pack_uri.py), --out may not: it says so, and what to do."""
    with pytest.raises(DataError, match="output directory is a URI.*filesystem path.*upload") as e:
        pack_dataset(shards[:1], uri, capacity=1024)
    assert uri in str(e.value)


def test_local_global_packing_same_bytes_for_any_workers(shards, tmp_path):
    """Global packing writes its files in groups now (one plan, parallel writers): 1 or 3 processes,
    same bytes."""
    ref = tmp_path / "w1"
    pack_dataset(shards, ref, capacity=1024, global_packing=True, rows_per_file=90, quiet=True)
    pack_dataset(shards, tmp_path / "w3", capacity=1024, global_packing=True, rows_per_file=90, workers=3,
                 quiet=True)
    assert fh.diff(_body(tmp_path / "w3"), _body(ref)) == []
    assert len(json.load(open(ref / "index.json"))["files"]) > 3


# ----------------------------------------------------------------------------------------------------
# on a local Ray instance

CASES = {
    "per-shard": dict(),
    "per-shard-split": dict(rows_per_file=50),
    "global": dict(global_packing=True),
    "global-split": dict(global_packing=True, rows_per_file=70, overflow="split", algorithm="ffd", seed=3),
}


@needs_ray
@pytest.mark.parametrize("case", sorted(CASES))
def test_ray_writes_the_local_bytes(ray_cluster, shards, tmp_path, case):
    """Every byte of every file (index.json and the job records up to their timing fields and creation
    time: ``fault_harness.VOLATILE`` and ``*_seconds``) equals the local engine's, with 1, 2 and 3 Ray tasks
    in flight (3: more than the instance's CPUs; under global packing, other groups of files)."""
    kw = dict(capacity=1024, quiet=True, **CASES[case])
    pack_dataset(shards, tmp_path / "local", **kw)
    ref = _body(tmp_path / "local")
    for w in (1, 2, 3):
        out = tmp_path / f"ray{w}"
        rep = pack_dataset(shards, out, engine="ray", workers=w, **kw)
        assert fh.diff(_body(out), ref) == [], (case, w)
        assert rep.rows == json.load(open(out / "index.json"))["total_rows"]
    # the index itself records nothing engine-specific
    a = json.load(open(tmp_path / "local" / "index.json"))
    b = json.load(open(tmp_path / "ray2" / "index.json"))
    differing = {k for k in a if a[k] != b[k]}
    assert differing <= {"created", "report"}, differing


@needs_ray
def test_ray_task_error_is_raised_as_is(ray_cluster, shards, tmp_path):
    """A DataError in a task comes back as the DataError (file named), not retried; nothing is visible."""
    import pyarrow as pa

    bad = str(tmp_path / "bad.arrow")
    seqs = [np.array([1, 2, 3]), np.array([4, -5, 6])]
    with pa.OSFile(bad, "wb") as f, pa.ipc.new_file(f, pa.schema([("input_ids", pa.list_(pa.int32()))])) as w:
        w.write_table(pa.table({"input_ids": pa.array([s.tolist() for s in seqs], pa.list_(pa.int32()))}))
    out = tmp_path / "o"
    with pytest.raises(DataError, match="bad.arrow") as e:
        pack_dataset([*shards[:2], bad], out, capacity=1024, engine="ray", workers=2, quiet=True)
    assert "RayTaskError" not in type(e.value).__name__
    assert not (out / "index.json").exists()
    assert not [n for n in os.listdir(out) if n.endswith(".arrow") and "bad" in n]


@needs_ray
@pytest.mark.parametrize("global_packing", [False, True])
def test_ray_rerun_skips_finished_parts(ray_cluster, shards, tmp_path, global_packing):
    """A run that died after some parts: the re-run keeps their files (same inode: not rewritten) and
    writes the rest; the result equals an uninterrupted local run."""
    kw = dict(capacity=1024, rows_per_file=60, global_packing=global_packing, quiet=True)
    pack_dataset(shards, tmp_path / "local", **kw)
    out = tmp_path / "o"
    pack_dataset(shards, out, engine="ray", workers=2, **kw)
    index = json.load(open(out / "index.json"))
    names = [f["name"] for f in index["files"]]
    # simulate the crash: no index yet, the last job (per shard) / last file (global) not written
    os.remove(out / "index.json")
    if global_packing:
        lost = [names[-1]]
        rec = out / ".packloader" / f"job-{index['job_hashes'][-1][:24]}.json"
        os.remove(rec)
        # and the global job's own record back to "writing"
        jrec = out / ".packloader" / f"job-{index['job_hashes'][0][:24]}.json"
        jrec.write_text(json.dumps({"job_hash": index["job_hashes"][0], "job": 0, "status": "writing"}))
    else:
        last_job = index["files"][-1]["job"]
        lost = [f["name"] for f in index["files"] if f["job"] == last_job]
    for n in lost:
        os.remove(out / n)
    inodes = {n: os.stat(out / n).st_ino for n in names if n not in lost}
    rep = pack_dataset(shards, out, engine="ray", workers=2, **kw)
    assert rep.reused_files == len(names) - len(lost)
    assert {n: os.stat(out / n).st_ino for n in inodes} == inodes
    assert fh.diff(_body(out), _body(tmp_path / "local")) == []


def _raylet_pid(temp: str) -> int | None:
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if b"raylet" in cmd.split(b"\0")[0] and temp.encode() in cmd:
                return int(d)
    return None


def _task_workers(raylet: int) -> list[int]:
    """Workers of our raylet running a pack task."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            stat = open(f"/proc/{d}/stat", "rb").read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        if ppid == raylet and cmd.startswith(fh.RAY_TASK_TITLES):
            out.append(int(d))
    return out


@needs_ray
@linux
@pytest.mark.parametrize("global_packing", [False, True])
def test_ray_worker_sigkilled_mid_task(ray_cluster, tmp_path, global_packing):
    """SIGKILL a Ray worker while it runs a pack task (the first one seen, then another one a bit later):
    Ray runs the task again, the job finishes with the bytes of an uninterrupted local run, and the
    killed writers' temp files are gone."""
    src = [write_arrow(str(tmp_path / f"s{k}.arrow"), random_sequences(6000, seed=k, max_len=900), batch_rows=2000)
           for k in range(4)]
    kw = dict(capacity=2048, rows_per_file=400, global_packing=global_packing, quiet=True)
    pack_dataset(src, tmp_path / "local", **kw)
    raylet = _raylet_pid(ray_cluster)
    assert raylet is not None
    killed: list = []
    stop = threading.Event()

    def killer():
        while not stop.is_set() and len(killed) < 2:
            pids = _task_workers(raylet)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                time.sleep(0.3)
            time.sleep(0.002)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        pack_dataset(src, tmp_path / "ray", engine="ray", workers=2, **kw)
    finally:
        stop.set()
        t.join()
    assert killed, "no worker was seen running a pack task"
    assert fh.diff(_body(tmp_path / "ray"), _body(tmp_path / "local")) == []
    assert not os.path.exists(tmp_path / "ray" / ".packloader" / "tmp")


@needs_ray
@linux
def test_driver_and_workers_sigkilled_at_random_moments(tmp_path, seed):
    """``pack --engine ray`` (a subprocess that starts its own local Ray instance) killed at a random
    moment, after one of its Ray workers was killed at a random moment: no process of the run is left
    (raylet, GCS, agents, workers: all in its session), a finished directory it was replacing is still
    whole, and a re-run gives the bytes of an uninterrupted local run. ``PACKLOADER_RAY_FAULT_TRIALS``
    trials per mode (default 1: about a minute; benchmarks/fault_injection.py --ray-trials runs more)."""
    trials = int(os.environ.get("PACKLOADER_RAY_FAULT_TRIALS", "1"))
    sources = fh.make_sources(tmp_path / "src", n_shards=4, n_seqs=1000, seed=seed)
    refs, wall = fh.prepare_refs(str(tmp_path), sources, workers=(1,), ray_workers=(2,))
    rng = random.Random(seed)
    results = []
    for mode in ("fresh", "repack"):
        for _ in range(trials):
            results.append(fh.trial(sources, str(tmp_path), workers=2, mode=mode, refs=refs, wall=wall, rng=rng,
                                    engine="ray", kill_workers=True))
    for r in results:
        print(r)
    bad = [r for r in results if r["problems"] or r["orphans"]]
    assert not bad, bad


@needs_ray
@linux
def test_driver_killed_once_ray_agents_run_leaves_no_process(tmp_path):
    """The defect the reaper fixes: a driver SIGKILLed once its Ray instance's agents run
    (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) left those agents alive for good, reparented to
    init. Now no process of the driver's session is left 5 s later."""
    sources = fh.make_sources(tmp_path / "src", n_shards=2, n_seqs=500)
    proc = subprocess.Popen(fh.pack_cmd(sources, tmp_path / "out", 2, 1024, "ray"), cwd=fh.ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        agents = []
        while time.monotonic() < deadline and proc.poll() is None:
            agents = []
            for pid in fh.session_pids(proc.pid):
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if cmd.startswith((b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")):
                    agents.append(pid)
            if agents:
                break
            time.sleep(0.02)
        assert agents, "the Ray agents never started (or the run ended first)"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while fh.session_pids(proc.pid) and time.monotonic() - t0 < fh.ORPHAN_WAIT_S:
            time.sleep(0.05)
        left = fh.session_pids(proc.pid)
    finally:
        for pid in fh.session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left after the driver's kill: {left}"
