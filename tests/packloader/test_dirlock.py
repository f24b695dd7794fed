"""packloader._dirlock: one writer at a time per output directory (issue 36, defects 1 and 2).

Two real ``packloader pack`` (or ``prepare``) processes into one ``--out``: the first is stopped
(``SIGSTOP``) right after it claimed the directory, the second runs meanwhile, then the first goes on. The
second must fail at once with an error naming the first (before the lock, it wrote its own output and the
first then committed over it: ``report --verify`` found a file of the index missing, and ``prepare`` left
the other run's shards beside its manifest's). Also: a run SIGKILLed while holding the lock does not block
the next one, which names it; two runs started at the same moment leave a directory that verifies.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from packloader._dirlock import LOCK_NAME, lock_holder, output_dir_lock
from packloader._outdir import STATE_DIR
from packloader.errors import DataError
from tests.packloader.conftest import random_sequences, write_arrow
from tests.packloader.test_data_safety import write_jsonl

from packloader.demo import TOKENIZER, data_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "packloader.cli"]
TOK = data_path(TOKENIZER)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, flock")


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(CLI + [str(a) for a in args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def stop_once_claimed(proc: subprocess.Popen, out) -> None:
    """SIGSTOP ``proc`` as soon as it has claimed ``out`` (its owner record exists: the lock is held)."""
    owner = os.path.join(out, STATE_DIR, "owner.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(owner):
        assert proc.poll() is None, f"first run ended before claiming {out}: {proc.communicate()}"
        assert time.monotonic() < deadline, "first run never claimed the directory"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGSTOP)
    assert proc.poll() is None, "first run finished before it could be stopped"


def pack_sources(tmp_path, n=4):
    return [write_arrow(tmp_path / f"s{k}.arrow", random_sequences(6000, seed=k, max_len=300)) for k in range(n)]


def verify(out) -> None:
    r = subprocess.run(CLI + ["report", str(out), "--verify", "-q"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def only_indexed_files(out) -> list[str]:
    """The packed files on disk are exactly those index.json lists; nothing of a run is left in the state
    folder but job records and the owner file (no lock, no temp file)."""
    with open(os.path.join(out, "index.json"), encoding="utf-8") as f:
        listed = sorted(e["name"] for e in json.load(f)["files"])
    on_disk = sorted(n for n in os.listdir(out) if n != STATE_DIR and n != "index.json")
    assert on_disk == listed
    state = sorted(os.listdir(os.path.join(out, STATE_DIR)))
    assert LOCK_NAME not in state and "tmp" not in state, state
    return listed


def only_manifest_shards(out) -> list[str]:
    with open(os.path.join(out, "prepare.json"), encoding="utf-8") as f:
        m = json.load(f)
    on_disk = sorted(n for n in os.listdir(out) if n not in (STATE_DIR, "prepare.json"))
    assert on_disk == sorted(m["shards"]) and not m.get("replacing")
    state = os.path.join(out, STATE_DIR)
    assert sorted(set(os.listdir(state)) - {"tmp"}) == ["owner.json"]  # no lock left
    assert not os.path.isdir(os.path.join(state, "tmp")) or not os.listdir(os.path.join(state, "tmp"))
    return on_disk


# ------------------------------------------------------------------------------------------ the lock


def test_lock_conflicts_within_a_process_and_names_the_holder(tmp_path):
    with output_dir_lock(tmp_path, "pack", quiet=True):
        held = lock_holder(tmp_path)
        assert held["pid"] == os.getpid() and held["tool"] == "pack" and held["host"]
        with pytest.raises(DataError, match=rf"in use by 'packloader pack' \(pid {os.getpid()} on host "):
            with output_dir_lock(tmp_path, "prepare", quiet=True):
                pass
        assert lock_holder(tmp_path) == held  # the refused run changed nothing
    assert not os.path.exists(os.path.join(tmp_path, STATE_DIR, LOCK_NAME))
    with output_dir_lock(tmp_path, "prepare", quiet=True):  # released: free again
        pass


def test_a_left_behind_lock_record_is_taken_over_and_named(tmp_path, capsys):
    """A record whose run died (the kernel released its lock) names that run in a note, and is replaced."""
    os.makedirs(tmp_path / STATE_DIR)
    (tmp_path / STATE_DIR / LOCK_NAME).write_text(json.dumps(
        {"tool": "prepare", "host": "node-7", "pid": 4242, "started": "2026-11-26T10:00:00Z"}))
    with output_dir_lock(tmp_path, "pack"):
        assert lock_holder(tmp_path)["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "'packloader prepare' (pid 4242 on host node-7" in err and "ended without releasing it" in err


# ------------------------------------------------------------------------ two real processes: pack


@pytest.mark.parametrize("settings", ["equal", "different"])
def test_second_pack_into_a_busy_directory_fails_naming_the_first(tmp_path, settings):
    src = pack_sources(tmp_path)
    out = tmp_path / "out"
    first = start("pack", *src, "--out", out, "--capacity", 1024, "-q")
    stop_once_claimed(first, out)
    try:
        second = start("pack", *src, "--out", out, "--capacity", 1024 if settings == "equal" else 2048, "-q")
        rc2, err2 = finish(second)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    rc1, err1 = finish(first)
    assert rc1 == 0, err1
    assert rc2 == 1 and f"in use by 'packloader pack' (pid {first.pid} on host " in err2, err2
    verify(out)
    only_indexed_files(out)
    with open(out / "index.json", encoding="utf-8") as f:
        assert json.load(f)["capacity"] == 1024  # the first run's output, whole
    # once the first has finished, the second runs (equal settings: up to date)
    r = subprocess.run(CLI + ["pack", *src, "--out", str(out), "--capacity", "2048", "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    verify(out)
    only_indexed_files(out)


def test_pack_killed_holding_the_lock_does_not_block_the_next_run(tmp_path):
    src = pack_sources(tmp_path, n=2)
    out = tmp_path / "out"
    first = start("pack", *src, "--out", out, "--capacity", 1024)
    stop_once_claimed(first, out)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    assert lock_holder(out)["pid"] == first.pid  # the record it could not remove
    r = subprocess.run(CLI + ["pack", *src, "--out", str(out), "--capacity", "1024"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"(pid {first.pid} on host " in r.stderr and "ended without releasing it" in r.stderr
    verify(out)
    only_indexed_files(out)


def test_two_packs_started_together_leave_a_directory_that_verifies(tmp_path):
    src = pack_sources(tmp_path, n=2)
    out = tmp_path / "out"
    procs = [start("pack", *src, "--out", out, "--capacity", cap, "-q") for cap in (1024, 2048)]
    results = [finish(p) for p in procs]
    failed = [err for rc, err in results if rc != 0]
    assert all("output directory is in use by" in err for err in failed), failed
    assert len(failed) <= 1
    verify(out)
    only_indexed_files(out)


# --------------------------------------------------------------------- two real processes: prepare


@pytest.mark.parametrize("settings", ["equal", "different"])
def test_second_prepare_into_a_busy_directory_fails_naming_the_first(tmp_path, settings):
    src = write_jsonl(tmp_path / "in.jsonl", 6000)
    out = tmp_path / "tok"
    first = start("prepare", src, "--tokenizer", TOK, "--out", out, "--shard-size", 1000, "-q")
    stop_once_claimed(first, out)
    try:
        second = start("prepare", src, "--tokenizer", TOK, "--out", out, "--shard-size",
                       1000 if settings == "equal" else 700, "-q")
        rc2, err2 = finish(second)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    rc1, err1 = finish(first)
    assert rc1 == 0, err1
    assert rc2 == 1 and f"in use by 'packloader prepare' (pid {first.pid} on host " in err2, err2
    shards = only_manifest_shards(out)
    assert len(shards) == 6
    from packloader.sources import open_shard, resolve_sources

    assert sum(len(open_shard(p)) for p in resolve_sources(str(out / "*.arrow"))) == 6000  # the README's glob


def test_two_prepares_started_together_leave_one_set(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", 3000)
    out = tmp_path / "tok"
    procs = [start("prepare", src, "--tokenizer", TOK, "--out", out, "--shard-size", n, "-q") for n in (1000, 700)]
    results = [finish(p) for p in procs]
    failed = [err for rc, err in results if rc != 0]
    assert len(failed) <= 1 and all("output directory is in use by" in e for e in failed), failed
    from packloader.sources import open_shard

    assert sum(len(open_shard(out / n)) for n in only_manifest_shards(out)) == 3000
    assert sum(len(open_shard(out / n)) for n in os.listdir(out) if n.endswith(".arrow")) == 3000
