"""Collation of packed rows (packloader.batch) against a plain-Python twin."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from packloader.batch import BATCH_KEYS, IGNORE_INDEX, collate_numpy, collate_packed, padding_row_layout


def twin(input_ids, labels, offsets, seq_lens):
    """Token-by-token reference of the documented layout."""
    B, L = input_ids.shape
    out_ids = [[0] * L for _ in range(B)]
    out_lab = [[0] * L for _ in range(B)]
    pos = [[0] * L for _ in range(B)]
    seg = [[0] * L for _ in range(B)]
    cu = [0]
    for b in range(B):
        t = 0
        segs = list(seq_lens[offsets[b]:offsets[b + 1]])
        if sum(segs) < L:
            segs.append(L - sum(segs))
            pad_from = len(segs) - 1
        else:
            pad_from = len(segs)
        for s, n in enumerate(segs):
            for j in range(n):
                x = int(input_ids[b][t + j])
                out_ids[b][t + j] = x
                pos[b][t + j] = j
                seg[b][t + j] = s
                if s >= pad_from or j == 0:
                    out_lab[b][t + j] = IGNORE_INDEX
                else:
                    out_lab[b][t + j] = int(labels[b][t + j]) if labels is not None else x
            t += n
            cu.append(cu[-1] + n)
    n_loss = sum(v != IGNORE_INDEX for row in out_lab for v in row)
    return out_ids, out_lab, pos, seg, cu, max(np.diff(cu)), n_loss


@st.composite
def packed_rows(draw):
    B = draw(st.integers(1, 5))
    L = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens, offsets = [], [0]
    for _ in range(B):
        room = L if draw(st.booleans()) else int(rng.integers(0, L + 1))
        while room > 0 and rng.random() < 0.8:
            n = int(rng.integers(1, room + 1))
            lens.append(n)
            room -= n
        offsets.append(len(lens))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    ids = rng.integers(0, 1000, (B, L)).astype(dtype)
    labels = None
    if draw(st.booleans()):
        labels = ids.copy()
        labels[rng.random((B, L)) < 0.3] = IGNORE_INDEX
    return ids, labels, np.array(offsets, np.int64), np.array(lens, np.int32)


@settings(max_examples=150, deadline=None)
@given(packed_rows())
def test_collate_matches_python_twin(case):
    ids, labels, offsets, lens = case
    got = collate_numpy(ids, labels, offsets, lens)
    w_ids, w_lab, w_pos, w_seg, w_cu, w_max, w_loss = twin(ids, labels, offsets, lens)
    assert got["input_ids"].tolist() == w_ids
    assert got["labels"].tolist() == w_lab
    assert got["position_ids"].tolist() == w_pos
    assert got["seq_idx"].tolist() == w_seg
    assert got["cu_seqlens"].tolist() == w_cu
    assert got["max_seqlen"] == w_max
    assert got["num_loss_tokens"] == w_loss == int((got["labels"] != IGNORE_INDEX).sum())
    assert got["cu_seqlens"][-1] == ids.size


def test_keys_shapes_dtypes_match_the_documented_table():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50, (3, 16)).astype(np.int32)
    out = collate_packed(ids, None, np.array([0, 2, 3, 3]), np.array([5, 7, 16]))
    dtypes = {"int64": torch.int64, "int32": torch.int32}
    for key, (shape, dtype) in BATCH_KEYS.items():
        v = out[key]
        if dtype is None:
            assert isinstance(v, int), key
        else:
            assert v.dtype == dtypes[dtype], key
            if shape == "[B, L]":
                assert tuple(v.shape) == (3, 16), key
    # row 2 is all padding (no sequences): one segment of L
    assert out["cu_seqlens"].tolist() == [0, 5, 12, 16, 32, 48]
    assert out["labels"][2].eq(IGNORE_INDEX).all()
    assert out["position_ids"][2].tolist() == list(range(16))
    assert set(out) == set(BATCH_KEYS)


def test_hf_compat_names():
    ids = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    out = collate_packed(ids, None, np.array([0, 2]), np.array([3, 5]), hf_compat=True)
    assert out["cu_seq_lens_q"].tolist() == out["cu_seq_lens_k"].tolist() == [0, 3, 8]
    assert out["max_length_q"] == out["max_length_k"] == 5
    assert out["cu_seq_lens_q"].dtype == torch.int32


def test_source_labels_are_kept_but_first_tokens_masked():
    ids = np.array([[7, 8, 9, 10, 11, 0]], np.int32)
    labels = np.array([[-100, -100, 9, 10, 11, 0]], np.int32)  # a prompt-masked label column
    out = collate_packed(ids, labels, np.array([0, 2]), np.array([3, 2]), return_tensors="np")
    assert out["labels"].tolist() == [[-100, -100, 9, -100, 11, -100]]
    assert out["num_loss_tokens"] == 2


def test_padding_rows_carry_no_loss():
    ids, labels, offs, lens = padding_row_layout(2, 10)
    out = collate_numpy(ids, labels, offs, lens)
    assert out["num_loss_tokens"] == 0
    assert out["cu_seqlens"].tolist() == [0, 10, 20]


@pytest.mark.parametrize("lens, offsets, msg", [
    ([5, 6], [0, 2], "row 0"),          # 11 > 10
    ([4, 0], [0, 2], "row 0"),          # zero length
    ([3, 4, 9], [0, 2, 3, 3], None),    # fine
    ([3, 4, 11], [0, 0, 2, 3], "row 2"),
])
def test_bad_rows_name_the_row(lens, offsets, msg):
    B = len(offsets) - 1
    ids = np.zeros((B, 10), np.int32)
    if msg is None:
        collate_numpy(ids, None, np.array(offsets), np.array(lens))
    else:
        with pytest.raises(ValueError, match=msg):
            collate_numpy(ids, None, np.array(offsets), np.array(lens))


def test_shape_errors():
    with pytest.raises(ValueError, match="2-D"):
        collate_numpy(np.zeros(5, np.int32), None, np.array([0, 0]), np.array([], np.int32))
    with pytest.raises(ValueError, match="labels shape"):
        collate_numpy(np.zeros((2, 5), np.int32), np.zeros((2, 4), np.int32), np.array([0, 0, 0]), np.array([]))
    with pytest.raises(ValueError, match="B\\+1"):
        collate_numpy(np.zeros((2, 5), np.int32), None, np.array([0, 0]), np.array([], np.int32))
    with pytest.raises(ValueError, match="return_tensors"):
        collate_packed(np.zeros((1, 5), np.int32), None, np.array([0, 0]), np.array([], np.int32),
                       return_tensors="tf")


def test_raw_buffer_round_trip_and_collate_raw():
    """The one-buffer form a worker sends (packloader.batch.raw_alloc) collates to the same batch as the
    arrays it holds, with and without labels."""
    from packloader.batch import collate_raw, raw_alloc, raw_views

    rng = np.random.default_rng()
    for has_labels in (False, True):
        B, L = 3, 20
        lens = np.array([5, 7, 20, 4], np.int32)
        offs = np.array([0, 2, 3, 4])
        buf, ids, lab, off, sl = raw_alloc(B, L, len(lens), has_labels)
        assert buf.dtype == np.int32 and (lab is not None) == has_labels
        ids[:] = rng.integers(0, 1000, (B, L))
        if has_labels:
            lab[:] = np.where(rng.random((B, L)) < 0.3, IGNORE_INDEX, ids)
        off[:], sl[:] = offs, lens
        v_ids, v_lab, v_off, v_sl = raw_views(buf.copy())
        assert np.array_equal(v_ids, ids) and np.array_equal(v_off, offs) and np.array_equal(v_sl, lens)
        got = collate_raw(torch.from_numpy(buf), hf_compat=True)
        want = collate_packed(ids.copy(), None if lab is None else lab.copy(), offs, lens, hf_compat=True)
        assert set(got) == set(want)
        for k in want:
            assert (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_collation_equals_plain():
    rng = np.random.default_rng()
    ids = rng.integers(0, 50, (2, 32)).astype(np.int32)
    offs, lens = np.array([0, 2, 3]), np.array([10, 12, 32], np.int32)
    plain = collate_packed(ids, None, offs, lens, hf_compat=True)
    pinned = collate_packed(ids, None, offs, lens, hf_compat=True, pin_memory=True)
    for k, v in plain.items():
        if isinstance(v, torch.Tensor):
            assert pinned[k].is_pinned() and torch.equal(pinned[k], v), k
        else:
            assert pinned[k] == v, k
