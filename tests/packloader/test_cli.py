"""The ``packloader`` command line: prepare / pack / report / demo, in-process through
``packloader.cli.main`` and through the installed entry point; exit codes and error messages."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from packloader.cli import main
from packloader.demo import CORPUS, TOKENIZER, data_path, run_demo
from packloader.prepacked import PrepackedDataset
from packloader.report import PackingReport
from tests.packloader.conftest import assert_packed_matches, random_sequences, sft_labels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def entry_point() -> list[str]:
    """The installed ``packloader`` console script (beside this interpreter), else ``python -m``."""
    exe = os.path.join(os.path.dirname(sys.executable), "packloader")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return [exe]
    found = shutil.which("packloader")
    return [found] if found else [sys.executable, "-m", "packloader.cli"]


def shards(factory, seed, n=3, fmt="arrow", labels=False, max_len=300):
    paths, seqs, labs = [], {}, {}
    for k in range(n):
        s = random_sequences(50, seed=seed + k, max_len=max_len)
        lab = sft_labels(s, seed=seed + 50 + k) if labels else None
        p = factory.write(fmt, f"shard-{k:03d}.{'tar' if fmt == 'tar' else fmt}", s, lab)
        paths.append(p)
        seqs[p], labs[p] = s, lab
    return paths, seqs, labs


def test_pack_and_report(shard_factory, tmp_path, seed, capsys):
    paths, seqs, labs = shards(shard_factory, seed, labels=True)
    out = tmp_path / "packed"
    pattern = str(shard_factory.root / "shard-{000..002}.arrow")
    rc, stdout, stderr = run(capsys, "pack", pattern, "--out", out, "--capacity", 512, "--algorithm", "bfd", "-q")
    assert rc == 0 and stderr == "" and stdout == ""  # -q: nothing but errors
    rows = assert_packed_matches(out, seqs, labs)
    index = json.load(open(out / "index.json"))
    assert index["capacity"] == 512 and index["algorithm"] == "bfd" and index["total_rows"] == rows

    rc, stdout, _ = run(capsys, "report", out, "--json")
    assert rc == 0
    d = json.loads(stdout)
    assert d == index["report"]
    assert d["rows"] == rows and 0 < d["efficiency"] <= 1
    assert PackingReport.from_dict(d).to_dict() == d

    rc, stdout, _ = run(capsys, "report", out)
    assert rc == 0 and f"{rows:,}" in stdout and "padding tokens" in stdout and stdout.startswith("+--")
    assert "efficiency" in stdout and "rows over lower bound" in stdout and "unpacked, batch 8" in stdout
    rc, stdout, stderr = run(capsys, "report", out, "-q")
    assert (rc, stdout, stderr) == (0, "", "")

    png = tmp_path / "plots" / "lengths.png"
    rc, stdout, _ = run(capsys, "report", out, "--plot", png)
    assert rc == 0 and f"plot: {png}" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png2 = tmp_path / "p2.png"
    rc, stdout, _ = run(capsys, "report", out, "--json", "--plot", png2)
    assert rc == 0 and json.loads(stdout)["rows"] == rows and png2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pack_options_reach_pack_dataset(shard_factory, tmp_path, seed, capsys):
    paths, seqs, labs = shards(shard_factory, seed, fmt="tar", labels=True, max_len=400)
    empty = shard_factory.arrow("zz-empty.arrow", [])
    out = tmp_path / "o"
    rc, stdout, stderr = run(capsys, "pack", *paths, empty, "--out", out, "--capacity", 300, "--algorithm",
                             "next_fit", "--overflow", "split", "--global", "--no-labels", "--rows-per-file", 9,
                             "--max-items-per-bin", 4, "--allow-empty", "--json")
    assert rc == 0, stderr
    rep = json.loads(stdout)  # --json: stdout is the report alone
    s = json.load(open(out / "index.json"))["settings"]
    assert (s["capacity"], s["algorithm"], s["overflow"], s["global_packing"], s["labels_column"],
            s["rows_per_file"], s["max_items_per_bin"], s["allow_empty"]) == (300, "next_fit", "split", True, None,
                                                                             9, 4, True)
    assert rep["split"] == sum(int(len(x) > 300) for v in seqs.values() for x in v) and rep["max_seqs_per_row"] <= 4
    assert "packing" in stderr  # progress / log lines go to stderr, not into the JSON
    assert_packed_matches(out, {**seqs, empty: []})  # --no-labels: labels are the inputs
    # --token-column, --workers, --seed
    col = shard_factory.arrow("c.arrow", random_sequences(30, seed=seed), column="tokens")
    rc, _, stderr = run(capsys, "pack", col, "--out", tmp_path / "c", "--token-column", "tokens", "--seed", 3,
                        "--workers", 2, "--algorithm", "ffd", "-q")
    assert rc == 0, stderr
    assert json.load(open(tmp_path / "c" / "index.json"))["settings"]["seed"] == 3


def test_prepare_cli(tmp_path, capsys):
    import gzip

    src = tmp_path / "in.jsonl"
    with gzip.open(data_path(CORPUS), "rt") as f:
        src.write_text("".join(next(f) for _ in range(130)))
    out = tmp_path / "tok"
    rc, stdout, stderr = run(capsys, "prepare", src, "--tokenizer", data_path(TOKENIZER), "--fields",
                             "question,answer", "--out", out, "--format", "webdataset", "--shard-size", 50,
                             "--mask-prompt", "-q")
    assert rc == 0 and stderr == "" and stdout == ""
    rc, stdout, stderr = run(capsys, "prepare", src, "--tokenizer", data_path(TOKENIZER), "--fields",
                             "question,answer", "--out", out, "--format", "webdataset", "--shard-size", 50,
                             "--mask-prompt")
    listed = stdout.split()
    assert listed == [str(out / f"shard-{k:05d}.tar") for k in range(3)]
    from packloader.sources import open_shard

    assert [len(open_shard(p)) for p in listed] == [50, 50, 30]
    assert all(open_shard(p).has_labels for p in listed)
    rc, stdout, stderr = run(capsys, "prepare", src, "--tokenizer", data_path(TOKENIZER), "--out",
                             tmp_path / "a", "--limit", 10, "--no-eos")
    assert rc == 0 and "10 records" in stderr
    assert len(open_shard(stdout.split()[0])) == 10


def test_errors_exit_1_with_clear_message(shard_factory, tmp_path, seed, capsys):
    good = shard_factory.arrow("good.arrow", random_sequences(20, seed=seed, max_len=100))
    seqs = random_sequences(20, seed=seed, max_len=100)
    seqs[13] = np.arange(700, dtype=np.int32)
    long = shard_factory.arrow("long.arrow", seqs)
    neg = random_sequences(20, seed=seed, max_len=100)
    neg[6] = neg[6].copy()
    neg[6][0] = -1
    negp = shard_factory.tar("neg.tar", neg)
    cases = [
        (["pack", str(tmp_path / "missing-{0..3}.arrow"), "--out", tmp_path / "x"], ["missing-0.arrow"]),
        (["pack", long, "--out", tmp_path / "x", "--capacity", 512], [long, "row 13", "--overflow"]),
        (["pack", good, negp, "--out", tmp_path / "x"], [negp, "row 6", "negative"]),
        (["pack", good, "--out", tmp_path / "x", "--capacity", 0], ["capacity"]),
        (["pack", good, "--out", tmp_path / "x", "--token-column", "ids"], [good, "'ids' not found"]),
        (["report", tmp_path / "x"], ["index.json"]),
        (["report", tmp_path / "nowhere"], ["not a directory"]),
        (["prepare", tmp_path / "none.jsonl", "--tokenizer", data_path(TOKENIZER), "--out", tmp_path / "p"],
         ["none.jsonl", "no such input file"]),
    ]
    for argv, needles in cases:
        rc, stdout, stderr = run(capsys, *argv)
        assert rc == 1, (argv, stderr)
        assert stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in stderr, stderr
        for n in needles:
            assert str(n) in stderr, (n, stderr)
    # an index without a report (e.g. written by another tool) is refused cleanly
    run(capsys, "pack", good, "--out", tmp_path / "ok", "-q")
    idx = json.load(open(tmp_path / "ok" / "index.json"))
    del idx["report"]
    json.dump(idx, open(tmp_path / "ok" / "index.json", "w"))
    rc, _, stderr = run(capsys, "report", tmp_path / "ok")
    assert rc == 1 and "no packing report" in stderr


def test_usage_errors_exit_2(tmp_path, capsys):
    for argv in ([], ["frobnicate"], ["pack", "x.arrow"], ["pack", "x.arrow", "--out", "o", "--algorithm", "magic"],
                 ["pack", "x.arrow", "--out", "o", "--capacity", "lots"], ["report"], ["prepare", "x.jsonl"]):
        rc, stdout, stderr = run(capsys, *argv)
        assert rc == 2, argv
        assert "usage:" in (stderr + stdout)
    rc, stdout, _ = run(capsys, "--version")
    assert rc == 0 and re.fullmatch(r"packloader \d+\.\d+\.\d+\S*\n", stdout)
    rc, stdout, _ = run(capsys, "pack", "--help")
    assert rc == 0 and "--capacity" in stdout and "--global" in stdout


def test_entry_point_subprocess(shard_factory, tmp_path, seed):
    paths, seqs, _ = shards(shard_factory, seed, fmt="parquet")
    out = tmp_path / "packed"
    cmd = entry_point()
    p = subprocess.run(cmd + ["pack", *paths, "--out", str(out), "--capacity", "400"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "efficiency" in p.stdout and "packing 3 shard(s)" in p.stderr  # not a terminal: plain log lines
    assert_packed_matches(out, seqs)
    p = subprocess.run(cmd + ["report", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and json.loads(p.stdout)["sequences"] == 150
    p = subprocess.run(cmd + ["pack", str(tmp_path / "nothing.arrow"), "--out", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "nothing.arrow" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["pack"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "usage:" in p.stderr


def _column_values(stdout: str, label: str) -> list[str]:
    line = next(x for x in stdout.splitlines() if x.startswith(f"| {label}"))
    return [c.strip() for c in line.strip().strip("|").split("|")[1:]]


def test_demo_end_to_end(tmp_path):
    """``packloader demo`` on a fresh directory through the entry point: finishes well inside a minute,
    prints the next_fit and bfd reports side by side, writes the PNG; bfd packs at least as tightly."""
    out = tmp_path / "demo"
    t0 = time.perf_counter()
    p = subprocess.run(entry_point() + ["demo", "--out", str(out)], capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    print(f"packloader demo took {elapsed:.1f} s (wall, including interpreter start)")
    assert p.returncode == 0, p.stderr
    assert elapsed < 60
    header = next(x for x in p.stdout.splitlines() if "next_fit" in x and "bfd" in x)
    assert header.index("next_fit") < header.index("bfd")
    eff = [float(v.rstrip(" %")) for v in _column_values(p.stdout, "efficiency")]
    rows = [int(v.replace(",", "")) for v in _column_values(p.stdout, "rows ")]
    seqs = _column_values(p.stdout, "sequences")
    assert len(eff) == 2 and eff[1] >= eff[0] and rows[1] <= rows[0]
    assert seqs[0] == seqs[1] == "4,000"
    assert "every token matches its source" in p.stdout
    png = out / "lengths.png"
    assert f"plot: {png}" in p.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for alg in ("next_fit", "bfd"):
        with PrepackedDataset(out / f"packed-{alg}") as ds:
            assert ds.algorithm == alg and ds.capacity == 2048 and len(ds) == rows[("next_fit", "bfd").index(alg)]
    # a re-run in-process reuses every output and returns the same figures
    reports = run_demo(out, quiet=True, stream=open(os.devnull, "w"))
    assert reports["bfd"].efficiency >= reports["next_fit"].efficiency
    assert [reports[a].rows for a in ("next_fit", "bfd")] == rows
    assert all(r.reused_files == r.files > 0 for r in reports.values())


def test_demo_data_is_embedded_with_licences():
    import gzip

    corpus, tokenizer = data_path(CORPUS), data_path(TOKENIZER)
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) >= 2000 and all(r["question"] and "####" in r["answer"] for r in recs)
    with gzip.open(tokenizer, "rt", encoding="utf-8") as f:
        assert json.load(f)["model"]["type"] == "BPE"
    notice = open(os.path.join(os.path.dirname(corpus), "NOTICE.md"), encoding="utf-8").read()
    assert "MIT" in notice and "Apache" in notice


def test_demo_small_in_process(tmp_path, capsys):
    rc, stdout, stderr = run(capsys, "demo", "--out", tmp_path / "d", "--limit", 300, "--capacity", 1024,
                             "--no-plot", "-q")
    assert (rc, stdout, stderr) == (0, "", "")
    rc, stdout, stderr = run(capsys, "demo", "--out", tmp_path / "d", "--limit", 300, "--capacity", 1024,
                             "--no-plot")
    assert rc == 0
    assert "one-time Numba compilation" in stdout and "unpacked in batches of 8" in stdout
    assert "padding saved vs unpacked" not in stdout
    assert "300 GSM8K problems" in stdout and "capacity 1024" in stdout
    assert not (tmp_path / "d" / "lengths.png").exists()
    eff = [float(v.rstrip(" %")) for v in _column_values(stdout, "efficiency")]
    assert eff[1] >= eff[0]


def test_report_into_a_closed_pipe_writes_the_plot_and_exits_0(shard_factory, tmp_path, seed):
    """``packloader report DIR --json --plot x.png | head -3``: no "Broken pipe" error, status 0, PNG written."""
    paths, _, _ = shards(shard_factory, seed)
    out = tmp_path / "packed"
    assert main(["pack", *map(str, paths), "--out", str(out), "--capacity", "512", "-q"]) == 0
    png = tmp_path / "x.png"
    cmd = " ".join(f"'{c}'" for c in [sys.executable, "-m", "packloader.cli", "report", str(out), "--json",
                                       "--plot", str(png)])
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | head -3"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    assert "Broken pipe" not in p.stderr and "Error" not in p.stderr
    assert len(p.stdout.splitlines()) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a reader that is gone before anything is written (no race with the pipe's buffer): the same
    png.unlink()
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | true"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_has_descriptions_and_defaults(capsys):
    for cmd, words in (("report", ["index.json", "--batch-size", "default: the one stored by pack, 8"]),
                       ("demo", ["GSM8K", "next_fit and bfd", "(default: demo_out)"]),
                       ("pack", ["default: 1)", "--workers", "(default: 1000)", "(default: bfd)",
                                 "(default: error)", "(default: 4096)"])):
        rc, stdout, _ = run(capsys, cmd, "--help")
        text = " ".join(stdout.split())
        assert rc == 0
        for w in words:
            assert w in text, (cmd, w)
        assert "(default: None)" not in text and "(default: False)" not in text


def test_index_stores_absolute_source_paths(shard_factory, tmp_path, seed, monkeypatch):
    paths, _, _ = shards(shard_factory, seed, n=2)
    monkeypatch.chdir(shard_factory.root)
    rel = [os.path.basename(p) for p in paths]
    out = tmp_path / "packed"
    assert main(["pack", *rel, "--out", str(out), "-q"]) == 0
    index = json.load(open(out / "index.json"))
    assert index["source_paths"] == "absolute"
    assert index["sources"] == [os.path.abspath(p) for p in paths]
    monkeypatch.chdir(tmp_path)  # provenance resolves from anywhere
    with PrepackedDataset(out) as ds:
        assert all(os.path.isfile(p) for p in ds.sources)


def test_report_batch_size_recomputes_the_baseline(shard_factory, tmp_path, seed, capsys):
    paths, seqs, _ = shards(shard_factory, seed, n=2)
    out = tmp_path / "packed"
    assert main(["pack", *map(str, paths), "--out", str(out), "--capacity", "512", "--global", "-q"]) == 0
    rc, stdout, _ = run(capsys, "report", out, "--json", "--batch-size", 4)
    d = json.loads(stdout)
    L = np.array([len(x) for p in paths for x in seqs[p]])
    L = L[L > 0]
    want = sum(int(L[i:i + 4].max()) * len(L[i:i + 4]) for i in range(0, len(L), 4))
    assert rc == 0 and d["baseline_batch_size"] == 4 and d["batch_padded_slots"] == want
    stored = json.load(open(out / "index.json"))["report"]
    assert stored["baseline_batch_size"] == 8
    assert stored["batch_padded_slots"] == sum(int(L[i:i + 8].max()) * len(L[i:i + 8]) for i in range(0, len(L), 8))
