"""Hypothesis fuzz of the shard readers (Arrow IPC file and stream, Parquet, WebDataset tar) with random
truncations and corruptions (issue 16).

A shard of random sequences (with labels) is written once per format; each example damages a copy
(cut at any byte; flip bytes anywhere; zero a range; append bytes) and reads it through
:func:`packloader.sources.open_shard` (lengths, then every token and label). Every case must end in one
of:

* **exact**: the original sequences and labels, all of them;
* **error**: a :class:`~packloader.errors.DataError` whose message names the file;

and for a *corruption* of the payload of a format that carries no checksum of its data (Arrow IPC,
tar), a third outcome is possible and counted, not hidden:

* **changed**: the same number of sequences is read but some values differ (a flipped token id; the
  format cannot tell), or **changed-lengths**: the same number of sequences with other boundaries (a
  flipped list offset that stays in range). Truncations must never end here, and nothing may be read *silently shorter or
  longer* (a lost or invented sequence) from a truncated file.

Parquet is written with page checksums (as ``packloader prepare`` writes it) and verified on read.
Any other exception (a crash, an ``ArrowInvalid`` escaping, an ``IndexError``) fails the test.
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloader.errors import DataError
from packloader.sources import open_shard
from tests.packloader.conftest import random_sequences, sft_labels, write_arrow, write_tar

FORMATS = ("arrow", "stream", "parquet", "tar")
EXAMPLES = int(os.environ.get("PACKLOADER_FUZZ_EXAMPLES", "120"))
_ORIGINAL: dict = {}
OUTCOMES: Counter = Counter()


def original(fmt: str):
    """(file bytes, sequences, labels, suffix) of the undamaged shard of ``fmt``."""
    if fmt not in _ORIGINAL:
        seqs = random_sequences(40, seed=7, max_len=60)
        labels = sft_labels(seqs, seed=8)
        d = tempfile.mkdtemp()
        if fmt == "arrow":
            p = write_arrow(os.path.join(d, "x.arrow"), seqs, labels, batch_rows=9)
        elif fmt == "stream":
            p = write_arrow(os.path.join(d, "x.arrows"), seqs, labels, batch_rows=9, stream=True)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            from tests.packloader.conftest import make_table

            p = os.path.join(d, "x.parquet")
            pq.write_table(make_table(seqs, labels), p, row_group_size=11, write_page_checksum=True)
        else:
            p = write_tar(os.path.join(d, "x.tar"), seqs, labels)
        _ORIGINAL[fmt] = (open(p, "rb").read(), seqs, labels, os.path.splitext(p)[1])
    return _ORIGINAL[fmt]


def read_back(path):
    with open_shard(path) as shard:
        lengths = shard.lengths().copy()
        b = shard.read_all()
        toks = [b.sequence(i).copy() for i in range(len(b))]
        labs = [b.label_sequence(i).copy() for i in range(len(b))]
    return lengths, toks, labs


def classify(fmt: str, data: bytes, name: str) -> str:
    _, seqs, labels, suffix = original(fmt)
    d = tempfile.mkdtemp()
    path = os.path.join(d, f"damaged-{name}{suffix}")
    with open(path, "wb") as f:
        f.write(data)
    try:
        lengths, toks, labs = read_back(path)
    except DataError as e:
        assert f"damaged-{name}" in str(e), f"error does not name the file: {e}"
        return "error"
    finally:
        os.remove(path)
        os.rmdir(d)
    same_count = len(toks) == len(seqs) and len(lengths) == len(seqs)
    exact = same_count and all(np.array_equal(a, b) for a, b in zip(toks, seqs)) and all(
        np.array_equal(a, b) for a, b in zip(labs, labels)) and np.array_equal(lengths, [len(s) for s in seqs])
    if exact:
        return "exact"
    if not same_count:
        return "lost"
    same_lengths = np.array_equal(lengths, [len(s) for s in seqs])
    return "changed" if same_lengths else "changed-lengths"


def _check(fmt, outcome, kind):
    OUTCOMES[(fmt, kind, outcome)] += 1
    assert outcome != "lost", f"{fmt}: a {kind} read silently with sequences lost or invented"
    if kind == "truncate":
        assert outcome in ("exact", "error"), f"{fmt}: a truncated file read silently changed ({outcome})"
    if fmt == "parquet":
        assert outcome in ("exact", "error"), "parquet (page checksums): a corruption read silently changed"


fuzz = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("fmt", FORMATS)
@fuzz
@given(data=st.data())
def test_truncation(fmt, data):
    raw = original(fmt)[0]
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    _check(fmt, classify(fmt, raw[:cut], "t"), "truncate")


@pytest.mark.parametrize("fmt", FORMATS)
@fuzz
@given(data=st.data())
def test_corruption(fmt, data):
    raw = bytearray(original(fmt)[0])
    how = data.draw(st.sampled_from(["flip", "zero", "append"]), label="how")
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="n_flips")):
            pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
            raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
    elif how == "zero":
        a = data.draw(st.integers(0, len(raw) - 1), label="start")
        n = data.draw(st.integers(1, 600), label="length")
        raw[a:a + n] = bytes(len(raw[a:a + n]))
    else:
        raw += data.draw(st.binary(min_size=1, max_size=600), label="tail")
    _check(fmt, classify(fmt, bytes(raw), "c"), "corrupt")


def test_undamaged_reads_exactly():
    for fmt in FORMATS:
        assert classify(fmt, original(fmt)[0], "ok") == "exact"
