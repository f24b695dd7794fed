"""Smoke test of benchmarks/bench_packing.py: its --quick mode runs and writes a consistent JSON."""
import importlib.util
import json
import pathlib

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_packing.py"
ALGOS = ["bfd", "ffd", "first_fit", "next_fit", "online"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_packing", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_rows(rows, capacity, total_tokens, n_items):
    for r in rows:
        name = r["algorithm"]
        assert r["capacity"] == capacity, name
        assert r["total_tokens"] == total_tokens, name  # every algorithm places every token
        assert r["items"] == n_items, name
        # efficiency is consistent with the row count
        assert round(r["rows"] * capacity * r["efficiency"]) == total_tokens, name
        assert r["lower_bound"] == -(-total_tokens // capacity)
        assert r["rows"] >= r["lower_bound"], name
        assert r["gap_rows"] == r["rows"] - r["lower_bound"], name
        assert r["seconds"] > 0 and r["seconds"] <= r["seconds_median"] + 1e-12, name
        assert r["items_per_s"] == pytest.approx(n_items / r["seconds"]), name


def test_quick_run_writes_consistent_json(bench, tmp_path, shared_data, capsys):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print("seed", seed)
    out = tmp_path / "packing.json"
    res = bench.main(["--quick", "--out", str(out), "--seed", str(seed), "--shared-data", str(shared_data)])
    text = capsys.readouterr().out
    assert "algorithm" in text and "efficiency" in text and str(out) in text
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["repeat"] == 1
    assert data["targets"] and all(t["met"] is None for t in data["targets"])  # not judged in --quick

    ln = data["lognormal"]
    assert ln["n"] == 20_000 and ln["seed"] == seed and ln["capacity"] == 4096
    lengths = bench.lognormal_lengths(20_000, seed)
    assert ln["total_tokens"] == int(lengths.sum())
    names = [r["algorithm"] for r in ln["rows"]]
    if ln["lightbinpack"]["available"]:
        assert names == ALGOS + ["lightbinpack.obfd"]
        assert set(ln["lightbinpack"]["ratio_seconds"]) == {"bfd", "ffd"}
    else:
        assert names == ALGOS
        assert "lightbinpack" in ln["lightbinpack"]["reason"]
    _check_rows(ln["rows"], 4096, ln["total_tokens"], 20_000)
    rows = {r["algorithm"]: r["rows"] for r in ln["rows"]}
    assert rows["bfd"] <= rows["next_fit"] and rows["ffd"] <= rows["next_fit"]

    wk = data["wikipedia"]
    assert not wk.get("skipped")
    assert wk["scale_down"] == 100 and wk["capacity"] == 512
    counts = np.asarray(json.loads((shared_data / bench.WIKI_FILE).read_text())["wikipedia"]["counts"]) // 100
    assert wk["n"] == int(counts.sum())
    assert wk["total_tokens"] == int((np.arange(1, 513) * counts).sum())
    assert [r["algorithm"] for r in wk["rows"]] == ["bfd", "ffd", "online", "next_fit"]
    _check_rows(wk["rows"], 512, wk["total_tokens"], wk["n"])
    assert res["wikipedia"]["rows"] == wk["rows"]

    # overflow="carry" against "split": the same tokens, within 1 % efficiency, in the table
    carry = data["carry"]["rows"]
    assert [(r["dataset"], r["capacity"]) for r in carry[::2]] == [
        ("wikipedia", 512), ("wikipedia", 128), ("lognormal+5%x4-16", 4096), ("lognormal+5%x4-16", 2048)]
    for r in carry:
        assert r["efficiency_loss"] == pytest.approx(r["split_efficiency"] - r["carry_efficiency"])
        assert r["efficiency_loss"] <= bench.CARRY_MAX_EFFICIENCY_LOSS
        assert 0 < r["carry_schedule_efficiency"] <= r["carry_efficiency"] + 1e-12
        assert (r["cut"] == 0) == (r["dataset"] == "wikipedia" and r["capacity"] == 512)
    assert "overflow='carry' against 'split'" in text


def test_skips_wikipedia_and_lightbinpack_when_absent(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "load_lightbinpack", lambda: (None, "lightbinpack is not importable (test)"))
    out = tmp_path / "p.json"
    bench.main(["--quick", "--n", "3000", "--out", str(out), "--shared-data", str(tmp_path / "absent")])
    text = capsys.readouterr().out
    assert "skipping the Wikipedia part" in text and "absent" in text
    assert "lightbinpack is not importable" in text
    data = json.loads(out.read_text())
    assert data["wikipedia"]["skipped"] is True
    assert data["lognormal"]["lightbinpack"] == {"available": False,
                                                 "reason": "lightbinpack is not importable (test)"}
    assert [r["algorithm"] for r in data["lognormal"]["rows"]] == ALGOS
    _check_rows(data["lognormal"]["rows"], 4096, data["lognormal"]["total_tokens"], 3000)
