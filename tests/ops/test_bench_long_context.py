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


def test_kernel_cases_run_and_differ_only_where_a_state_is_carried():
    """The kernel part's cases (also what benchmarks/gpu/profile_states.sh profiles), at a toy width on the CPU's
    reference: no state used gives the plain output; a carried piece a row changes it, in the rows' first piece."""
    import torch
    args, dout, cases = bench.kernel_cases("cpu", b=2, d=4, n=16, L=1100)
    assert list(cases) == ["plain", "states, none used", "states, a carried piece a row"]
    outs = {}
    for name, (extra, bwd_extra) in cases.items():
        out, saved, _ = torch.ops.packloader.selective_scan_fwd(*args, *extra)
        grads = torch.ops.packloader.selective_scan_bwd(*args, saved, dout, False, *bwd_extra)
        assert all(torch.isfinite(g.float()).all() for g in grads if g is not None)
        outs[name] = out
    assert torch.equal(outs["states, none used"], outs["plain"])
    carried = outs["states, a carried piece a row"]
    assert not torch.equal(carried[..., :1000], outs["plain"][..., :1000])
    assert torch.equal(carried[..., 1000:], outs["plain"][..., 1000:])   # the second piece starts from zero
