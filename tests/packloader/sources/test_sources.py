"""packloader.sources: patterns, Arrow / Parquet / WebDataset readers, bad input."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloader.errors import DataError
from packloader.sources import (
    ArrowShard,
    ParquetShard,
    SequenceBatch,
    TarShard,
    open_shard,
)
from packloader.sources.arrow import list_arrays
from tests.packloader.conftest import make_table, random_sequences, sft_labels, write_arrow, write_tar


def read_back(shard, start=0):
    seqs, labs, starts = [], [], []
    for b in shard.iter_batches(start):
        assert isinstance(b, SequenceBatch)
        assert b.offsets.dtype == np.int64 and b.offsets[0] == 0
        assert b.tokens.dtype == np.int32 and len(b.tokens) == b.offsets[-1]
        assert b.row_start == start + len(seqs)
        starts.append(b.row_start)
        for i in range(len(b)):
            seqs.append(b.sequence(i).copy())
            labs.append(b.label_sequence(i).copy())
    return seqs, labs


# ---------------------------------------------------------------- readers


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "tar"])
@pytest.mark.parametrize("with_labels", [False, True])
def test_roundtrip_formats(shard_factory, fmt, with_labels):
    seqs = random_sequences(257, seed=3, max_len=200)
    seqs[10] = np.zeros(0, np.int32)  # an empty sequence is allowed (the packer drops it)
    labels = sft_labels(seqs) if with_labels else None
    kw = {"arrow": {"batch_rows": 50}, "parquet": {"row_group_size": 60}, "tar": {}}[fmt]
    path = shard_factory.write(fmt, f"s.{ 'arrow' if fmt == 'arrow' else fmt}", seqs, labels, **kw)
    opener = {"arrow": ArrowShard, "parquet": ParquetShard, "tar": TarShard}[fmt]
    shard = open_shard(path, batch_rows=40) if fmt != "arrow" else open_shard(path)
    assert isinstance(shard, opener)
    assert shard.has_labels == with_labels
    assert len(shard) == 257
    assert shard.lengths().tolist() == [len(s) for s in seqs]
    assert shard.num_tokens == sum(len(s) for s in seqs)
    for start in (0, 1, 49, 50, 61, 256, 257):
        got, labs = read_back(shard, start)
        assert len(got) == 257 - start
        for a, b in zip(got, seqs[start:]):
            np.testing.assert_array_equal(a, b)
        want_l = labels if labels is not None else seqs
        for a, b in zip(labs, want_l[start:]):
            np.testing.assert_array_equal(a, b)
        if not with_labels:
            assert all(b.labels is None for b in shard.iter_batches(start))
    allb = shard.read_all()
    assert len(allb) == 257 and np.array_equal(allb.lengths(), shard.lengths())
    with pytest.raises(IndexError):
        list(shard.iter_batches(258))
    shard.close()


def test_arrow_is_memory_mapped_zero_copy(shard_factory):
    seqs = random_sequences(100)
    path = shard_factory.arrow("z.arrow", seqs)
    shard = open_shard(path)
    b = shard.read_all()
    # one record batch: the tokens are a read-only view of the memory map, not a copy
    assert not b.tokens.flags.writeable and not b.tokens.flags.owndata
    assert np.array_equal(b.tokens, np.concatenate(seqs))


def test_arrow_stream_format_and_large_list(shard_factory):
    seqs = random_sequences(90, seed=5)
    p1 = shard_factory.arrow("stream.arrow", seqs, stream=True, batch_rows=20)
    p2 = shard_factory.arrow("large.arrow", seqs, sft_labels(seqs), large=True, batch_rows=33)
    for p in (p1, p2):
        got, _ = read_back(open_shard(p), 7)
        assert all(np.array_equal(a, b) for a, b in zip(got, seqs[7:]))
    assert pa.types.is_large_list(open_shard(p2).schema.field("input_ids").type)


def test_other_integer_types_are_converted(shard_factory):
    seqs = random_sequences(40, vocab=60_000)
    for vt in (pa.uint16(), pa.int64(), pa.uint32()):
        p = shard_factory.arrow(f"t-{vt}.arrow", seqs, value_type=vt)
        b = open_shard(p).read_all()
        assert b.tokens.dtype == np.int32 and np.array_equal(b.tokens, np.concatenate(seqs))


def test_sliced_list_array_pitfall():
    """``.values`` of a sliced list array ignores the slice; the reader must cut by the offsets."""
    seqs = [np.arange(k, dtype=np.int32) + 100 * k for k in range(1, 9)]
    arr = make_table(seqs, extra=False).column("input_ids").chunk(0)
    sliced = arr.slice(3, 4)
    assert len(sliced.values) == len(arr.values)  # the pitfall exists in this pyarrow
    offsets, tokens = list_arrays("mem", sliced, "input_ids", 3, allow_negative=False)
    assert offsets.tolist() == [0, 4, 9, 15, 22]
    assert np.array_equal(tokens, np.concatenate(seqs[3:7]))
    # and through a shard: iter_batches(start) slices record batches internally
    assert offsets[0] == 0


def test_column_names_configurable(shard_factory):
    seqs = random_sequences(20)
    lab = sft_labels(seqs)
    p = shard_factory.arrow("c.arrow", seqs, lab, column="tokens", labels_column="mask")
    shard = open_shard(p, token_column="tokens", labels_column="mask")
    _, labs = read_back(shard)
    assert all(np.array_equal(a, b) for a, b in zip(labs, lab))
    assert open_shard(p, token_column="tokens", labels_column=None).read_all().labels is None
    assert not open_shard(p, token_column="tokens").has_labels  # default "labels" absent: labels = inputs
    t = shard_factory.tar("c.tar", seqs, lab, column="tokens", labels_column="mask")
    _, labs = read_back(open_shard(t, token_column="tokens", labels_column="mask"))
    assert all(np.array_equal(a, b) for a, b in zip(labs, lab))


def test_tar_variants(shard_factory):
    seqs = random_sequences(30, seed=9)
    lab = sft_labels(seqs)
    lab[4] = None  # a sample without labels: its labels are its tokens
    for kw in ({}, {"bare_npy": True}, {"dtype": np.int64}, {"dtype": np.uint16}, {"extra": False}):
        p = shard_factory.tar("v.tar", seqs, lab, **kw)
        got, labs = read_back(open_shard(p, batch_rows=7))
        assert all(np.array_equal(a, b) for a, b in zip(got, seqs)), kw
        want = [s if l is None else l for s, l in zip(seqs, lab)]
        assert all(np.array_equal(a, b) for a, b in zip(labs, want)), kw


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_long_names_and_directories(shard_factory, fmt):
    seqs = random_sequences(6, seed=2)
    path = shard_factory.path(f"long-{fmt}.tar")
    long_dir = "d" * 60 + "/" + "e" * 60 if fmt != tarfile.USTAR_FORMAT else "d" * 90
    with tarfile.open(path, "w", format=fmt) as tf:
        dinfo = tarfile.TarInfo(long_dir)
        dinfo.type = tarfile.DIRTYPE
        tf.addfile(dinfo)
        for i, s in enumerate(seqs):
            buf = io.BytesIO()
            np.save(buf, s)
            data = buf.getvalue()
            info = tarfile.TarInfo(f"{long_dir}/k{i:03d}.input_ids.npy")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    shard = open_shard(path)
    assert len(shard) == 6 and shard.keys[2] == f"{long_dir}/k002"
    assert all(np.array_equal(a, b) for a, b in zip(read_back(shard)[0], seqs))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(0, 70), min_size=0, max_size=40), batch=st.integers(1, 9),
       start_frac=st.floats(0, 1))
def test_property_roundtrip(shard_factory, lens, batch, start_frac):
    rng = np.random.default_rng(len(lens))
    seqs = [rng.integers(0, 1000, n, dtype=np.int32) for n in lens]
    start = int(start_frac * len(seqs))
    for fmt, name in (("arrow", "h.arrow"), ("tar", "h.tar"), ("parquet", "h.parquet")):
        kw = {"batch_rows": batch} if fmt == "arrow" else ({"row_group_size": batch} if fmt == "parquet" else {})
        if not seqs and fmt == "arrow":
            kw = {}
        p = shard_factory.write(fmt, name, seqs, **kw)
        shard = open_shard(p, batch_rows=batch) if fmt != "arrow" else open_shard(p)
        assert len(shard) == len(seqs)
        got, _ = read_back(shard, start)
        assert [g.tolist() for g in got] == [s.tolist() for s in seqs[start:]]
        shard.close()


# ---------------------------------------------------------------- bad input


def test_missing_column(shard_factory):
    p = shard_factory.arrow("m.arrow", random_sequences(5), column="tokens")
    with pytest.raises(DataError, match=r"m\.arrow.*token column 'input_ids' not found.*tokens") as e:
        open_shard(p)
    assert e.value.path == p
    q = shard_factory.parquet("m.parquet", random_sequences(5), column="ids")
    with pytest.raises(DataError, match=r"m\.parquet.*'input_ids' not found"):
        open_shard(q)


def test_float_tokens(shard_factory):
    seqs = [s.astype(np.float32) for s in random_sequences(5)]
    p = shard_factory.arrow("f.arrow", seqs, value_type=pa.float32())
    with pytest.raises(DataError, match=r"f\.arrow.*values must be integers"):
        open_shard(p)
    t = shard_factory.tar("f.tar", seqs)
    with pytest.raises(DataError, match=r"f\.tar.*member 'sample000000.input_ids.npy'.*row 0.*float32"):
        open_shard(t)
    path = shard_factory.path("notlist.arrow")
    table = pa.table({"input_ids": pa.array([1, 2, 3], pa.int32())})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match="expected list<int32> or large_list<int32>"):
        open_shard(path)


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "tar"])
def test_negative_token_ids_name_file_and_row(shard_factory, fmt):
    seqs = random_sequences(60, seed=1)
    seqs[37] = seqs[37].copy()
    seqs[37][2] = -5
    kw = {"batch_rows": 16} if fmt == "arrow" else {}
    p = shard_factory.write(fmt, f"neg.{fmt}", seqs, **kw)
    shard = open_shard(p, batch_rows=16) if fmt != "arrow" else open_shard(p)
    with pytest.raises(DataError, match=r"neg\.\w+, row 37: .*negative token id \(-5\) at position 2") as e:
        list(shard.iter_batches())
    assert e.value.row == 37
    # labels may be negative (-100): they are not token ids
    ok = random_sequences(10)
    lab = [np.full(len(s), -100, np.int32) for s in ok]
    shard = open_shard(shard_factory.write(fmt, f"lab.{fmt}", ok, lab))
    assert (shard.read_all().labels == -100).all()


def test_labels_length_mismatch(shard_factory):
    seqs = random_sequences(12, min_len=3)
    lab = [s.copy() for s in seqs]
    lab[8] = lab[8][:-1]
    p = shard_factory.arrow("ml.arrow", seqs, lab)
    with pytest.raises(DataError, match=r"ml\.arrow, row 8: .*labels for"):
        list(open_shard(p).iter_batches())
    t = shard_factory.tar("ml.tar", seqs, lab)
    with pytest.raises(DataError, match=r"ml\.tar.*row 8.*labels for"):
        open_shard(t)


def test_null_sequence(shard_factory):
    path = shard_factory.path("null.arrow")
    arr = pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))
    table = pa.table({"input_ids": arr})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"null\.arrow, row 1: column 'input_ids' has a null sequence"):
        open_shard(path).lengths()
    arr = pa.array([[1, 2], [4, None], [3]], pa.list_(pa.int32()))
    table = pa.table({"input_ids": arr})
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"row 1: column 'input_ids' has a null token id"):
        open_shard(path).read_all()


def test_empty_shards(shard_factory):
    for fmt in ("arrow", "parquet", "tar"):
        p = shard_factory.write(fmt, f"empty.{fmt}", [])
        shard = open_shard(p)
        assert len(shard) == 0 and shard.lengths().size == 0 and list(shard.iter_batches()) == []
        assert len(shard.read_all()) == 0
    empty_file = shard_factory.path("zero.tar")
    open(empty_file, "wb").close()
    # a 0-byte file is a tar cut before its end blocks, not an empty archive (issue 16)
    with pytest.raises(DataError, match=r"zero\.tar: 0-byte file: not a tar archive"):
        open_shard(empty_file)


def test_corrupt_arrow(shard_factory):
    p = shard_factory.arrow("good.arrow", random_sequences(50))
    data = open(p, "rb").read()
    bad = shard_factory.path("trunc.arrow")
    open(bad, "wb").write(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"trunc\.arrow.*corrupt or unreadable Arrow IPC file"):
        open_shard(bad)
    garbage = shard_factory.path("garbage.arrow")
    open(garbage, "wb").write(b"this is not arrow" * 10)
    with pytest.raises(DataError, match=r"garbage\.arrow"):
        open_shard(garbage)
    pbad = shard_factory.path("garbage.parquet")
    open(pbad, "wb").write(b"PAR1 nope" * 20)
    with pytest.raises(DataError, match=r"garbage\.parquet.*corrupt or unreadable Parquet"):
        open_shard(pbad)


def test_corrupt_tar(shard_factory):
    seqs = random_sequences(20, seed=6)
    p = shard_factory.tar("ok.tar", seqs)
    data = bytearray(open(p, "rb").read())
    # a flipped byte in the 5th header (sample000002's token member): checksum error naming position
    hdr = [i for i in range(0, len(data), 512) if data[i:i + 6] == b"sample"][4]
    bad = bytearray(data)
    bad[hdr + 3] ^= 0x55
    path = shard_factory.path("flip.tar")
    open(path, "wb").write(bad)
    with pytest.raises(DataError, match=rf"flip\.tar: corrupt tar: bad header checksum at byte {hdr} \(after "
                                        r"member 'sample000001.json'\)"):
        open_shard(path)
    # truncated in the middle of a member's data, and inside its padding
    size = int(bytes(data[hdr + 124:hdr + 136]).rstrip(b"\0 "), 8)
    for cut in (hdr + 512 + size // 2, hdr + 512 + size + 1):
        path = shard_factory.path("cut.tar")
        open(path, "wb").write(data[:cut])
        with pytest.raises(DataError, match=r"cut\.tar, member 'sample000002.input_ids.npy': corrupt tar: "
                                            r"member data runs past the end"):
            open_shard(path)
    # garbage instead of a tar
    path = shard_factory.path("junk.tar")
    open(path, "wb").write(os.urandom(3000))
    with pytest.raises(DataError, match=r"junk\.tar: corrupt tar"):
        open_shard(path)
    # a .npy member with a broken header
    bad = bytearray(data)
    first_npy = hdr + 512
    bad[first_npy:first_npy + 6] = b"XXXXXX"
    path = shard_factory.path("npy.tar")
    open(path, "wb").write(bad)
    with pytest.raises(DataError, match=r"npy\.tar, member 'sample000002.input_ids.npy', row 2: member is not "
                                        r"a .npy array"):
        open_shard(path)


def test_tar_sample_without_tokens(shard_factory):
    seqs = random_sequences(5)
    path = shard_factory.path("notok.tar")
    write_tar(path, seqs)
    with tarfile.open(path, "a") as tf:
        info = tarfile.TarInfo("zzz.json")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(DataError, match=r"notok\.tar, member 'zzz.json', row 5: sample 'zzz' has no "
                                        r"'input_ids.npy'"):
        open_shard(path)


def test_tar_2d_member_rejected(shard_factory):
    path = shard_factory.path("twod.tar")
    with tarfile.open(path, "w") as tf:
        buf = io.BytesIO()
        np.save(buf, np.zeros((3, 4), np.int32))
        info = tarfile.TarInfo("a.input_ids.npy")
        info.size = len(buf.getvalue())
        tf.addfile(info, io.BytesIO(buf.getvalue()))
    with pytest.raises(DataError, match=r"shape \(3, 4\); expected a 1-D array"):
        open_shard(path)


def test_data_error_pickles():
    import pickle

    e = DataError("bad", path="a.arrow", row=3, member="k.npy")
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) == "a.arrow, member 'k.npy', row 3: bad"
    assert isinstance(e2, ValueError) and e2.row == 3


@pytest.mark.parametrize("checksums", [True, False])
def test_corrupt_parquet_row_group_names_its_row_range(tmp_path, checksums):
    """Issue 36, defect 7: damage in row group 2 (rows 2000-2999) used to be reported as "row 0"."""
    seqs = random_sequences(4000, seed=3, max_len=40)
    path = str(tmp_path / "rg.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([s.tolist() for s in seqs], pa.list_(pa.int32()))}), path,
                   row_group_size=1000, write_page_checksum=checksums, compression="none")
    col = pq.ParquetFile(path).metadata.row_group(2).column(0)
    raw = bytearray(open(path, "rb").read())
    start = col.dictionary_page_offset or col.data_page_offset
    raw[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size  # the group's pages
    open(path, "wb").write(bytes(raw))
    for read in (lambda sh: sh.lengths(), lambda sh: read_back(sh), lambda sh: read_back(sh, start=2500)):
        shard = open_shard(path)
        with pytest.raises(DataError, match=r"rg\.parquet, row 2000: corrupt Parquet data in row group 2 "
                                            r"\(rows 2000-2999\)"):
            read(shard)
        shard.close()
    shard = open_shard(path)  # the rows before the damaged group are read as written
    got = []
    with pytest.raises(DataError, match="row group 2"):
        for b in shard.iter_batches():
            got += [b.sequence(i).copy() for i in range(len(b))]
    assert len(got) == 2000 and all(np.array_equal(a, b) for a, b in zip(got, seqs))
    shard.close()
