"""packloader.sources.tar: the vectorised index equals the general per-member indexer; the .npy header
has one definition; compatibility with the webdataset package both ways."""
from __future__ import annotations

import numpy as np
import pytest

from packloader.errors import DataError
from packloader.sources import TarShard, open_shard
from packloader.sources._npy import STANDARD_PARTS, header, parse_header
from packloader.sources.tar import write_webdataset_shard
from tests.packloader.conftest import random_sequences, sft_labels, write_tar

wds = pytest.importorskip("webdataset")  # a test dependency (the dev extra): compatibility both ways


# ---------------------------------------------------------------- vectorised tar index == general indexer


def _tar_from_members(path, members, *, fmt=None):
    import io
    import tarfile

    kw = {} if fmt is None else {"format": fmt}
    with tarfile.open(path, "w", **kw) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _npy(a) -> bytes:
    import io

    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _open_both(path, monkeypatch, **kw):
    """(shard indexed as usual, shard indexed by the general per-member loop, whether the first used the
    vectorised path); either may be a DataError instead of a shard."""
    import packloader.sources._tarindex as ti

    real = ti.index_common_case
    used = []

    def spy(*a, **k):
        r = real(*a, **k)
        used.append(r is not None)
        return r

    out = []
    for fn in (spy, lambda *a, **k: None):
        monkeypatch.setattr(ti, "index_common_case", fn)
        try:
            out.append(TarShard(path, **kw))
        except DataError as e:
            out.append(e)
    monkeypatch.setattr(ti, "index_common_case", real)
    return out[0], out[1], bool(used and used[0])


def _assert_same_index(a, b):
    if isinstance(a, DataError) or isinstance(b, DataError):
        assert isinstance(a, DataError) and isinstance(b, DataError) and str(a) == str(b)
        return
    for attr in ("keys", "_tok_dt", "_lab_dt", "has_labels", "_fast_tok", "_fast_lab"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for attr in ("_tok_off", "_tok_n", "_lab_off", "_lab_n"):
        x, y = getattr(a, attr), getattr(b, attr)
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y), attr
    try:
        ra = a.read_all()
    except DataError as e:  # e.g. -100 labels read as tokens: both refuse alike
        with pytest.raises(DataError) as eb:
            b.read_all()
        assert str(eb.value) == str(e)
        return
    rb = b.read_all()
    assert np.array_equal(ra.offsets, rb.offsets) and np.array_equal(ra.tokens, rb.tokens)
    assert (ra.labels is None) == (rb.labels is None)
    if ra.labels is not None:
        assert np.array_equal(ra.labels, rb.labels)


@pytest.mark.parametrize("case", ["plain", "labels_some_missing", "dtypes", "dirs_bare_npy", "prepare_writer",
                                  "other_members", "empty_sequences"])
def test_tar_vectorised_index_equals_general(shard_factory, monkeypatch, seed, case):
    rng = np.random.default_rng(seed)
    seqs = random_sequences(int(rng.integers(5, 80)), seed=seed, max_len=200)
    path = shard_factory.path(f"{case}.tar")
    if case == "plain":
        write_tar(path, seqs, sft_labels(seqs, seed=seed))
    elif case == "labels_some_missing":
        labs = [lab if rng.random() < 0.5 else None for lab in sft_labels(seqs, seed=seed)]
        write_tar(path, seqs, labs)
    elif case == "dtypes":
        dts = [np.int16, np.uint16, np.uint8, np.int64, np.uint32, np.int8, np.int32]
        members = []
        for i, s in enumerate(seqs):
            dt = dts[i % len(dts)]
            members.append((f"k{i:05d}.input_ids.npy", _npy((s % 100).astype(dt))))
            members.append((f"k{i:05d}.labels.npy", _npy((s % 100).astype(np.int64))))
        _tar_from_members(path, members)
    elif case == "dirs_bare_npy":
        write_tar(path, seqs, bare_npy=True, key_prefix="train/part.1/doc_")
    elif case == "prepare_writer":
        from packloader.prepare import write_webdataset_shard

        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
        write_webdataset_shard(path, offsets, np.concatenate(seqs), np.concatenate(sft_labels(seqs)))
    elif case == "other_members":
        members = [("README", b"no extension"), (".hidden.npy", _npy(np.arange(3)))]
        for i, s in enumerate(seqs):
            members += [(f"s{i}.json", b"{}"), (f"s{i}.INPUT_IDS.NPY", _npy(s)), (f"s{i}.txt", b"text")]
        _tar_from_members(path, members)
    elif case == "empty_sequences":
        seqs = [s if i % 3 else s[:0] for i, s in enumerate(seqs)]
        write_tar(path, seqs, sft_labels(seqs))
    fast, slow, used = _open_both(path, monkeypatch)
    assert used, "the vectorised index should handle this shard"
    _assert_same_index(fast, slow)
    fast2, slow2, _ = _open_both(path, monkeypatch, labels_column=None)
    _assert_same_index(fast2, slow2)
    fast3, slow3, used3 = _open_both(path, monkeypatch, token_column="labels")
    _assert_same_index(fast3, slow3)


