"""benchmarks/bench_ops.py and benchmarks/_trace.py at a toy size on the CPU: every timed callable of the scan and the
functional-API parts runs (the reference kernels stand in for the CUDA ones; the timers are replaced), so a change of
an op's signature breaks this test, not the next GPU run. The numbers come from the GPU run in
benchmarks/results/RESULTS.md."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_ops  # noqa: E402
import ops  # noqa: E402,F401  (registers torch.ops.packloader)


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench_ops with its CUDA-event timers replaced by one plain call (returning 1 ms), its tensors on the CPU."""
    calls = []

    def run_once(fn, *args, **kwargs):
        fn()
        calls.append(fn)
        return 1.0

    monkeypatch.setattr(bench_ops, "bench", run_once)
    monkeypatch.setattr(bench_ops, "bench_reps", run_once)
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: real_randn(*a, **{n: v for n, v in k.items() if n != "device"}))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    args = argparse.Namespace(batch=2, dim=8, seqlen=32, dstate=4, width=4, warmup=1, iters=1, conv_iters=1,
                              conv_reps=1, deterministic=False)
    pos, _ = bench_ops.packed_position_ids(2, 32, lo=3, hi=6)
    return args, pos, calls


def test_scan_part_runs_every_timed_call(cpu_bench):
    args, pos, calls = cpu_bench
    rows = []
    ours_f, ours_fb, _, up_f, up_fb = bench_ops.time_scan(args, pos, lambda *r, **k: rows.append(r))
    assert ours_f == ours_fb == 1.0 and len(calls) >= 4
    phases = {(r[1], r[2]) for r in rows}
    assert ("ours (packed, position_ids)", "bwd") in phases and ("ours via packed_selective_scan", "fwd+bwd") in phases


def test_functional_part_times_kernels_position_ids_and_boundaries(cpu_bench):
    args, pos, calls = cpu_bench
    got = bench_ops.time_functional(args, pos, lambda *r, **k: None)
    assert set(got) == {(op, how) for op in ("causal_conv1d", "selective_scan")
                        for how in ("kernels", "position_ids", "boundaries")}
    assert len(calls) == 6


def test_trace_call_summarises_one_call(tmp_path, monkeypatch):
    import _trace
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    a = torch.randn(64, 64)
    out = tmp_path / "t.json.gz"
    summary = _trace.trace_call(lambda: a @ a, str(out), "matmul")
    assert out.stat().st_size > 0
    assert summary["label"] == "matmul" and summary["wall_ms"] > 0 and summary["kernels"] == 0
    assert _trace._union_ms([(0, 1000), (500, 2500), (3000, 4000)]) == 3.5
