"""benchmarks/bench_shapes.py runs on the CPU (the reference kernels) and reports every variant of every shape."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_bench_shapes_tiny_runs_every_variant(tmp_path):
    import bench_shapes

    out = tmp_path / "shapes.json"
    result = bench_shapes.main(["--device", "cpu", "--tiny", "--out", str(out)])
    assert [(e["d_model"], e["batch"], e["seqlen"]) for e in result["results"]] == [(32, 1, 64), (32, 2, 64)]
    for e in result["results"]:
        assert set(e["ms"]) == {f"{m} {k}" for m, k in bench_shapes.COLUMNS}   # no upstream on the CPU
        assert all(v > 0 for v in e["ms"].values())
    assert json.loads(out.read_text())["results"][0]["ms"] == result["results"][0]["ms"]
    assert bench_shapes.parse_shapes("1024:1x4096,2048:2x16384") == [(1024, 1, 4096), (2048, 2, 16384)]
