"""benchmarks/bench_long_context.py at a toy size on the CPU: both modes train from the same weights on the same rows,
the recall documents are what the task says, and the JSON and PNG are written (the numbers come from the GPU run in
benchmarks/results/RESULTS.md)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_long_context as bench  # noqa: E402


def test_recall_documents_end_by_recalling_their_keys():
    docs = bench.recall_docs(20, np.random.default_rng(0), 64, 30, 50, 8)
    k = bench.RECALL_KEYS
    for d in docs:
        assert 30 <= len(d) <= 50
        assert (d[:k] == d[-k:]).all() and d[-k - 1] == 1
        assert ((2 <= d[:k]) & (d[:k] < 10)).all() and (d[k:-k - 1] >= 10).all()


def test_learning_part_runs_both_modes_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "lc.json", tmp_path / "lc.png"
    res = bench.main(["--parts", "learning", "--l-steps", "3", "--train-docs", "40", "--eval-docs", "4",
                      "--l-min", "70", "--l-max", "90", "--l-d-model", "16", "--l-layers", "1",
                      "--out", str(out), "--plot", str(png)])
    got = json.loads(out.read_text())["learning"]
    assert png.stat().st_size > 0
    for mode in ("split", "carry"):
        assert got[mode]["steps"] == 3 and np.isfinite(got[mode]["heldout_answer_loss"])
        assert len(got[mode]["loss_by_position"]) == 90
    # the same initial weights and rows: the first steps differ only where a piece continues another
    assert res["learning"]["split"]["loss_by_position"] != res["learning"]["carry"]["loss_by_position"]
