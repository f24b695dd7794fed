"""packloader._outdir: the one temp-file-and-rename helper, checksums computed while writing."""
from __future__ import annotations

import os
import types

import numpy as np
import pyarrow as pa
import pytest

from packloader import _outdir
from packloader._outdir import (STATE_DIR, ChecksumFile, atomic_path, atomic_write_text, file_checksum,
                                remove_stale_temps, temp_path)


class Boom(RuntimeError):
    pass


def _all_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("beside", [False, True])
@pytest.mark.parametrize("fsync", [False, True])
def test_atomic_path_replaces_on_success_and_leaves_the_old_file_on_failure(tmp_path, beside, fsync):
    target = tmp_path / "sub" / "file.bin"
    with atomic_path(target, fsync=fsync, beside=beside) as tmp:  # creates the parent directory
        assert not os.path.exists(target)
        with open(tmp, "wb") as f:
            f.write(b"first")
    assert target.read_bytes() == b"first"
    with pytest.raises(Boom):
        with atomic_path(target, fsync=fsync, beside=beside) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"second, half written")
            raise Boom()
    assert target.read_bytes() == b"first"
    leftovers = [n for n in _all_files(tmp_path) if ".tmp-" in n]
    assert leftovers == []


def test_temp_paths(tmp_path):
    p = tmp_path / "out" / "part.arrow"
    t = temp_path(p)
    assert t == os.path.join(tmp_path, "out", STATE_DIR, "tmp", f"part.arrow.tmp-{os.getpid()}")
    assert os.path.isdir(os.path.dirname(t))
    assert temp_path(tmp_path / STATE_DIR / "job.json") == os.path.join(tmp_path, STATE_DIR, "tmp",
                                                                         f"job.json.tmp-{os.getpid()}")
    assert temp_path(p, beside=True) == os.path.join(tmp_path, "out", f".part.arrow.tmp-{os.getpid()}")


def test_killed_writer_temp_is_removed_by_the_next_run(tmp_path):
    dead = os.path.join(tmp_path, STATE_DIR, "tmp", "x.arrow.tmp-999999999")
    os.makedirs(os.path.dirname(dead))
    open(dead, "wb").close()
    assert remove_stale_temps(tmp_path) == 1
    assert not os.path.exists(os.path.dirname(dead))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_temps_of_an_unreaped_or_reused_pid_are_removed_and_a_live_writers_kept(tmp_path):
    """A killed writer its parent has not reaped yet (a zombie: kill(pid, 0) still succeeds) left a temp; a
    pid taken since by a process started after the temp's last write did not write it: both temps are stale
    (a re-run after a kill once kept such a temp). A live writer's own temp stays."""
    import subprocess
    import sys
    import time
    tdir = os.path.join(tmp_path, STATE_DIR, "tmp")
    os.makedirs(tdir)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while (_outdir._proc_stat(zombie.pid) or ("Z",))[0] != "Z" and time.time() < deadline:
        time.sleep(0.05)                       # exited, not yet reaped (no wait() until the end)
    os.kill(zombie.pid, 0)                     # still reachable: what kept its temp before
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        paths = {"zombie": os.path.join(tdir, f"a.arrow.tmp-{zombie.pid}"),
                 "reused": os.path.join(tdir, f"b.arrow.tmp-{live.pid}"),
                 "writing": os.path.join(tdir, f"job.json.tmp-{live.pid}")}
        for path in paths.values():
            open(path, "wb").close()
        old = time.time() - 3600               # written an hour before the live process started
        os.utime(paths["reused"], (old, old))
        assert remove_stale_temps(tmp_path) == 2
        assert sorted(os.listdir(tdir)) == [os.path.basename(paths["writing"])]
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_atomic_write_text(tmp_path):
    atomic_write_text(tmp_path / "a.json", "{\"é\": 1}")
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == "{\"é\": 1}"


