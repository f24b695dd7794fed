"""Issue 16: packloader never deletes, drops, duplicates or silently changes data.

One test per defect found (each fails on the code before the fix), the faults (killed ``pack`` workers,
killed / stopped loader workers, a half-written pre-packed directory) and the validation list. The
randomised kill campaign is in ``test_fault_injection.py``, the reader fuzz in ``test_reader_fuzz.py``.
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pyarrow as pa
import pytest

from packloader.errors import DataError
from packloader.pack_writer import pack_dataset
from packloader.prepacked import PrepackedDataset
from packloader.sources import open_shard, resolve_sources
from tests.packloader.conftest import random_sequences, write_arrow, write_tar

from packloader.demo import TOKENIZER, data_path

TOK = data_path(TOKENIZER)


def write_jsonl(path, n: int) -> str:
    rng = np.random.default_rng(n)
    words = ["alpha", "beta", "gamma", "delta", "seven", "12", "plus", "is"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            q = " ".join(rng.choice(words, int(rng.integers(1, 30))))
            f.write(json.dumps({"question": f"{i}: {q}?", "answer": f"{i * 7}"}) + "\n")
    return str(path)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "packloader.cli"]


def cli(*args, **kw):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def pack(sources, out, **kw):
    kw.setdefault("quiet", True)
    return pack_dataset(sources, out, **kw)


def listing(d) -> dict:
    """{relative path: bytes} of every file under ``d``."""
    out = {}
    for r, _, names in os.walk(d):
        for n in names:
            p = os.path.join(r, n)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


# ------------------------------------------------------------------------------------- 1. deleting


def test_pack_never_deletes_a_source_in_its_out_dir(tmp_path, seed):
    d = tmp_path / "d"
    d.mkdir()
    src = write_arrow(d / "part-00000.arrow", random_sequences(50, seed=seed, max_len=60))
    before = open(src, "rb").read()
    with pytest.raises(DataError, match=r"not empty .* not written by 'packloader pack'.*--allow-nonempty"):
        pack(src, d, capacity=64)
    assert open(src, "rb").read() == before and sorted(os.listdir(d)) == ["part-00000.arrow"]
    # with the explicit flag: packed beside the source, which survives this and every later re-pack
    rep = pack(src, d, capacity=64, allow_nonempty=True)
    assert rep.sequences == 50 and open(src, "rb").read() == before
    pack(src, d, capacity=128, allow_nonempty=True)
    assert open(src, "rb").read() == before
    with PrepackedDataset(d) as ds:
        assert ds.capacity == 128 and src.split(os.sep)[-1] not in ds.file_names
    assert os.listdir(d).count("part-00000.arrow") == 1


def test_pack_refuses_a_foreign_index_and_its_own_outputs_as_sources(tmp_path, seed):
    src = write_arrow(tmp_path / "a.arrow", random_sequences(30, seed=seed, max_len=60))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.json").write_text('{"mine": true}')
    with pytest.raises(DataError, match="index.json"):
        pack(src, foreign, capacity=64, allow_nonempty=True)
    assert (foreign / "index.json").read_text() == '{"mine": true}'
    out = tmp_path / "out"
    pack(src, out, capacity=64)
    part = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))[0]
    with pytest.raises(DataError, match="output of this very pack directory"):
        pack([src, str(out / part)], out, capacity=64)
    with pytest.raises(DataError, match="pre-packed directory"):  # a pack directory is not a set of shards
        pack(out, tmp_path / "out2", capacity=64)


def test_prepare_never_deletes_an_unrelated_shard(tmp_path):
    from packloader.prepare import prepare_jsonl
    src = write_jsonl(tmp_path / "in.jsonl", 30)
    out = tmp_path / "tok"
    out.mkdir()
    theirs = write_arrow(out / "shard-00009.arrow", random_sequences(5, seed=0))
    before = open(theirs, "rb").read()
    with pytest.raises(DataError, match="not empty"):
        prepare_jsonl(src, out, tokenizer=TOK, quiet=True)
    res = prepare_jsonl(src, out, tokenizer=TOK, quiet=True, allow_nonempty=True, shard_size=10)
    assert len(res.paths) == 3 and open(theirs, "rb").read() == before
    prepare_jsonl(src, out, tokenizer=TOK, quiet=True, allow_nonempty=True, shard_size=7, overwrite=True)
    assert open(theirs, "rb").read() == before
    # a name prepare would write but did not: refused, nothing replaced
    other = tmp_path / "other"
    other.mkdir()
    taken = write_arrow(other / "shard-00000.arrow", random_sequences(5, seed=1))
    before = open(taken, "rb").read()
    with pytest.raises(DataError, match="taken by a file"):
        prepare_jsonl(src, other, tokenizer=TOK, quiet=True, allow_nonempty=True)
    assert open(taken, "rb").read() == before
    assert sorted(os.listdir(other)) == [".packloader", "shard-00000.arrow"]


# ------------------------------------------------------------------------------ 2. tar end-of-archive


def _member_ends(path) -> list[tuple[str, int]]:
    with tarfile.open(path) as tf:
        return [(m.name, m.offset_data + -(-m.size // 512) * 512) for m in tf.getmembers()]


def test_tar_cut_at_a_member_boundary_is_refused(tmp_path, seed):
    seqs = random_sequences(10, seed=seed, max_len=90)  # every member 1024 bytes: 5120 = 5 members
    full = write_tar(tmp_path / "full10.tar", seqs, extra=False)
    assert [e for _, e in _member_ends(full)] == [1024 * (k + 1) for k in range(10)]
    data = open(full, "rb").read()
    assert len(open_shard(full)) == 10
    for name, end in _member_ends(full)[:-1]:
        cut = tmp_path / "cut.tar"
        cut.write_bytes(data[:end])
        with pytest.raises(DataError, match=r"cut\.tar, member '.*': truncated tar: no end-of-archive block"
                                            r".*ends right after member") as e:
            open_shard(cut)
        assert e.value.member == name  # the last good member
    # the exact example of the issue: 5120 bytes of a 10-member archive
    (tmp_path / "cut.tar").write_bytes(data[:5120])
    r = cli("pack", tmp_path / "cut.tar", "--capacity", 256, "--out", tmp_path / "o", "-q")
    assert r.returncode == 1 and "cut.tar" in r.stderr and "end-of-archive" in r.stderr
    # one zero block is enough (all members present); an archive written by tarfile still reads
    first_zero = _member_ends(full)[-1][1]
    (tmp_path / "one.tar").write_bytes(data[:first_zero + 512])
    assert len(open_shard(tmp_path / "one.tar")) == 10


# ---------------------------------------------------------------------------- 3. Arrow stream end


def test_arrow_stream_cut_at_a_message_boundary_is_refused(tmp_path, seed):
    seqs = random_sequences(1000, seed=seed, max_len=50)
    full = write_arrow(tmp_path / "s.arrows", seqs, stream=True, batch_rows=100)
    assert len(open_shard(full)) == 1000  # .arrows is accepted
    assert resolve_sources(str(tmp_path / "*.arrows")) == [full]
    data = open(full, "rb").read()
    src = pa.BufferReader(data)
    reader = pa.ipc.MessageReader.open_stream(src)
    ends = []
    while True:
        try:
            reader.read_next_message()
        except StopIteration:
            break
        ends.append(src.tell())
    assert len(ends) == 11
    for end in ends:  # every message boundary, the last one included (only the marker missing)
        (tmp_path / "cut.arrow").write_bytes(data[:end])
        with pytest.raises(DataError, match=r"cut\.arrow: truncated or damaged Arrow IPC stream: no end-of-stream"):
            open_shard(tmp_path / "cut.arrow")
    (tmp_path / "extra.arrow").write_bytes(data + b"\0" * 8)
    with pytest.raises(DataError, match="after its end-of-stream marker"):
        open_shard(tmp_path / "extra.arrow")


# -------------------------------------------------------------------- 4. prepare: one output set


def test_prepare_with_another_format_replaces_the_set(tmp_path):
    from packloader.prepare import prepare_jsonl
    src = write_jsonl(tmp_path / "in.jsonl", 150)
    t = tmp_path / "t"
    a = prepare_jsonl(src, t, tokenizer=TOK, limit=100, shard_size=40, quiet=True)
    b = prepare_jsonl(src, t, tokenizer=TOK, limit=100, shard_size=40, format="parquet", quiet=True)
    assert all(p.endswith(".arrow") for p in a.paths) and all(p.endswith(".parquet") for p in b.paths)
    assert sorted(n for n in os.listdir(t) if n.startswith("shard")) == sorted(os.path.basename(p) for p in b.paths)
    manifest = json.loads((t / "prepare.json").read_text())
    assert manifest["shards"] == [os.path.basename(p) for p in b.paths] and "replacing" not in manifest
    assert pack(str(t), tmp_path / "packed", capacity=4096).sequences == 100
    # a stray shard copied in by hand is not part of the set: the directory stands for the manifest
    write_arrow(t / "shard-00099.arrow", random_sequences(5, seed=0))
    assert len(resolve_sources(str(t))) == len(b.paths)


def test_prepare_killed_after_its_commit_is_finished_by_the_next_run(tmp_path, monkeypatch):
    import packloader.prepare as prepare

    src = write_jsonl(tmp_path / "in.jsonl", 60)
    t = tmp_path / "t"
    prepare.prepare_jsonl(src, t, tokenizer=TOK, shard_size=10, quiet=True)
    calls = {"n": 0}
    real = prepare._finish_replacement

    def crash(*a):
        calls["n"] += 1
        if calls["n"] == 2:  # the call after the renames
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(prepare, "_finish_replacement", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_jsonl(src, t, tokenizer=TOK, shard_size=10, format="parquet", quiet=True)
    with pytest.raises(DataError, match="did not finish"):
        resolve_sources(str(t))
    monkeypatch.setattr(prepare, "_finish_replacement", real)
    res = prepare.prepare_jsonl(src, t, tokenizer=TOK, shard_size=10, format="parquet", quiet=True)
    assert sorted(n for n in os.listdir(t) if n.startswith("shard")) == sorted(os.path.basename(p) for p in res.paths)
    assert all(n.endswith(".parquet") for n in os.listdir(t) if n.startswith("shard"))


# ------------------------------------------------------- 5. stale parts after a crash before cleanup


def test_stale_parts_after_a_crash_between_index_swap_and_cleanup(tmp_path, monkeypatch, seed):
    import packloader.pack_writer as pack_writer

    src = [write_arrow(tmp_path / f"s{k}.arrow", random_sequences(40, seed=seed + k, max_len=60)) for k in range(2)]
    out = tmp_path / "out"
    pack(src, out, capacity=64)
    old = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    monkeypatch.setattr(pack_writer, "cleanup", lambda *a, **k: None)  # killed right after the index swap
    pack(src, out, capacity=100)
    monkeypatch.undo()
    assert set(old) <= set(os.listdir(out))
    pack(src, out, capacity=100)  # "up to date", and the missed cleanup is done now
    with PrepackedDataset(out) as ds:
        assert sorted(os.listdir(out)) == sorted(ds.file_names + [".packloader", "index.json"])
    assert not set(old) & set(os.listdir(out))


# --------------------------------------------------------------------------------- 6. checksums


def test_checksums_recorded_and_verified(tmp_path, seed):
    from packloader._outdir import file_checksum

    src = write_arrow(tmp_path / "a.arrow", random_sequences(200, seed=seed, max_len=60))
    out = tmp_path / "out"
    pack(src, out, capacity=64)
    index = json.loads((out / "index.json").read_text())
    name = index["files"][0]["name"]
    assert index["files"][0]["checksum"] == file_checksum(out / name)
    assert cli("report", out, "--verify").returncode == 0
    # flip one byte of token data (the middle of the file: input_ids / labels buffers)
    data = bytearray((out / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / name).write_bytes(bytes(data))
    with PrepackedDataset(out) as ds:  # the cheap checks (size, rows, schema) still pass
        assert len(ds) == index["total_rows"]
    with pytest.raises(DataError, match=rf"{name}: checksum mismatch"):
        PrepackedDataset(out, verify=True)
    r = cli("report", out, "--verify")
    assert r.returncode == 1 and name in r.stderr and "checksum mismatch" in r.stderr
    # a changed row count or size is caught on every open
    (out / name).write_bytes(bytes(data[:-8]))
    with pytest.raises(DataError, match=name):
        PrepackedDataset(out)


# ------------------------------------------------------------------------------------------ faults


def _big_arrow(path, n: int, seed: int, max_len: int = 400) -> str:
    """An Arrow shard of ``n`` random sequences, written without a Python loop per sequence."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    return str(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pack_workers_die_with_their_parent(tmp_path, seed):
    """SIGKILL of ``pack --workers 2`` once both workers run: no worker (nor the resource tracker) is
    left. Before the fix they outlived the parent indefinitely."""
    from tests.packloader.fault_harness import session_pids

    src = [_big_arrow(tmp_path / f"s{k}.arrow", 60_000, seed + k) for k in range(4)]
    proc = subprocess.Popen(CLI + ["pack", *src, "--capacity", "512", "--workers", "2", "--out",
                                   str(tmp_path / "out"), "-q"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(session_pids(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the parent, the resource tracker and 2 workers
    time.sleep(1.0)  # the workers are past their start-up, inside a job
    assert proc.poll() is None, "pack finished before its workers were seen"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = session_pids(proc.pid)
    for pid in left:  # do not leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL", "SIGTERM"])
def test_loader_worker_fault_is_one_clear_error_and_resume_is_exact(tmp_path, sig):
    from packloader import PackedDataLoader
    from packloader.errors import WorkerError

    paths = [write_arrow(tmp_path / f"s{k}.arrow", random_sequences(150, seed=k, max_len=300)) for k in range(3)]
    kw = dict(capacity=512, batch_size=2, num_workers=2, timeout=2, seed=3)
    ref = [b["input_ids"].clone() for b in PackedDataLoader(paths, **kw)]
    loader = PackedDataLoader(paths, **kw)
    it = iter(loader)
    got = [next(it)["input_ids"].clone() for _ in range(3)]
    pid = it._it._workers[1].pid
    os.kill(pid, getattr(signal, sig))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker 1 \(pid {pid}\)") as e:
        for b in it:
            got.append(b["input_ids"].clone())
    assert time.monotonic() - t0 < kw["timeout"] + 3
    assert e.value.worker == 1 and e.value.pid == pid
    if sig != "SIGTERM":  # a SIGTERM-ed torch worker exits with status 0: no signal to name
        assert e.value.signal == sig and sig in str(e.value)
    state = loader.state_dict()
    fresh = PackedDataLoader(paths, **kw)
    fresh.load_state_dict(state)
    got += [b["input_ids"].clone() for b in fresh]
    assert len(got) == len(ref) and all(bool((a == b).all()) for a, b in zip(got, ref))


def test_loader_on_a_half_written_pack_directory(tmp_path, seed):
    from packloader import PackedDataLoader

    src = write_arrow(tmp_path / "a.arrow", random_sequences(50, seed=seed, max_len=60))
    out = tmp_path / "out"
    pack(src, out, capacity=64)
    (out / "index.json").unlink()  # as while packing, or after a kill
    with pytest.raises(DataError, match="not a finished pre-packed directory"):
        PackedDataLoader(str(out), batch_size=2)
    with pytest.raises(DataError, match="not a finished pre-packed directory"):
        PrepackedDataset(out)


# -------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kw, msg", [
    ({"capacity": True}, "capacity"),
    ({"capacity": 2**31 - 1}, r"capacity must be an int in \[1, 16777216\]"),
    ({"capacity": 2**63 + 5}, "capacity"),
    ({"capacity": 2**70}, "capacity"),
    ({"capacity": 4.0}, "capacity"),
    ({"rank": 1.5, "world_size": 2}, "rank must be an int"),
    ({"world_size": True}, "world_size must be an int"),
    ({"timeout": -1}, "timeout"),
])
def test_loader_arguments(tmp_path, kw, msg):
    from packloader import PackedDataLoader

    p = write_arrow(tmp_path / "a.arrow", random_sequences(5, seed=0, max_len=20))
    with pytest.raises(ValueError, match=msg):
        PackedDataLoader(p, **kw)


@pytest.mark.parametrize("kw, msg", [
    ({"workers": 0}, "workers must be an int >= 1"),
    ({"workers": -3}, "workers must be an int >= 1"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"capacity": 2**31 - 1}, "capacity"),
    ({"capacity": 2**70}, "capacity"),
    ({"capacity": 2**24 + 1}, "MAX_CAPACITY"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"max_items_per_bin": 0}, "max_items_per_bin"),
])
def test_pack_arguments(tmp_path, kw, msg):
    p = write_arrow(tmp_path / "a.arrow", random_sequences(5, seed=0, max_len=20))
    with pytest.raises(ValueError, match=msg):
        pack(p, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()  # nothing written for bad settings


@pytest.mark.parametrize("args, msg", [
    (["--workers", "0"], "workers"), (["--workers", "-3"], "workers"), (["--seed", "-1"], "seed"),
    (["--capacity", str(2**70)], "capacity"), (["--capacity", str(2**31 - 1)], "capacity"),
])
def test_pack_cli_arguments(tmp_path, capsys, args, msg):
    from packloader.cli import main

    p = write_arrow(tmp_path / "a.arrow", random_sequences(5, seed=0, max_len=20))
    assert main(["pack", p, "--out", str(tmp_path / "out"), "-q", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{msg} must be" in err and "Traceback" not in err


def test_one_rule_for_empty_and_zero_length_shards(tmp_path):
    empty = write_arrow(tmp_path / "empty.arrow", [])
    zeros = write_arrow(tmp_path / "zeros.arrow", [np.zeros(0, np.int32)] * 4)
    good = write_arrow(tmp_path / "good.arrow", random_sequences(10, seed=0, max_len=20))
    for bad in (empty, zeros):
        with pytest.raises(DataError, match=rf"{os.path.basename(bad)}: empty shard .* no tokens"):
            pack([good, bad], tmp_path / "out", capacity=64)
    rep = pack([good, empty, zeros], tmp_path / "out", capacity=64, allow_empty=True)
    assert rep.sequences == 10 + 4 and rep.empty == 4
    assert rep.tokens == sum(len(s) for s in random_sequences(10, seed=0, max_len=20))


def test_prepare_truncated_or_binary_input_names_the_file(tmp_path):
    from packloader.prepare import prepare_jsonl
    src = write_jsonl(tmp_path / "in.jsonl", 200)
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(open(src, "rb").read()))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[: len(gz.read_bytes()) // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read input"):
        prepare_jsonl(cut, tmp_path / "o1", tokenizer=TOK, quiet=True)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DataError, match=r"bin\.jsonl"):
        prepare_jsonl(binary, tmp_path / "o2", tokenizer=TOK, quiet=True)
    # a file name that is not UTF-8: the message shows it escaped, the CLI prints it
    odd = os.path.join(os.fsencode(tmp_path), b"odd\xff.jsonl")
    with open(odd, "wb") as f:
        f.write(b"\xff\xfe not json\n")
    r = cli("prepare", os.fsdecode(odd), "--tokenizer", TOK, "--out", tmp_path / "o3", "-q")
    assert r.returncode == 1 and "odd\\xff.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_glob_characters_in_a_literal_path(tmp_path, seed):
    seqs = random_sequences(20, seed=seed, max_len=40)
    p = write_arrow(tmp_path / "br[ack]et.arrow", seqs)
    q = write_arrow(tmp_path / "a{1,2}.arrow", seqs)
    assert resolve_sources(p) == [p] and resolve_sources(q) == [q]
    assert pack(p, tmp_path / "out", capacity=64).sequences == 20
    import glob

    assert resolve_sources(glob.escape(str(tmp_path)) + "/br[[]ack]et.arrow") == [p]


def test_numba_cache_falls_back_with_one_warning(tmp_path, seed):
    """No writable cache location (read-only install, unwritable home): import and pack still work."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import numba.core.caching as c\n"
        "for n in ('InTreeCacheLocator', 'InTreeCacheLocatorFsAgnostic', 'UserWideCacheLocator',\n"
        "          'IPythonCacheLocator', 'ZipCacheLocator'):\n"
        "    getattr(c, n).from_function = classmethod(lambda cls, f, p: None)\n")
    src = write_arrow(tmp_path / "a.arrow", random_sequences(30, seed=seed, max_len=60))
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", HOME=str(tmp_path / "nohome"),
               TMPDIR=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run(CLI + ["pack", src, "--capacity", "64", "--out", str(tmp_path / "out"), "-q"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    warnings = [x for x in r.stderr.splitlines() if "Numba cache" in x]
    assert len(warnings) == 1 and "packloader-numba-cache" in warnings[0], r.stderr


def test_vocab_size_names_file_and_row(tmp_path):
    seqs = random_sequences(10, seed=0, max_len=30, vocab=100)
    seqs[6][2] = 150
    for fmt, p in (("arrow", write_arrow(tmp_path / "v.arrow", seqs)), ("tar", write_tar(tmp_path / "v.tar", seqs))):
        with pytest.raises(DataError, match=rf"v\.{fmt}, row 6: 'input_ids' has id 150 at position 2 .*vocab_size=100"):
            pack(p, tmp_path / f"out-{fmt}", capacity=64, vocab_size=100)
        assert pack(p, tmp_path / f"ok-{fmt}", capacity=64, vocab_size=151).sequences == 10
    r = cli("pack", tmp_path / "v.arrow", "--capacity", 64, "--vocab-size", 100, "--out", tmp_path / "o", "-q")
    assert r.returncode == 1 and "row 6" in r.stderr
