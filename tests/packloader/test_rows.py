"""packloader.rows: both row sources answer ``build`` with the same Built, and the loader's iterable takes
any row source without asking which one it is."""
from __future__ import annotations

import numpy as np
import pytest

from packloader.batch import IGNORE_INDEX, raw_alloc, raw_views
from packloader.iterable import PackedIterable
from packloader.pack_writer import pack_dataset
from packloader.prepacked import PrepackedRows
from packloader.rows import Built
from packloader.sources import resolve_sources
from packloader.stream import StreamingRows
from tests.packloader.conftest import random_sequences, sft_labels, write_arrow

CAP = 64


@pytest.fixture
def sources(tmp_path):
    seqs = [random_sequences(40, seed=s, max_len=150) for s in (1, 2)]
    labels = [sft_labels(seqs[0], seed=3), None]  # one shard with labels, one without
    paths = [write_arrow(tmp_path / f"s{i}.arrow", seqs[i], labels[i], batch_rows=9) for i in range(2)]
    packed = tmp_path / "packed"
    pack_dataset(paths, packed, capacity=CAP, overflow="split", rows_per_file=5, quiet=True)
    streaming = StreamingRows(resolve_sources(paths), CAP, overflow="split", buffer_size=16)
    return {"streaming": streaming, "prepacked": PrepackedRows(packed)}, seqs, labels


@pytest.mark.parametrize("kind", ["streaming", "prepacked"])
def test_build_returns_the_same_shape_from_both_sources(sources, kind):
    """Built(raw, ids): every piece of sample_ids holds the named source tokens at its place in the raw
    rows, its labels are the source's (or its tokens), the row lengths are the pieces, padding rows empty."""
    rows_by_kind, seqs, labels = sources
    rows = rows_by_kind[kind]
    n = len(rows.epoch_rows(0, 3, True))
    batch_rows = np.array([n - 1, -1, 0, 2, -1], np.int64)
    built = rows.build(0, 3, True, batch_rows, want_ids=True)
    assert isinstance(built, Built) and built.raw.dtype == np.int32 and built.raw.ndim == 1
    assert set(built.ids) == ({"sample_ids", "row_ids"} if kind == "prepacked" else {"sample_ids"})
    assert all(v.dtype == np.int64 for v in built.ids.values())
    ids, lab, offs, lens = raw_views(built.raw)
    assert ids.shape == (len(batch_rows), CAP) and lab is not None
    table = built.ids["sample_ids"]
    assert table.shape == (len(lens), 5) and (table[:, 4] == lens).all()
    for b in range(len(batch_rows)):
        mine = table[table[:, 0] == b]
        assert len(mine) == offs[b + 1] - offs[b]
        assert (len(mine) == 0) == (batch_rows[b] < 0)
        col = 0
        for _, f, q, st, ln in mine.tolist():
            want = seqs[f][q][st:st + ln]
            assert (ids[b, col:col + ln] == want).all()
            src_lab = want if labels[f] is None else labels[f][q][st:st + ln]
            got = lab[b, col:col + ln]
            assert (got[1:] == src_lab[1:]).all()  # a piece's first label is masked (pre-packed) or not yet
            assert got[0] in (src_lab[0], IGNORE_INDEX)
            col += ln
        assert (ids[b, col:] == 0).all()
    assert rows.build(0, 3, True, batch_rows).ids == {}
    if kind == "prepacked":
        order = rows.order(0, 3, True)
        assert built.ids["row_ids"].tolist() == [int(order[r]) if r >= 0 else -1 for r in batch_rows]


class ListRows:
    """A third row source: fixed rows of one token value each, with an id table the loader has never heard
    of. The iterable must carry it through without asking what kind of source it is."""

    fingerprint, capacity, overflow_counts = "list", 8, {}

    def epoch_rows(self, seed, epoch, shuffle):
        return np.array([3, 5, 8, 1], np.int64)

    def build(self, seed, epoch, shuffle, rows, want_ids=False):
        lens = self.epoch_rows(seed, epoch, shuffle)
        real = [r for r in rows.tolist() if r >= 0]
        buf, ids, _, offs, seq_lens = raw_alloc(len(rows), self.capacity, len(real), False)
        k = 0
        for b, r in enumerate(rows.tolist()):
            offs[b + 1] = offs[b] + (r >= 0)
            if r >= 0:
                ids[b, :lens[r]] = r + 1
                seq_lens[k] = lens[r]
                k += 1
        return Built(buf, {"my_ids": np.asarray(rows, np.int64)} if want_ids else {})


def test_the_iterable_takes_any_row_source():
    it = PackedIterable(ListRows(), rank=0, world_size=1, batch_size=2, drop_last=False, seed=0, shuffle=False,
                        hf_compat=False, return_ids=True)
    batches = [it.collate(item) for item in it]
    assert [b["my_ids"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert batches[1]["input_ids"].tolist() == [[3] * 8, [4] + [0] * 7]
    assert batches[0]["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_warm_up_loads_the_placer_for_what_both_sources_pass(sources):
    """Forked workers inherit what warm_up loaded in the loader's process: a build must find its kernel
    signature there (else every worker loads it again at its first batch, every epoch)."""
    from packloader import place

    place.warm_up()
    warmed = set(place._place_kernel.signatures)
    rows_by_kind, _, _ = sources
    for rows in rows_by_kind.values():
        n = len(rows.epoch_rows(0, 0, True))
        rows.build(0, 0, True, np.arange(min(n, 4), dtype=np.int64))
    assert set(place._place_kernel.signatures) == warmed
