"""packloader.report: PackingReport figures against the packed data, JSON roundtrip, table, PNG."""
from __future__ import annotations

import dataclasses

import json
import os
import struct

import numpy as np
import pytest

from packloader.pack_writer import pack_dataset
from packloader.prepacked import PrepackedDataset
from packloader.report import (
    baseline_pieces,
    batch_padded_slots,
    FILL_BINS,
    LENGTH_BINS,
    PackingReport,
    fill_histogram,
    length_histogram,
    plot_reports,
    side_by_side,
)
from tests.packloader.conftest import random_sequences

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ref_length_hist(lengths, cap):
    """Independent twin: right-closed equal-width bins over (0, cap] by searchsorted on the edges
    (k * cap / 256 is exact in binary), one more bin for lengths above cap; empty ones not counted."""
    L = np.asarray(lengths)
    L = L[L > 0]
    edges = np.arange(LENGTH_BINS + 1) * (cap / LENGTH_BINS)
    out = np.zeros(LENGTH_BINS + 1, np.int64)
    for x in L.tolist():
        out[LENGTH_BINS if x > cap else int(np.searchsorted(edges, x, side="left")) - 1] += 1
    return out


def assert_png(path, min_w=200, min_h=100):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w >= min_w and h >= min_h
    import matplotlib.image as mpimg

    img = mpimg.imread(path)  # decodes the whole file: a truncated PNG fails here
    assert img.shape[:2] == (h, w)
    assert img[..., :3].std() > 0  # not a blank canvas


def test_from_lengths_by_hand():
    r = PackingReport.from_lengths([700, 300, 1000, 20, 0], capacity=1024, algorithm="bfd",
                                   row_fills=[1000, 1020], pieces_per_row=[2, 2])
    assert (r.sequences, r.empty, r.tokens, r.packed_tokens, r.rows, r.pieces) == (5, 1, 2020, 2020, 2, 4)
    assert r.efficiency == pytest.approx(2020 / 2048)
    assert r.padding_tokens == 28 and r.lower_bound == 2 and r.rows_over_lower_bound == 0
    assert (r.min_seqs_per_row, r.mean_seqs_per_row, r.max_seqs_per_row) == (2, 2.0, 2)
    assert (r.min_length, r.max_length, r.mean_length) == (20, 1000, 505.0)
    assert r.unpacked_rows == 4
    # the baseline: one batch of 8 (all four sequences), padded to its longest (1000)
    assert r.baseline_batch_size == 8 and r.batch_padded_slots == 4 * 1000
    assert r.baseline_padding == 4000 - 2020
    assert r.padding_saved == pytest.approx(1 - 28 / (4000 - 2020))
    assert sum(r.length_counts) == 4 and sum(r.fill_counts) == 2
    # 1000/1024 and 1020/1024 are both in the last fill bin (95 %, 100 %]
    assert r.fill_counts[-1] == 2