@pytest.mark.parametrize("case", ["big_endian", "two_d", "float", "long_name", "directory", "no_tokens",
                                  "label_length", "duplicate", "bad_magic"])
def test_tar_unusual_shards_fall_back_to_general_indexer(shard_factory, monkeypatch, seed, case):
    import tarfile

    seqs = random_sequences(12, seed=seed, max_len=50, min_len=2)
    members = [(f"k{i:03d}.input_ids.npy", _npy(s)) for i, s in enumerate(seqs)]
    fmt = None
    if case == "big_endian":
        members[4] = ("k004.input_ids.npy", _npy(seqs[4].astype(">i4")))
    elif case == "two_d":
        members[4] = ("k004.input_ids.npy", _npy(seqs[4][:, None]))
    elif case == "float":
        members[4] = ("k004.input_ids.npy", _npy(seqs[4].astype(np.float32)))
    elif case == "long_name":
        members[4] = ("d" * 120 + ".input_ids.npy", members[4][1])
        fmt = tarfile.GNU_FORMAT
    elif case == "no_tokens":
        members[4] = ("k004.json", b"{}")
    elif case == "label_length":
        members.insert(5, ("k004.labels.npy", _npy(seqs[4][:-1])))
    elif case == "duplicate":
        members.insert(5, ("k004.input_ids.npy", _npy(seqs[4][:1])))
    elif case == "bad_magic":
        members[4] = ("k004.input_ids.npy", b"NOTNUMPY" + bytes(100))
    path = _tar_from_members(shard_factory.path(f"{case}.tar"), members, fmt=fmt)
    if case == "directory":
        with tarfile.open(path, "a") as tf:
            info = tarfile.TarInfo("somedir")
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
    fast, slow, used = _open_both(path, monkeypatch)
    assert not used
    _assert_same_index(fast, slow)
    if case in ("float", "no_tokens", "label_length", "bad_magic"):
        assert isinstance(fast, DataError) and fast.path == path and fast.row == 4




# ---------------------------------------------------------------- the .npy header: one definition


@pytest.mark.parametrize("n", [0, 1, 7, 10**9])
@pytest.mark.parametrize("dtype", ["<i4", "<i8", "|u1", "<u2"])
def test_npy_header_is_numpys(n, dtype):
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": (n,)})
    assert header(n, dtype) == buf.getvalue()
    h = header(n, dtype)
    assert h[:8] == STANDARD_PARTS[0] and h[10:].startswith(STANDARD_PARTS[1])
    assert h[10:].rstrip(b" \n") == b"".join([STANDARD_PARTS[1], dtype.encode(), STANDARD_PARTS[2], str(n).encode(),
                                               STANDARD_PARTS[3]])
    body = header(n, dtype) + bytes(n * np.dtype(dtype).itemsize if n < 10**6 else 0)
    if n < 10**6:
        assert parse_header(body, 0, len(body)) == (len(header(n, dtype)), n, np.dtype(dtype).str)


@pytest.mark.parametrize("bad, msg", [
    (b"NOTNUMPY" + bytes(100), "bad magic"),
    (header(5)[:-20] + b"garbage\n", "corrupt .npy header"),
    (header(5) + bytes(24), "has extra bytes"),
    (header(5) + bytes(19), "is truncated"),
    (header(5).replace(b"<i4", b"<f4") + bytes(20), "token ids must be integers"),
    (header(5).replace(b"(5,)", b"(5,2)") + bytes(40), "expected a 1-D array"),
])
def test_npy_parse_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        parse_header(bad, 0, len(bad))


def test_npy_parse_other_valid_headers():
    import io

    for a in (np.arange(6, dtype=">i2"), np.arange(6, dtype=np.int64).reshape(6, 1), np.arange(3, dtype="<u4")):
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, np.lib.format.header_data_from_array_1_0(a))
        raw = buf.getvalue() + a.tobytes()
        off, n, dt = parse_header(raw, 0, len(raw))
        assert n == a.size and np.array_equal(np.frombuffer(raw, dt, n, off), a.ravel())


# ---------------------------------------------------------------- webdataset compatibility, both ways


def _wds_samples(path):
    return list(wds.WebDataset(str(path), shardshuffle=False).decode())


def test_tar_matches_webdataset_library(shard_factory):
    import webdataset as wds

    seqs = random_sequences(25, seed=4)
    p = shard_factory.tar("w.tar", seqs, sft_labels(seqs))
    ours = open_shard(p)
    theirs = list(wds.WebDataset(p, shardshuffle=False).decode())
    assert [s["__key__"] for s in theirs] == ours.keys
    b = ours.read_all()
    for i, s in enumerate(theirs):
        assert np.array_equal(s["input_ids.npy"], b.sequence(i))
        assert np.array_equal(s["labels.npy"], b.label_sequence(i))




