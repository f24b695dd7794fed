"""packloader.place: the one placer of pieces into rows, checked against a pure-Python twin on random inputs."""
from __future__ import annotations

import numpy as np
import pytest

from packloader.batch import IGNORE_INDEX
from packloader.place import place_pieces, row_layout


def place_twin(src_ids, src_labels, src_start, length, dst_row, dst_col, out_ids, out_labels, mask_starts,
               pad_from):
    """What place_pieces does, one token at a time."""
    lab_src = src_ids if src_labels is None else src_labels
    for s, n, r, c in zip(src_start, length, dst_row, dst_col):
        for j in range(n):
            out_ids[r][c + j] = src_ids[s + j]
            if out_labels is not None:
                out_labels[r][c + j] = IGNORE_INDEX if (mask_starts and j == 0) else lab_src[s + j]
    if pad_from is not None:
        for r, f in enumerate(pad_from):
            for j in range(f, len(out_ids[r])):
                out_ids[r][j] = 0
                if out_labels is not None:
                    out_labels[r][j] = IGNORE_INDEX


def row_layout_twin(row_offsets, length):
    dst_row, dst_col, fill = [], [], []
    o0 = row_offsets[0]
    for r in range(len(row_offsets) - 1):
        col = 0
        for p in range(row_offsets[r] - o0, row_offsets[r + 1] - o0):
            dst_row.append(r)
            dst_col.append(col)
            col += length[p]
        fill.append(col)
    return dst_row, dst_col, fill


def random_rows(rng, n_rows, cap):
    """Row CSR offsets and piece lengths (rows may be empty, pieces may be 0 long) that fit ``cap``."""
    lengths, offsets = [], [0]
    for _ in range(n_rows):
        left = cap
        for _ in range(int(rng.integers(0, 5))):
            n = int(rng.integers(0, left + 1))
            lengths.append(n)
            left -= n
        offsets.append(len(lengths))
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


@pytest.mark.parametrize("seed", range(12))
def test_place_pieces_matches_python_twin(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(1, 40))
    n_rows = int(rng.integers(1, 9))
    offsets, length = random_rows(rng, n_rows, cap)
    base = int(rng.integers(0, 3))
    offsets = offsets + base  # a slice of a larger plan
    dst_row, dst_col, fill = row_layout(offsets, length)
    want = row_layout_twin(offsets.tolist(), length.tolist())
    assert [x.tolist() for x in (dst_row, dst_col, fill)] == [list(w) for w in want]
    n_src = int(length.sum()) + int(rng.integers(0, 50))
    src_ids = rng.integers(0, 1000, n_src, dtype=np.int32)
    src_lab = np.where(rng.random(n_src) < 0.3, IGNORE_INDEX, src_ids).astype(np.int32)
    src_start = np.array([rng.integers(0, n_src - n + 1) for n in length.tolist()], np.int64)
    perm = rng.permutation(len(length))  # any order of pieces lands the same way
    for labels in (None, src_lab):
        for mask in (False, True):
            for pad in (None, fill):
                for with_out_labels in (True, False):
                    init = rng.integers(-5, 5, (n_rows, cap), dtype=np.int32)  # padding left as it is
                    got_ids, got_lab = init.copy(), init.copy() if with_out_labels else None
                    place_pieces(src_ids, labels, src_start[perm], length[perm], dst_row[perm], dst_col[perm],
                                 got_ids, got_lab, mask_starts=mask, pad_from=pad)
                    w_ids = init.tolist()
                    w_lab = init.tolist() if with_out_labels else None
                    place_twin(src_ids.tolist(), None if labels is None else labels.tolist(), src_start.tolist(),
                               length.tolist(), dst_row.tolist(), dst_col.tolist(), w_ids, w_lab, mask,
                               None if pad is None else pad.tolist())
                    assert got_ids.tolist() == w_ids
                    if with_out_labels:
                        assert got_lab.tolist() == w_lab


@pytest.mark.parametrize("bad", ["src_end", "row_end", "row", "negative_col", "negative_length"])
def test_place_pieces_refuses_a_piece_outside_the_arrays(bad):
    src = np.arange(10, dtype=np.int32)
    out = np.zeros((2, 6), np.int32)
    piece = {"src_end": (8, 3, 0, 0), "row_end": (0, 4, 1, 3), "row": (0, 2, 2, 0), "negative_col": (0, 2, 0, -1),
             "negative_length": (0, -1, 0, 0)}[bad]
    with pytest.raises(ValueError, match="piece 1 .*reaches outside"):
        place_pieces(src, None, [0, piece[0]], [1, piece[1]], [0, piece[2]], [0, piece[3]], out, None)
    assert not out.any()  # nothing written


def test_place_pieces_checks_shapes():
    src = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="out_labels must be C-contiguous and shaped as out_ids"):
        place_pieces(src, None, [0], [1], [0], [0], np.zeros((2, 6), np.int32), np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="src_labels has 9"):
        place_pieces(src, src[:9], [0], [1], [0], [0], np.zeros((2, 6), np.int32))
    with pytest.raises(ValueError, match="pad_from"):
        place_pieces(src, None, [0], [1], [0], [0], np.zeros((2, 6), np.int32), pad_from=[1, 7])
