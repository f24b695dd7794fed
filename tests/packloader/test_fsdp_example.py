"""examples/train_fsdp.py on the CPU with gloo (issue 35): a tiny Hugging Face Mamba sharded with FSDP2 over
2 processes takes the same steps as one process with the same global batch (up to the order of the
reductions), and a run resumed from its torch.distributed.checkpoint continues to the bit.

The processes are forked from the test (torch already imported: a few seconds, not torchrun's start-up);
each runs the example's ``main`` with torchrun's environment variables. Float32 parameters
(``--mixed-precision fp32``) so the comparison is tight; the bf16 policy is what the GPU runs."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import multiprocessing as mp
import os
import re
import socket
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_fsdp.py")
STEP = re.compile(r"^step (\d+) loss (\S+) loss_tokens (\d+)", re.M)
DEADLINE_S = 180

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="forks processes"),
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf extra)"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _example():
    spec = importlib.util.spec_from_file_location("train_fsdp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, argv: list, out_file: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    buf = io.StringIO()
    code = 1
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = _example().main(argv)
    except BaseException:
        import traceback

        buf.write(traceback.format_exc())
    with open(out_file, "w") as f:
        f.write(buf.getvalue())
    os._exit(code or 0)


def launch(tmp_path, world: int, argv: list, tag: str) -> list[tuple[int, str, int]]:
    """Run the example on ``world`` forked processes; rank 0's ``(step, loss repr, loss tokens)``."""
    ctx = mp.get_context("fork")
    port = _free_port()
    outs = [str(tmp_path / f"{tag}-rank{r}.log") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(r, world, port, argv, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    logs = [open(o).read() if os.path.exists(o) else "(no output)" for o in outs]
    assert not hung and all(p.exitcode == 0 for p in procs), f"{tag}: hung {hung}\n" + "\n".join(logs)
    return [(int(m[1]), m[2], int(m[3])) for m in STEP.finditer(logs[0])]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    _example().demo_source(str(d / "work"))  # tokenized once, before any fork
    return str(d / "work")


def test_fsdp_two_processes_match_one_and_resume_exactly(workdir, tmp_path):
    torch.set_num_threads(1)
    base = ["--device", "cpu", "--d-model", "32", "--layers", "2", "--d-state", "8", "--capacity", "128",
            "--workdir", workdir, "--mixed-precision", "fp32", "--threads", "1", "--lr", "3e-3", "--steps", "4"]
    ckpt = str(tmp_path / "ckpt")
    two = launch(tmp_path, 2, base + ["--batch-size", "2", "--save", ckpt, "--save-at", "2"], "two")
    assert [s for s, _, _ in two] == [1, 2, 3, 4]
    assert os.path.isfile(os.path.join(ckpt, "train_state.json")) and os.path.isfile(os.path.join(ckpt, ".metadata"))
    # one process, the same global batch (2 ranks x 2 rows = 4 rows): the same rows, so the same steps
    one = launch(tmp_path, 1, base + ["--batch-size", "4"], "one")
    assert [(s, n) for s, _, n in one] == [(s, n) for s, _, n in two]
    for (s, a, _), (_, b, _) in zip(one, two):
        assert abs(float(a) - float(b)) <= 1e-5 * abs(float(a)), (s, a, b)
    assert float(two[0][1]) == pytest.approx(10.83, abs=0.6)  # ln(50280): untrained, about uniform
    # resumed from the checkpoint of step 2 on 2 processes: steps 3 and 4 to the bit
    rest = launch(tmp_path, 2, base + ["--batch-size", "2", "--resume", ckpt], "rest")
    assert rest == two[2:]
    # the parameters kept gathered from the forward to the backward: the same numbers, to the bit
    kept = launch(tmp_path, 2, base + ["--batch-size", "2", "--no-reshard"], "kept")
    assert kept == two


def test_bench_fsdp_smoke_runs_and_reports(tmp_path):
    """benchmarks/bench_fsdp.py --smoke: 1 and 2 gloo processes, a tiny model, the table and its JSON."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_fsdp
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    doc = bench_fsdp.main(["--smoke", "--out-dir", str(tmp_path)])
    assert os.path.isfile(tmp_path / "fsdp.json") and doc["launches"] == [1, 2]
    rows = {(r["gpus"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(1, "packed"), (1, "dense"), (2, "packed"), (2, "dense")}
    for r in rows.values():
        assert r["tokens_per_s_per_gpu"] > 0 and r["ms_per_step"] > 0
    two = rows[(2, "packed")]
    assert len(two["losses"]) == 2 and len(two["reference_losses"]) == 2
    assert two["loss_vs_1gpu_max_rel"] < 1e-3, two  # the same global batch on one process
    assert two["packed_over_dense"] is not None and "| 2 | packed |" in doc["table"]
    assert doc["reshard_after_forward"] is True


def test_bench_fsdp_report_refuses_launches_with_different_resharding(tmp_path):
    """The table compares launches only where they shard alike (--no-reshard in one launch and not the other)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_fsdp
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    for gpus, no_reshard in ((1, False), (2, True)):
        doc = {"gpus": gpus, "results": [], "reference_losses": {}, "model": "hf", "gpu_name": "", "torch": "",
               "args": {"no_reshard": no_reshard}}
        (tmp_path / f"fsdp_{gpus}gpu.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="differ in --no-reshard"):
        bench_fsdp.report(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_example_on_two_gpus_bf16(workdir, tmp_path):
    """torchrun on 2 GPUs (NCCL, bf16 MixedPrecisionPolicy, mamba-ssm's model when it imports): the first
    losses equal one GPU's with the same global batch up to bf16 reduction order; the resumed run within
    the run-to-run spread of the GPU kernels (their backward may use atomics)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    base = [EXAMPLE, "--device", "cuda", "--d-model", "256", "--layers", "4", "--capacity", "512",
            "--workdir", workdir, "--steps", "4"]

    def run(n, extra):
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
               + base + extra)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [(int(m[1]), float(m[2]), int(m[3])) for m in STEP.finditer(proc.stdout)]

    ckpt = str(tmp_path / "ckpt")
    two = run(2, ["--batch-size", "2", "--save", ckpt, "--save-at", "2"])
    one = run(1, ["--batch-size", "4"])
    assert [(s, n) for s, _, n in one] == [(s, n) for s, _, n in two] and len(two) == 4
    for (s, a, _), (_, b, _) in zip(one, two):
        assert abs(a - b) <= 2e-3 * abs(a), (s, a, b)
    rest = run(2, ["--batch-size", "2", "--resume", ckpt])
    assert [s for s, _, _ in rest] == [3, 4]
    for (s, a, _), (_, b, _) in zip(rest, two[2:]):
        assert abs(a - b) <= 2e-3 * abs(a), (s, a, b)


def test_only_rank_0_prepares_the_demo_shards(tmp_path, monkeypatch):
    """Two ranks (threads here, a barrier between them): rank 0 runs the preparation, the other waits and reads the
    same shards; a second preparation into the same directory at the same time is what the lock refuses (on 2 GPUs
    every rank used to run it after the barrier)."""
    import sys
    import threading
    _example()   # puts examples/ on the path
    shared = sys.modules["train_packed_mamba"]
    calls = []
    monkeypatch.setattr(shared, "demo_shards", lambda workdir: calls.append(threading.current_thread().name))
    barrier = threading.Barrier(2)
    got = {}

    def rank(r):
        got[r] = shared.demo_source(str(tmp_path), r, barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == ["rank0"]
    assert got[0] == got[1] == str(tmp_path / "tokens" / "shard-*.arrow")