@pytest.mark.parametrize("writer", ["TarWriter", "ShardWriter"])
def test_our_reader_on_shards_webdataset_writes(tmp_path, seed, writer):
    seqs = random_sequences(40, seed=seed, max_len=200)
    labs = sft_labels(seqs, seed=seed)
    samples = [{"__key__": f"doc{i:05d}", "input_ids.npy": s, "labels.npy": lab, "meta.json": {"i": i}}
               for i, (s, lab) in enumerate(zip(seqs, labs))]
    if writer == "TarWriter":
        paths = [str(tmp_path / "w.tar")]
        with wds.TarWriter(paths[0]) as sink:
            for smp in samples:
                sink.write(smp)
    else:
        with wds.ShardWriter(str(tmp_path / "s-%03d.tar"), maxcount=15, verbose=0) as sink:
            for smp in samples:
                sink.write(smp)
        paths = sorted(str(p) for p in tmp_path.glob("s-*.tar"))
        assert len(paths) == 3
    got_seqs, got_labs, keys = [], [], []
    for p in paths:
        with open_shard(p) as sh:
            b = sh.read_all()
            keys += sh.keys
            got_seqs += [b.sequence(i).copy() for i in range(len(b))]
            got_labs += [b.label_sequence(i).copy() for i in range(len(b))]
    assert keys == [smp["__key__"] for smp in samples]
    assert all(np.array_equal(a, b) for a, b in zip(got_seqs, seqs)) and len(got_seqs) == len(seqs)
    assert all(np.array_equal(a, b) for a, b in zip(got_labs, labs))


def test_webdataset_reads_shards_prepare_writes(tmp_path, seed):
    seqs = random_sequences(30, seed=seed, max_len=150, min_len=0)
    labs = sft_labels(seqs, seed=seed)
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    p = write_webdataset_shard(tmp_path / "p.tar", offsets, np.concatenate(seqs).astype(np.int32),
                               np.concatenate(labs).astype(np.int32))
    theirs = _wds_samples(p)
    assert [s["__key__"] for s in theirs] == [f"{i:09d}" for i in range(len(seqs))]
    for s, want, lab in zip(theirs, seqs, labs):
        assert s["input_ids.npy"].dtype == np.int32
        assert np.array_equal(s["input_ids.npy"], want) and np.array_equal(s["labels.npy"], lab)
    # and Python's tarfile sees a valid archive with the same members
    import tarfile

    with tarfile.open(p) as tf:
        assert len(tf.getmembers()) == 2 * len(seqs)


# ------------------------------------------------------------------------- a key given twice (issue 36)


@pytest.mark.parametrize("case", ["same member twice", "same member twice, apart", "key again later",
                                  "other member twice"])
def test_tar_key_given_twice_is_an_error_naming_shard_and_key(tmp_path, monkeypatch, case):
    """Issue 36, defect 4: ``a.input_ids.npy`` twice used to drop the first sequence silently (in ``pack``
    and in the streaming loader); webdataset refuses such a shard ("duplicate file name"). Both indexers
    (vectorised and per member) refuse it, naming the shard and the key; so do ``pack`` and the loader."""
    from packloader import PackedDataLoader
    from packloader.pack_writer import pack_dataset

    a, b, c = (np.arange(k, k + 5 + k, dtype=np.int32) for k in range(3))
    members = {
        "same member twice": [("a.input_ids.npy", _npy(a)), ("a.input_ids.npy", _npy(b)), ("c.input_ids.npy", _npy(c))],
        "same member twice, apart": [("a.input_ids.npy", _npy(a)), ("a.json", b"{}"), ("a.input_ids.npy", _npy(b))],
        "key again later": [("a.input_ids.npy", _npy(a)), ("b.input_ids.npy", _npy(b)), ("a.input_ids.npy", _npy(c))],
        "other member twice": [("a.input_ids.npy", _npy(a)), ("a.json", b"{}"), ("a.json", b"{}"),
                               ("b.input_ids.npy", _npy(b))],
    }[case]
    path = _tar_from_members(tmp_path / "dup.tar", members)
    usual, general, _ = _open_both(path, monkeypatch)
    for err in (usual, general):
        assert isinstance(err, DataError), err
        assert err.path == path and "'a'" in err.reason and "twice" in err.reason
        assert err.member is not None and err.member.startswith("a.")
    with pytest.raises(DataError, match=r"dup\.tar.*'a'.*twice"):
        pack_dataset(path, tmp_path / "out", capacity=64, quiet=True)
    with pytest.raises(DataError, match=r"dup\.tar.*'a'.*twice"):
        PackedDataLoader(path, capacity=64, batch_size=1)
    if case == "same member twice":  # webdataset agrees that the shard is bad
        with pytest.raises(ValueError, match="duplicate file name"):
            list(wds.WebDataset(path, shardshuffle=False))


def test_tar_distinct_keys_sharing_a_prefix_are_fine(tmp_path, monkeypatch):
    members = [(f"{k}.input_ids.npy", _npy(np.arange(3, dtype=np.int32) + i)) for i, k in enumerate(["a", "a1", "b/a"])]
    path = _tar_from_members(tmp_path / "ok.tar", members)
    usual, general, vectorised = _open_both(path, monkeypatch)
    assert vectorised and usual.keys == general.keys == ["a", "a1", "b/a"]