def test_histograms_against_twins(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([300, 1000, 2048, 4096]))
    lengths = np.concatenate([rng.integers(0, 2 * cap, 500), [1, cap, cap + 1, 0,
                                                              cap // LENGTH_BINS, cap // LENGTH_BINS + 1]])
    h = length_histogram(lengths, cap)
    assert h.shape == (LENGTH_BINS + 1,)
    assert np.array_equal(h, ref_length_hist(lengths, cap))
    assert h[-1] == (lengths > cap).sum() and h.sum() == (lengths > 0).sum()
    fills = rng.integers(1, cap + 1, 300)
    f = fill_histogram(fills, cap)
    want = np.zeros(FILL_BINS, np.int64)
    for u in fills.tolist():  # bin k holds fills in (k/F, (k+1)/F] of the capacity
        want[next(k for k in range(FILL_BINS) if u * FILL_BINS <= (k + 1) * cap)] += 1
    assert np.array_equal(f, want)


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_report_consistent_with_packed_data(shard_factory, tmp_path, seed, overflow):
    cap = 256
    rng = np.random.default_rng(seed)
    shards, all_lengths = [], []
    for k in range(3):
        seqs = random_sequences(int(rng.integers(40, 120)), seed=seed + k, max_len=400)
        seqs[int(rng.integers(len(seqs)))] = np.zeros(0, np.int32)
        shards.append(shard_factory.arrow(f"s{k}.arrow", seqs))
        all_lengths.append([len(s) for s in seqs])
    L = np.concatenate(all_lengths)
    out = tmp_path / "out"
    rep = pack_dataset(shards, out, capacity=cap, algorithm="bfd", overflow=overflow, quiet=True)
    with PrepackedDataset(out) as ds:
        _, _, offs, lens = ds.read_rows(0)
        fills = np.add.reduceat(lens, offs[:-1]).astype(np.int64)
        rows = len(ds)
    per_row = np.diff(offs)
    over = L > cap
    assert rep.rows == rows
    assert rep.sequences == L.size and rep.empty == (L == 0).sum() and rep.tokens == L.sum()
    assert rep.packed_tokens == fills.sum() == lens.sum()
    assert rep.efficiency == pytest.approx(fills.sum() / (rows * cap))
    assert rep.padding_tokens == rows * cap - fills.sum()
    assert rep.lower_bound == -(-fills.sum() // cap)
    assert rep.rows_over_lower_bound == rows - rep.lower_bound >= 0
    assert rep.pieces == len(lens)
    assert rep.mean_seqs_per_row == pytest.approx(per_row.mean())
    assert (rep.min_seqs_per_row, rep.max_seqs_per_row) == (per_row.min(), per_row.max())
    assert (rep.min_length, rep.max_length) == (L[L > 0].min(), L.max())
    assert rep.mean_length == pytest.approx(L.sum() / (L > 0).sum())
    assert np.array_equal(rep.length_counts, ref_length_hist(L, cap))
    assert np.array_equal(rep.fill_counts, fill_histogram(fills, cap))
    assert sum(rep.fill_counts) == rows
    nz = L[L > 0]
    assert rep.unpacked_rows == {"split": ((nz + cap - 1) // cap).sum(), "truncate": nz.size,
                                 "drop": (nz <= cap).sum()}[overflow]
    n_over = int(over.sum())
    assert (rep.split, rep.truncated, rep.dropped) == {
        "split": (n_over, 0, 0), "truncate": (0, n_over, 0), "drop": (0, 0, n_over)}[overflow]
    assert rep.lost_tokens == {"split": 0, "truncate": int((L[over] - cap).sum()),
                               "drop": int(L[over].sum())}[overflow]
    assert rep.packed_tokens == rep.tokens - rep.lost_tokens
    assert rep.sources == 3 and rep.files == 3
    assert rep.total_seconds > 0 and rep.tokens_per_second > 0
    assert rep.read_seconds >= 0 and rep.plan_seconds >= 0 and rep.write_seconds >= 0
    # the report stored in the directory is the one returned
    with PrepackedDataset(out) as ds:
        assert ds.report == rep


def test_combine_adds_up(seed):
    rng = np.random.default_rng(seed)
    cap = 512
    parts, Ls, fills, ppr = [], [], [], []
    for _ in range(4):
        L = rng.integers(0, 400, int(rng.integers(1, 50)))
        f = rng.integers(1, cap + 1, int(rng.integers(1, 20)))
        p = rng.integers(1, 6, len(f))
        parts.append(PackingReport.from_lengths(L, cap, "bfd", row_fills=f, pieces_per_row=p, read_seconds=0.5))
        Ls.append(L), fills.append(f), ppr.append(p)
    whole = PackingReport.from_lengths(np.concatenate(Ls), cap, "bfd", row_fills=np.concatenate(fills),
                                       pieces_per_row=np.concatenate(ppr), read_seconds=2.0)
    combined = PackingReport.combine(parts)
    # the padded-batches baseline batches each part's sequences on its own (per source file)
    assert combined.batch_padded_slots == sum(r.batch_padded_slots for r in parts)
    assert dataclasses.replace(combined, batch_padded_slots=whole.batch_padded_slots) == whole
    assert PackingReport.combine(parts, total_seconds=9.0).total_seconds == 9.0
    with pytest.raises(ValueError, match="capacities"):
        PackingReport.combine([parts[0], PackingReport(capacity=7, algorithm="bfd")])
    with pytest.raises(ValueError):
        PackingReport.combine([])


def test_to_dict_to_json_roundtrip(shard_factory, tmp_path, seed):
    seqs = random_sequences(200, seed=seed, max_len=600)
    p = shard_factory.tar("a.tar", seqs)
    rep = pack_dataset([p], tmp_path / "o", capacity=512, overflow="split", quiet=True)
    d = rep.to_dict()
    for key in ("sequences", "tokens", "rows", "efficiency", "padding_tokens", "rows_over_lower_bound",
                "lower_bound", "mean_seqs_per_row", "min_seqs_per_row", "max_seqs_per_row", "split",
                "truncated", "dropped", "lost_tokens", "total_seconds", "plan_seconds", "length_counts",
                "length_edges", "fill_counts", "padding_saved", "tokens_per_second", "capacity", "algorithm"):
        assert key in d, key
    assert d["efficiency"] == rep.efficiency and d["padding_tokens"] == rep.padding_tokens
    assert len(d["length_edges"]) == LENGTH_BINS + 1 and d["length_edges"][-1] == 512
    text = rep.to_json()
    assert json.loads(text) == json.loads(json.dumps(d))
    back = PackingReport.from_json(text)
    assert back == rep
    assert back.to_dict() == d
    assert PackingReport.from_dict({**d, "unknown_future_key": 1}) == rep


def test_terminal_table(shard_factory, tmp_path, seed):
    p = shard_factory.arrow("a.arrow", random_sequences(150, seed=seed, max_len=500))
    a = pack_dataset([p], tmp_path / "a", capacity=512, algorithm="next_fit", quiet=True)
    b = pack_dataset([p], tmp_path / "b", capacity=512, algorithm="bfd", quiet=True)
    text = str(b)
    lines = text.splitlines()
    assert len({len(x) for x in lines}) == 1  # a rectangle
    for label, value in (("sequences", "150"), ("rows", f"{b.rows:,}"),
                         ("efficiency", f"{100 * b.efficiency:.2f} %"),
                         ("padding tokens", f"{b.padding_tokens:,}"),
                         ("rows over lower bound", f"{b.rows_over_lower_bound:,}"),
                         ("seqs per row min/mean/max",
                          f"{b.min_seqs_per_row} / {b.mean_seqs_per_row:.2f} / {b.max_seqs_per_row}"),
                         ("split / truncated / dropped", "0 / 0 / 0"), ("tokens lost", "0")):
        line = next(x for x in lines if x.startswith(f"| {label}"))
        assert line.rstrip("|").rstrip().endswith(value), (label, line)
    both = side_by_side([a, b], titles=["next_fit", "bfd"])
    lines = both.splitlines()
    assert len({len(x) for x in lines}) == 1
    head = lines[1]
    assert head.index("next_fit") < head.index("bfd")
    rows_line = next(x for x in lines if x.startswith("| rows "))
    assert rows_line.split("|")[2].strip() == f"{a.rows:,}" and rows_line.split("|")[3].strip() == f"{b.rows:,}"
    assert str(PackingReport(capacity=64, algorithm="ffd"))  # an empty report renders too


def test_plot_png(shard_factory, tmp_path, seed):
    p = shard_factory.arrow("a.arrow", random_sequences(300, seed=seed, max_len=700))
    a = pack_dataset([p], tmp_path / "a", capacity=512, algorithm="next_fit", overflow="split", quiet=True)
    b = pack_dataset([p], tmp_path / "b", capacity=512, algorithm="bfd", overflow="split", quiet=True)
    out = b.plot(tmp_path / "plots" / "one.png")
    assert out == str(tmp_path / "plots" / "one.png")
    assert_png(out)
    both = plot_reports([a, b], tmp_path / "both.png", titles=["next_fit", "bfd"])
    assert_png(both)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    # short sequences (zoomed axis) and an empty report
    r = PackingReport.from_lengths([10, 20, 30], 4096, "bfd", row_fills=[60], pieces_per_row=[3])
    assert_png(r.plot(tmp_path / "short.png"))
    assert_png(PackingReport(capacity=64, algorithm="bfd").plot(tmp_path / "empty.png"))


def test_plot_needs_no_display_and_leaves_pyplot_alone(tmp_path):
    """No display: the PNG is still written; a session's chosen backend and open figures are untouched."""
    import subprocess
    import sys

    code = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt; plt.figure(); "
            "from packloader.report import PackingReport; "
            f"PackingReport.from_lengths([5, 9], 16, 'bfd', row_fills=[14]).plot({str(tmp_path / 'x.png')!r}); "
            "print(matplotlib.get_backend(), len(plt.get_fignums()))")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["svg", "1"]
    assert_png(tmp_path / "x.png")


def test_baselines_are_batches_padded_to_their_longest_not_to_capacity():
    """The headline compares with what a user would run: batches of B sequences padded to their longest
    (not every sequence padded to the capacity), and one sequence per step; beside the lower bound."""
    rng = np.random.default_rng(0)
    L = rng.integers(50, 444, 1000)  # GSM8K-like: nothing near the capacity
    cap = 2048
    r = PackingReport.from_lengths(L, cap, "bfd", row_fills=[cap] * int(L.sum() // cap) + [int(L.sum() % cap)])
    want = sum(int(L[i:i + 8].max()) * len(L[i:i + 8]) for i in range(0, len(L), 8))  # a twin
    assert r.batch_padded_slots == want
    assert r.baseline_padding == want - int(L.sum())
    assert r.baseline_padding < len(L) * cap - int(L.sum())  # far less than padding to capacity
    assert batch_padded_slots(L, 1) == int(L.sum())
    table = dict(r.rows_table())
    assert "padding saved vs unpacked" not in table
    assert table["unpacked, batch 8: padding"].startswith(f"{want - int(L.sum()):,} (")
    assert table["unpacked, batch 1: steps"] == "1,000 (no padding)"
    assert table["lower bound (rows)"] == f"{r.lower_bound:,}"
    r16 = PackingReport.from_lengths(L, cap, "bfd", row_fills=[int(L.sum())], baseline_batch_size=16)
    assert r16.batch_padded_slots > r.batch_padded_slots and "unpacked, batch 16: padding" in dict(r16.rows_table())
    # split pieces count as the sequences an unpacked loader would feed
    assert baseline_pieces([5, 25, 0, 10], 10).tolist() == [5, 10, 10, 5, 10]
    assert baseline_pieces([5, 25, 10], 10, "truncate").tolist() == [5, 10, 10]
    assert baseline_pieces([5, 25, 10], 10, "drop").tolist() == [5, 10]