@pytest.mark.parametrize("sizes", [[0], [5, 0, 7], [3 << 20], [1, (1 << 20) + 1, 17, 2 << 20, 3]])
def test_checksum_file_matches_reading_the_file_back(tmp_path, sizes):
    """Small writes are checksummed inline, large ones on the crc thread while they are written: the
    chained result is the file's crc32 either way."""
    rng = np.random.default_rng(sum(sizes))
    path = tmp_path / "f.bin"
    with ChecksumFile(path) as f:
        for n in sizes:
            buf = rng.integers(0, 256, n, dtype=np.uint8)
            assert f.write(buf) == n
            buf[:] = 0  # the caller may reuse its buffer once write returned
    assert f.closed and f.size == sum(sizes) == os.path.getsize(path)
    assert f.checksum == file_checksum(path)


def test_checksum_file_under_pyarrow(tmp_path):
    path = tmp_path / "t.arrow"
    schema = pa.schema([("x", pa.int32())])
    with ChecksumFile(path) as raw, pa.PythonFile(raw, mode="w") as sink, pa.ipc.new_file(sink, schema) as w:
        for k in range(3):
            w.write_batch(pa.record_batch([pa.array(np.arange(k, k + 400_000, dtype=np.int32))], schema=schema))
    assert raw.checksum == file_checksum(path)
    assert raw.size == os.path.getsize(path)
    with pa.memory_map(str(path)) as src:
        assert pa.ipc.open_file(src).read_all().num_rows == 1_200_000


def test_checksum_file_write_error_propagates(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    f = ChecksumFile(path)

    class Full:
        closed = False

        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            self.closed = True

    f._file = Full()
    with pytest.raises(OSError, match="No space"):
        f.write(np.zeros(2 << 20, np.uint8))
    with pytest.raises(OSError, match="No space"):
        f.write(b"abc")
    f.close()


def test_loader_state_write_failure_leaves_no_temp(tmp_path):
    """The Trainer mixin saves the loader state atomically: a failure leaves neither a partial state
    file nor its temp file (it used to leave ``packloader_state.json.tmp``)."""
    from packloader import hf

    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    fake = types.SimpleNamespace(train_loader=types.SimpleNamespace(state_dict=lambda: {"bad": object()}))
    with pytest.raises(TypeError):
        hf.PackedTrainerMixin._save_loader_state(fake, str(ckpt))
    assert os.listdir(ckpt) == []
    fake.train_loader.state_dict = lambda: {"step": 3}
    hf.PackedTrainerMixin._save_loader_state(fake, str(ckpt))
    assert os.listdir(ckpt) == [hf.LOADER_STATE_NAME]


def test_crc_thread_is_per_process():
    t = _outdir._crc_thread()
    assert t is _outdir._crc_thread()
    assert t._pid == os.getpid()


@pytest.mark.parametrize("first, second", [("pack", "prepare"), ("prepare", "pack")])
def test_allow_nonempty_never_rewrites_the_other_tools_marker(tmp_path, first, second):
    """Issue 36, defect 5: ``prepare --allow-nonempty`` into a ``pack`` directory (or the reverse) used to
    rewrite ``.packloader/owner.json``, and neither tool could maintain the directory afterwards."""
    import json

    from packloader.demo import TOKENIZER, data_path
    from packloader.errors import DataError
    from packloader.pack_writer import pack_dataset
    from packloader.prepare import prepare_jsonl
    from tests.packloader.conftest import random_sequences, write_arrow
    from tests.packloader.test_data_safety import write_jsonl

    src = write_arrow(tmp_path / "a.arrow", random_sequences(30, seed=0, max_len=60))
    text = write_jsonl(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"

    def run(tool, **kw):
        if tool == "pack":
            return pack_dataset(src, out, capacity=64, quiet=True, **kw)
        return prepare_jsonl(text, out, tokenizer=data_path(TOKENIZER), quiet=True, **kw)

    run(first)
    marker = out / STATE_DIR / "owner.json"
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if n != STATE_DIR}
    assert json.loads(marker.read_text())["tool"] == first
    with pytest.raises(DataError, match=rf"belongs to 'packloader {first}' .*never into another packloader "
                                        "tool's directory"):
        run(second, allow_nonempty=True)
    assert json.loads(marker.read_text())["tool"] == first
    assert {n: (out / n).read_bytes() for n in os.listdir(out) if n != STATE_DIR} == before
    run(first)  # still maintained by its own tool
