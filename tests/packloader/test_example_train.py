"""Smoke tests of examples/train_packed_mamba.py: it trains for a few steps on the embedded demo corpus
(one process, and two under torchrun with DDP on gloo), and a run resumed from its checkpoint prints
exactly the losses of the uninterrupted run."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_packed_mamba.py")
STEP = re.compile(r"^step\s+(\d+)\s+epoch\s+(\d+)\s+loss\s+([0-9.]+)", re.M)


def run(cmd, cwd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def losses(out: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(3)) for m in STEP.finditer(out)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("example") / "work")  # the demo corpus is tokenized here once


def test_example_trains_and_resumes_exactly(workdir, tmp_path):
    base = [sys.executable, EXAMPLE, "--workdir", workdir, "--threads", "1"]
    full = run(base + ["--steps", "3"], tmp_path)
    assert "ops.PackedMamba" in full
    ref = losses(full)
    assert [s for s, _ in ref] == [1, 2, 3]
    first = float(ref[0][1])
    assert abs(first - math.log(50280)) < 1.0, first  # untrained: about uniform over the vocabulary
    ckpt = str(tmp_path / "ckpt.pt")
    part = run(base + ["--steps", "2", "--save", ckpt], tmp_path)
    assert "saved" in part and os.path.isfile(ckpt)
    rest = run(base + ["--steps", "3", "--resume", ckpt], tmp_path)
    assert losses(part) + losses(rest) == ref
    # --steps at or below the checkpoint's step: says so, trains nothing, exits 0
    for steps in ("2", "1"):
        idle = run(base + ["--steps", steps, "--resume", ckpt], tmp_path)
        assert "nothing to do" in idle and "at step 2" in idle and "--steps 3 or more" in idle
        assert losses(idle) == []


def test_example_help_shows_defaults(workdir, tmp_path):
    base = [sys.executable, EXAMPLE, "--workdir", workdir, "--threads", "1"]
    out = run(base + ["--help"], tmp_path)
    for default in ("(default: 20)", "(default: 512)", "(default: 50280)", "(default: error)"):
        assert default in out


def test_example_token_id_beyond_vocab_size_is_a_clear_error(workdir, tmp_path):
    base = [sys.executable, EXAMPLE, "--workdir", workdir, "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    proc = subprocess.run(base + ["--steps", "1", "--vocab-size", "1000"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "IndexError" not in proc.stderr and "is >= --vocab-size 1000" in proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
def test_example_under_torchrun_with_ddp(workdir, tmp_path):
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE,
               "--workdir", workdir, "--steps", "2", "--device", "cpu"], tmp_path)
    assert "2 rank(s)" in out
    steps = losses(out)
    assert [s for s, _ in steps] == [1, 2] and all(math.isfinite(float(v)) for _, v in steps)
