"""packloader.pack_writer (offline pre-packing): formats, per-shard and global packing, the output schema,
index.json, overflow policies, atomic writes and restart, bad input.

Inputs are fresh random data each run; the seed is printed (shown on failure) and can be replayed with
``PACKLOADER_TEST_SEED=<seed> pytest ...``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

import packloader.pack_writer as pack_writer
from packloader.errors import DataError
from packloader.pack_writer import ALGORITHMS, pack_dataset, scatter_rows
from packloader.prepacked import INDEX_NAME, PrepackedDataset, packed_schema
from packloader.report import PackingReport
from packloader.sources import SequenceBatch
from tests.packloader.conftest import (
    assert_packed_matches,
    random_sequences,
    sft_labels,
    write_arrow,
)

EXT = {"arrow": "arrow", "parquet": "parquet", "tar": "tar"}


def pack(sources, out, **kw):
    kw.setdefault("quiet", True)
    return pack_dataset(sources, out, **kw)


def make_shards(factory, fmt, *, n_shards=3, n_seqs=60, seed=0, labels=False, max_len=300, prefix="shard"):
    """Write shards; returns (paths, {path: seqs}, {path: labels or None})."""
    paths, seqs_by, labs_by = [], {}, {}
    kw = {"arrow": {"batch_rows": 17}, "parquet": {"row_group_size": 23}, "tar": {}}[fmt]
    for k in range(n_shards):
        seqs = random_sequences(n_seqs, seed=seed + k, max_len=max_len)
        lab = sft_labels(seqs, seed=seed + 1000 + k) if labels else None
        p = factory.write(fmt, f"{prefix}-{k:03d}.{EXT[fmt]}", seqs, lab, **kw)
        paths.append(p)
        seqs_by[p] = seqs
        labs_by[p] = lab
    return paths, seqs_by, labs_by


def snapshot(out_dir) -> dict:
    """{file name: (inode, mtime_ns, size)} of every file directly in ``out_dir``."""
    out = {}
    for name in sorted(os.listdir(out_dir)):
        full = os.path.join(out_dir, name)
        if os.path.isfile(full):
            st = os.stat(full)
            out[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def part_files(out_dir) -> list[str]:
    return sorted(n for n in os.listdir(out_dir) if n.startswith("part-") and n.endswith(".arrow"))


def temp_files(out_dir) -> list[str]:
    return [os.path.join(r, n) for r, _, names in os.walk(out_dir) for n in names if ".tmp-" in n]


def read_index(out_dir) -> dict:
    with open(os.path.join(out_dir, INDEX_NAME)) as f:
        return json.load(f)


# ---------------------------------------------------------------- formats and packing modes


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "tar"])
@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("global_packing", [False, True])
def test_pack_formats_token_by_token(shard_factory, tmp_path, seed, fmt, labels, global_packing):
    paths, seqs, labs = make_shards(shard_factory, fmt, n_shards=3, n_seqs=70, seed=seed, labels=labels)
    out = tmp_path / "out"
    rep = pack(paths, out, capacity=512, algorithm="bfd", global_packing=global_packing)
    rows = assert_packed_matches(out, seqs, labs)
    lengths = np.concatenate([[len(s) for s in v] for v in seqs.values()])
    assert isinstance(rep, PackingReport)
    assert rep.rows == rows and rep.sequences == len(lengths) and rep.tokens == int(lengths.sum())
    assert rep.packed_tokens == rep.tokens and rep.global_packing == global_packing
    assert rep.sources == 3 and rep.files == len(part_files(out)) == 3
    with PrepackedDataset(out) as ds:
        offs, sf, _, _ = ds.read_sources(0, len(ds))
        if not global_packing:  # per shard: each file holds the pieces of exactly one source
            for f in range(len(ds.file_names)):
                r0, r1 = int(ds.file_offsets[f]), int(ds.file_offsets[f + 1])
                assert set(sf[offs[r0]:offs[r1]].tolist()) == {f}


def test_global_packing_mixes_shards(shard_factory, tmp_path):
    # three shards of one half-row sequence each: alone each needs a row, together two rows
    cap = 100
    paths = [shard_factory.arrow(f"h{k}.arrow", [np.full(50, k + 1, np.int32)]) for k in range(3)]
    seqs = {p: [np.full(50, k + 1, np.int32)] for k, p in enumerate(paths)}
    per = pack(paths, tmp_path / "per", capacity=cap, algorithm="next_fit")
    glob_ = pack(paths, tmp_path / "glob", capacity=cap, algorithm="next_fit", global_packing=True)
    assert per.rows == 3 and glob_.rows == 2
    assert assert_packed_matches(tmp_path / "glob", seqs) == 2
    with PrepackedDataset(tmp_path / "glob") as ds:
        offs, sf, _, _ = ds.read_sources(0, 1)
        assert sf.tolist() == [0, 1]  # row 0 holds sequences from two shards
    assert read_index(tmp_path / "glob")["global_packing"] is True


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm(shard_factory, tmp_path, seed, algorithm):
    paths, seqs, labs = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=120, seed=seed, labels=True)
    out = tmp_path / algorithm
    rep = pack(paths, out, capacity=600, algorithm=algorithm,
               buffer_size=16 if algorithm == "online" else None)
    assert assert_packed_matches(out, seqs, labs) == rep.rows
    assert rep.rows >= rep.lower_bound
    idx = read_index(out)
    assert idx["algorithm"] == algorithm and idx["report"]["algorithm"] == algorithm


def test_parallel_workers_match_serial(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "tar", n_shards=3, n_seqs=50, seed=seed)
    a = pack(paths, tmp_path / "serial", capacity=400)
    b = pack(paths, tmp_path / "par", capacity=400, workers=2)
    assert_packed_matches(tmp_path / "par", seqs)
    assert (a.rows, a.packed_tokens, a.fill_counts) == (b.rows, b.packed_tokens, b.fill_counts)
    with PrepackedDataset(tmp_path / "serial") as x, PrepackedDataset(tmp_path / "par") as y:
        assert np.array_equal(x.read_rows(0)[0], y.read_rows(0)[0])


def test_rows_per_file_and_max_items(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=150, seed=seed, max_len=120)
    out = tmp_path / "out"
    rep = pack(paths, out, capacity=256, rows_per_file=7, max_items_per_bin=3)
    idx = read_index(out)
    assert len(idx["files"]) > 2 and all(1 <= f["rows"] <= 7 for f in idx["files"])
    assert assert_packed_matches(out, seqs) == rep.rows
    with PrepackedDataset(out) as ds:
        offs = ds.read_rows(0)[2]
        assert np.diff(offs).max() <= 3
    assert rep.max_seqs_per_row <= 3


def test_scatter_rows_matches_python_twin(seed):
    from packer_algos import pack as plan_pack

    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 90, 200)
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = rng.integers(0, 1000, int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(tokens)) < 0.3, -100, tokens).astype(np.int32)
    cap = 64
    plan = plan_pack(lens, cap, "bfd", overflow="split")
    for lab in (None, labels):
        batch = SequenceBatch(0, offsets, tokens, lab)
        b0, b1 = 1, plan.n_bins - 1
        ids, got_lab = scatter_rows(batch, plan, b0, b1)
        want_ids = np.zeros((b1 - b0, cap), np.int32)
        want_lab = np.full((b1 - b0, cap), -100, np.int32)
        src_lab = tokens if lab is None else lab
        for r in range(b0, b1):
            pos = 0
            for it, st, n in zip(*plan.bin(r)):
                a = offsets[it] + st
                want_ids[r - b0, pos:pos + n] = tokens[a:a + n]
                want_lab[r - b0, pos:pos + n] = src_lab[a:a + n]
                want_lab[r - b0, pos] = -100
                pos += n
        assert np.array_equal(ids.reshape(-1, cap), want_ids)
        assert np.array_equal(got_lab.reshape(-1, cap), want_lab)
        # into reused, dirty buffers (as write_packed_file does): the same rows, every slot written
        bufs = (np.full((b1 - b0 + 3) * cap, 77, np.int32), np.full((b1 - b0 + 3) * cap, 77, np.int32))
        ids2, lab2 = scatter_rows(batch, plan, b0, b1, out=bufs)
        assert ids2.base is bufs[0] or ids2.base is bufs[0].base
        assert np.array_equal(ids2.reshape(-1, cap), want_ids)
        assert np.array_equal(lab2.reshape(-1, cap), want_lab)
        with pytest.raises(ValueError, match="int32"):
            scatter_rows(batch, plan, b0, b1, out=(bufs[0][:cap], bufs[1]))


# ---------------------------------------------------------------- output schema and index.json


def test_output_schema_uncompressed_and_memory_mappable(shard_factory, tmp_path, seed):
    paths, seqs, labs = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=80, seed=seed, labels=True)
    out = tmp_path / "out"
    cap = 384
    pack(paths, out, capacity=cap, rows_per_file=10)
    for name in part_files(out):
        with pa.memory_map(str(out / name)) as mm:
            reader = pa.ipc.open_file(mm)
            schema = reader.schema
            assert schema.remove_metadata().equals(packed_schema(cap))
            assert schema.field("input_ids").type == pa.list_(pa.int32(), cap)
            assert schema.field("labels").type == pa.list_(pa.int32(), cap)
            assert schema.field("seq_lens").type == pa.list_(pa.int32())
            assert schema.field("source_file").type == pa.list_(pa.int32())
            assert schema.field("source_row").type == pa.list_(pa.int64())
            assert schema.field("source_start").type == pa.list_(pa.int32())
            # uncompressed: reading every column allocates nothing, the values are views of the map
            before = pa.total_allocated_bytes()
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                v = b.column("input_ids").values.to_numpy(zero_copy_only=True)
                assert v.size == b.num_rows * cap
                lens = b.column("seq_lens")
                fill = np.add.reduceat(lens.values.to_numpy(), lens.offsets.to_numpy()[:-1])
                assert (fill <= cap).all() and (fill > 0).all()
            assert pa.total_allocated_bytes() == before
    assert_packed_matches(out, seqs, labs)


def test_index_json(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "parquet", n_shards=3, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    rep = pack(paths, out, capacity=500, algorithm="ffd", overflow="split")
    idx = read_index(out)
    assert idx["format"] == "packloader-packed" and idx["version"] == 1
    assert idx["capacity"] == 500 and idx["algorithm"] == "ffd" and idx["overflow"] == "split"
    assert idx["sources"] == paths
    assert [f["name"] for f in idx["files"]] == part_files(out)
    lengths = [len(s) for p in paths for s in seqs[p]]
    with PrepackedDataset(out) as ds:
        for k, f in enumerate(idx["files"]):
            assert f["rows"] == ds.file_rows(k)
            assert f["bytes"] == os.path.getsize(out / f["name"])
            r0, r1 = int(ds.file_offsets[k]), int(ds.file_offsets[k + 1])
            assert f["tokens"] == int(ds.read_rows(r0, r1)[3].sum())
        assert idx["total_rows"] == len(ds) == rep.rows
    assert idx["total_tokens"] == sum(lengths) == rep.packed_tokens
    assert idx["total_sequences"] == len(lengths)
    assert idx["total_pieces"] == rep.pieces
    assert isinstance(idx["content_hash"], str) and len(idx["content_hash"]) == 64
    int(idx["content_hash"], 16)
    assert PackingReport.from_dict(idx["report"]) == PackingReport.from_dict(rep.to_dict())


def test_content_hash_changes_with_inputs_and_settings(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    pack(paths, out, capacity=400)
    h0 = read_index(out)["content_hash"]
    pack(paths, out, capacity=400)
    assert read_index(out)["content_hash"] == h0  # same inputs and settings: same hash
    hashes = {h0}
    for kw in ({"capacity": 401}, {"algorithm": "next_fit"}, {"overflow": "split"}, {"global_packing": True},
               {"max_items_per_bin": 5}, {"rows_per_file": 3}, {"labels_column": None}):
        pack(paths, out, **{"capacity": 400, **kw})
        h = read_index(out)["content_hash"]
        assert h not in hashes, kw
        hashes.add(h)
        assert read_index(out)["capacity"] == kw.get("capacity", 400)
        # only the files of the current index remain
        assert part_files(out) == sorted(f["name"] for f in read_index(out)["files"])
    # a changed input file
    new = random_sequences(40, seed=seed + 77, max_len=300)
    write_arrow(paths[1], new)
    pack(paths, out, capacity=400)
    assert read_index(out)["content_hash"] not in hashes
    assert_packed_matches(out, {paths[0]: seqs[paths[0]], paths[1]: new})
    # one more input file
    extra = shard_factory.arrow("extra.arrow", random_sequences(5, seed=seed + 78))
    h_before = read_index(out)["content_hash"]
    pack(paths + [extra], out, capacity=400)
    assert read_index(out)["content_hash"] != h_before and len(read_index(out)["sources"]) == 3


def test_source_digest_sees_content_size_and_mtime(tmp_path, seed):
    from packloader.pack_writer import source_digest

    rng = np.random.default_rng(seed)
    for size in (1000, 3 << 20):
        p = tmp_path / f"f{size}.bin"
        data = bytearray(rng.bytes(size))
        p.write_bytes(bytes(data))
        st = os.stat(p)
        d0 = source_digest(p)
        assert source_digest(p) == d0
        where = size - 1 if size < (1 << 20) else 12345  # a small file: anywhere; a large one: a sampled block
        data[where] ^= 1
        p.write_bytes(bytes(data))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime, other content
        d1 = source_digest(p)
        assert d1 != d0
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        assert source_digest(p) not in (d0, d1)


# ---------------------------------------------------------------- overflow policies


def overlong_shard(factory, seed, cap, fmt="arrow", name="long"):
    rng = np.random.default_rng(seed)
    seqs = random_sequences(50, seed=seed, max_len=cap)
    over_rows = sorted(rng.choice(np.arange(1, 50), 4, replace=False).tolist())
    for r in over_rows:
        seqs[r] = rng.integers(0, 1000, int(rng.integers(cap + 1, 3 * cap)), dtype=np.int32)
    empty = next(r for r in range(5, 50) if r not in over_rows)
    seqs[empty] = np.zeros(0, np.int32)  # an empty sequence: counted, not placed
    labels = sft_labels(seqs, seed=seed + 1)
    path = factory.write(fmt, f"{name}.{EXT[fmt]}", seqs, labels)
    return path, seqs, labels, over_rows


def test_overflow_error_names_file_and_row(shard_factory, tmp_path, seed):
    cap = 200
    path, seqs, _, over = overlong_shard(shard_factory, seed, cap)
    with pytest.raises(DataError) as ei:
        pack([path], tmp_path / "out", capacity=cap)
    e = ei.value
    assert e.path == path and e.row == over[0]
    assert path in str(e) and f"row {over[0]}" in str(e) and f"longer than capacity {cap}" in str(e)
    assert "overflow" in str(e)
    with pytest.raises(DataError, match="index.json"):
        PrepackedDataset(tmp_path / "out")
    assert part_files(tmp_path / "out") == [] and temp_files(tmp_path / "out") == []


@pytest.mark.parametrize("fmt", ["arrow", "tar"])
def test_overflow_split(shard_factory, tmp_path, seed, fmt):
    cap = 200
    path, seqs, labels, over = overlong_shard(shard_factory, seed, cap, fmt)
    out = tmp_path / "out"
    rep = pack([path], out, capacity=cap, overflow="split")
    assert_packed_matches(out, {path: seqs}, {path: labels}, expect_all=True)  # every token, in pieces
    lengths = np.array([len(s) for s in seqs])
    assert rep.split == len(over) and rep.truncated == rep.dropped == rep.lost_tokens == 0
    assert rep.packed_tokens == rep.tokens == lengths.sum() and rep.empty == 1
    assert rep.pieces == (lengths > 0).sum() + sum(-(-lengths[r] // cap) - 1 for r in over)
    with PrepackedDataset(out) as ds:
        _, _, rows, starts = ds.read_sources(0, len(ds))
        assert set(rows[starts > 0].tolist()) == set(over)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overflow_truncate_and_drop_are_counted(shard_factory, tmp_path, seed, policy):
    cap = 200
    path, seqs, labels, over = overlong_shard(shard_factory, seed, cap, "parquet")
    out = tmp_path / "out"
    rep = pack([path], out, capacity=cap, overflow=policy)
    assert_packed_matches(out, {path: seqs}, {path: labels}, expect_all=False)
    lengths = np.array([len(s) for s in seqs])
    lost = int(sum(lengths[r] - cap for r in over)) if policy == "truncate" else int(lengths[over].sum())
    assert rep.lost_tokens == lost and rep.packed_tokens == rep.tokens - lost
    assert (rep.truncated, rep.dropped, rep.split) == ((len(over), 0, 0) if policy == "truncate" else (0, len(over), 0))
    with PrepackedDataset(out) as ds:
        _, _, rows, starts = ds.read_sources(0, len(ds))
        lens = ds.read_rows(0)[3]
    # nothing silently dropped: every other non-empty sequence is there, whole; the over-long ones are
    # either one capacity-long head (truncate) or absent (drop)
    placed = dict(zip(rows.tolist(), lens.tolist()))
    assert len(placed) == len(rows)  # one piece per sequence
    for r, n in enumerate(lengths.tolist()):
        if r in over:
            assert placed.get(r) == (cap if policy == "truncate" else None)
        elif n:
            assert placed[r] == n
        else:
            assert r not in placed
    assert (starts == 0).all()
    text = str(rep)
    want = f"0 / {len(over)} / 0" if policy == "truncate" else f"0 / 0 / {len(over)}"
    assert want in text


# ---------------------------------------------------------------- atomic writes and restart


@pytest.mark.parametrize("global_packing", [False, True])
def test_rerun_skips_finished_outputs(shard_factory, tmp_path, seed, global_packing):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=3, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    r1 = pack(paths, out, capacity=300, global_packing=global_packing)
    snap = snapshot(out)
    r2 = pack(paths, out, capacity=300, global_packing=global_packing)
    assert snapshot(out) == snap  # nothing rewritten, not even index.json
    assert r2.reused_files == 3 and (r2.rows, r2.packed_tokens) == (r1.rows, r1.packed_tokens)
    # without index.json the finished jobs are found from their state files: parts kept, index rebuilt
    os.remove(out / INDEX_NAME)
    r3 = pack(paths, out, capacity=300, global_packing=global_packing)
    snap3 = snapshot(out)
    assert {k: v for k, v in snap3.items() if k != INDEX_NAME} == {k: v for k, v in snap.items() if k != INDEX_NAME}
    assert r3.reused_files == 3
    assert_packed_matches(out, seqs)


def test_changed_shard_repacks_only_that_shard(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=3, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    pack(paths, out, capacity=300)
    before = snapshot(out)
    idx0 = read_index(out)
    seqs[paths[1]] = random_sequences(30, seed=seed + 5)
    write_arrow(paths[1], seqs[paths[1]])
    rep = pack(paths, out, capacity=300)
    after = snapshot(out)
    names0 = [f["name"] for f in idx0["files"]]
    names1 = [f["name"] for f in read_index(out)["files"]]
    assert names1[0] == names0[0] and names1[2] == names0[2] and names1[1] != names0[1]
    assert after[names0[0]] == before[names0[0]] and after[names0[2]] == before[names0[2]]
    assert names0[1] not in after  # the stale file is gone
    assert rep.reused_files == 2
    assert_packed_matches(out, seqs)


class Boom(RuntimeError):
    pass


def test_crash_mid_run_keeps_finished_outputs_and_rerun_completes(shard_factory, tmp_path, seed, monkeypatch):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=3, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    real_scatter = pack_writer.scatter_rows
    calls = []

    def failing_scatter(*a, **k):  # fails while the second shard's file is being written
        calls.append(1)
        if len(calls) == 2:
            raise Boom("disk full")
        return real_scatter(*a, **k)

    monkeypatch.setattr(pack_writer, "scatter_rows", failing_scatter)
    with pytest.raises(Boom):
        pack(paths, out, capacity=300)
    monkeypatch.setattr(pack_writer, "scatter_rows", real_scatter)
    assert not (out / INDEX_NAME).exists()
    with pytest.raises(DataError, match="not a finished pre-packed directory"):
        PrepackedDataset(out)
    assert temp_files(out) == []  # the half-written file was removed
    finished = part_files(out)
    assert len(finished) == 1
    snap = snapshot(out)
    rep = pack(paths, out, capacity=300)
    assert rep.reused_files == 1
    assert snapshot(out)[finished[0]] == snap[finished[0]]  # the finished shard was not rewritten
    assert len(part_files(out)) == 3
    assert_packed_matches(out, seqs)


def test_failed_rerun_leaves_finished_directory_intact(shard_factory, tmp_path, seed, monkeypatch):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=3, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    pack(paths, out, capacity=300)
    snap = snapshot(out)
    real = pack_writer.write_packed_file

    def failing_write(*a, **k):
        raise Boom("killed")

    monkeypatch.setattr(pack_writer, "write_packed_file", failing_write)
    with pytest.raises(Boom):
        pack(paths, out, capacity=300, algorithm="next_fit")  # new settings: every shard is rewritten
    monkeypatch.setattr(pack_writer, "write_packed_file", real)
    assert snapshot(out) == snap
    assert_packed_matches(out, seqs)
    assert read_index(out)["algorithm"] == "bfd"


def test_hard_kill_leaves_no_file_a_reader_accepts(shard_factory, tmp_path, seed):
    """A process killed (os._exit) in the middle of writing a file: its temp file stays behind, the
    reader refuses the directory, and a re-run removes the temp file and completes."""
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import os, packloader.pack_writer as pp
        real = pp.scatter_rows
        n = [0]
        def scatter(*a, **k):
            n[0] += 1
            if n[0] == 2:
                os._exit(9)
            return real(*a, **k)
        pp.scatter_rows = scatter
        pp.pack_dataset({paths!r}, {str(out)!r}, capacity=300, quiet=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 9, proc.stderr
    leftovers = temp_files(out)
    assert len(leftovers) == 1 and ".arrow.tmp-" in leftovers[0]
    with pytest.raises(DataError):
        PrepackedDataset(out)
    pack(paths, out, capacity=300)
    assert temp_files(out) == []
    assert_packed_matches(out, seqs)


def test_stray_and_damaged_files_are_never_accepted(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "tar", n_shards=2, n_seqs=40, seed=seed)
    out = tmp_path / "out"
    pack(paths, out, capacity=300)
    names = part_files(out)
    # stray files: a temp file of a dead process (ours, in .packloader/tmp), a foreign temp-like file and
    # a foreign part file; the reader reads only the index, and pack removes only what it wrote
    dead_pid = 2**22 + 12345
    (out / ".packloader" / "tmp").mkdir(exist_ok=True)
    (out / ".packloader" / "tmp" / f"{names[0]}.tmp-{dead_pid}").write_bytes(b"garbage")
    (out / f"{names[0]}.tmp-{dead_pid}").write_bytes(b"garbage")
    (out / "part-99999-ffffffffff.arrow").write_bytes((out / names[0]).read_bytes()[:1000])
    with PrepackedDataset(out) as ds:
        assert ds.file_names == names
    assert_packed_matches(out, seqs)
    # a listed file cut short (half written) is refused, and a re-run repairs the directory
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=names[1]):
        PrepackedDataset(out)
    pack(paths, out, capacity=300)
    assert part_files(out) == sorted(names + ["part-99999-ffffffffff.arrow"])  # the foreign file stays
    assert temp_files(out) == [str(out / f"{names[0]}.tmp-{dead_pid}")]  # ours removed, the foreign one not
    assert_packed_matches(out, seqs)


# ---------------------------------------------------------------- bad input


def _bad_arrow_missing_column(f, seed):
    return f.arrow("bad.arrow", random_sequences(10, seed=seed), column="tokens"), None, "'input_ids' not found"


def _bad_float_tokens(f, seed):
    seqs = [s.astype(np.float32) for s in random_sequences(10, seed=seed)]
    return f.arrow("bad.arrow", seqs, value_type=pa.float32()), None, "must be integers"


def _bad_float_tar(f, seed):
    seqs = [s.astype(np.float32) for s in random_sequences(10, seed=seed)]
    return f.tar("bad.tar", seqs), 0, "token ids must be integers"


def _bad_empty_shard(f, seed):
    return f.arrow("bad.arrow", []), None, "empty shard"


def _bad_corrupt_tar(f, seed):
    p = f.tar("bad.tar", random_sequences(30, seed=seed))
    import tarfile

    with tarfile.open(p) as tf:
        header_at = tf.getmembers()[7].offset
    data = bytearray(open(p, "rb").read())
    data[header_at + 10] ^= 0xFF  # a byte in a later member's header: checksum mismatch
    open(p, "wb").write(bytes(data))
    return p, None, "corrupt tar"


def _bad_truncated_tar(f, seed):
    p = f.tar("bad.tar", random_sequences(30, seed=seed, min_len=100, max_len=200))
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2 + 7])
    return p, None, "corrupt tar"


def _bad_corrupt_arrow(f, seed):
    p = f.arrow("bad.arrow", random_sequences(30, seed=seed))
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    return p, None, "corrupt or unreadable Arrow"


def _bad_garbage_arrow(f, seed):
    p = f.path("bad.arrow")
    open(p, "wb").write(np.random.default_rng(seed).bytes(4096))
    return p, None, "Arrow"


def _bad_corrupt_parquet(f, seed):
    p = f.parquet("bad.parquet", random_sequences(30, seed=seed))
    data = open(p, "rb").read()
    open(p, "wb").write(data[:100] + data[-50:])
    return p, None, "Parquet"


def _negative(fmt):
    def make(f, seed):
        seqs = random_sequences(40, seed=seed)
        row = 17 + seed % 20
        seqs[row] = seqs[row].copy()
        seqs[row][len(seqs[row]) // 2] = -5
        return f.write(fmt, f"bad.{EXT[fmt]}", seqs), row, "negative token id"
    return make


def _too_long(f, seed):
    seqs = random_sequences(40, seed=seed, max_len=200)
    row = 3 + seed % 30
    seqs[row] = np.arange(301, dtype=np.int32)
    return f.arrow("bad.arrow", seqs), row, "longer than capacity 300"


BAD = {
    "missing_column": _bad_arrow_missing_column,
    "float_tokens": _bad_float_tokens,
    "float_tokens_tar": _bad_float_tar,
    "empty_shard": _bad_empty_shard,
    "corrupt_tar_header": _bad_corrupt_tar,
    "truncated_tar": _bad_truncated_tar,
    "truncated_arrow": _bad_corrupt_arrow,
    "garbage_arrow": _bad_garbage_arrow,
    "corrupt_parquet": _bad_corrupt_parquet,
    "negative_ids_arrow": _negative("arrow"),
    "negative_ids_parquet": _negative("parquet"),
    "negative_ids_tar": _negative("tar"),
    "too_long": _too_long,
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_clear_error_and_output_intact(shard_factory, tmp_path, seed, case):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=30, seed=seed, max_len=250)
    out = tmp_path / "out"
    pack(paths, out, capacity=300)
    snap = snapshot(out)
    bad, row, message = BAD[case](shard_factory, seed)
    for sources in ([bad], paths + [bad], [paths[0], bad, paths[1]]):
        with pytest.raises(DataError) as ei:
            pack(sources, out, capacity=300)
        e = ei.value
        assert e.path == bad and bad in str(e), str(e)
        assert message in str(e), str(e)
        if row is not None:
            assert e.row == row and f"row {row}" in str(e), str(e)
        # the finished directory is untouched and still reads back correctly
        assert snapshot(out) == snap
        assert temp_files(out) == []
        assert_packed_matches(out, seqs)


def test_bad_input_in_a_worker_process_names_file_and_row(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=30, seed=seed, max_len=250)
    bad, row, message = _negative("tar")(shard_factory, seed)
    with pytest.raises(DataError) as ei:
        pack([paths[0], bad, paths[1]], tmp_path / "out", capacity=300, workers=2)
    assert ei.value.path == bad and ei.value.row == row and message in str(ei.value)
    assert not (tmp_path / "out" / INDEX_NAME).exists() and temp_files(tmp_path / "out") == []


def test_empty_shard_allowed_when_asked(shard_factory, tmp_path, seed):
    paths, seqs, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=30, seed=seed)
    empty = shard_factory.arrow("empty.arrow", [])
    empty_tar = shard_factory.tar("empty.tar", [])
    for gp in (False, True):
        out = tmp_path / f"out{gp}"
        rep = pack([paths[0], empty, empty_tar, paths[1]], out, capacity=300, allow_empty=True, global_packing=gp)
        assert_packed_matches(out, {**seqs, empty: [], empty_tar: []})
        assert rep.sources == 4 and rep.sequences == 60
        assert read_index(out)["sources"][1] == empty


def test_bad_settings_raise_value_error(shard_factory, tmp_path):
    p = shard_factory.arrow("a.arrow", random_sequences(5))
    for kw, msg in (({"capacity": 0}, "capacity"), ({"algorithm": "magic"}, "algorithm"),
                    ({"overflow": "wrap"}, "overflow"), ({"rows_per_file": 0}, "rows_per_file")):
        with pytest.raises(ValueError, match=msg):
            pack([p], tmp_path / "o", **kw)
    with pytest.raises(DataError, match="no such shard file"):
        pack([str(tmp_path / "nope.arrow")], tmp_path / "o")


# ---------------------------------------------------------------- progress output


def test_progress_output_modes(shard_factory, tmp_path, capsys):
    paths, _, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=10)
    pack_dataset(paths, tmp_path / "a", capacity=300, quiet=True)
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == ""
    pack_dataset(paths, tmp_path / "b", capacity=300, progress=False)
    err = capsys.readouterr().err
    assert "packing 2 shard(s)" in err and "2/2 job" in err and "efficiency" in err and "\r" not in err
    pack_dataset(paths, tmp_path / "c", capacity=300, progress=True)
    err = capsys.readouterr().err
    assert "\r" in err and "100%" in err  # a tqdm bar


def test_progress_bar_by_default_on_a_terminal(shard_factory, tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    paths, _, _ = make_shards(shard_factory, "arrow", n_shards=2, n_seqs=10)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    pack_dataset(paths, tmp_path / "a", capacity=300)
    assert "\r" in term.getvalue() and "100%" in term.getvalue()
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    pack_dataset(paths, tmp_path / "b", capacity=300)
    assert "\r" not in pipe.getvalue() and "2/2 job" in pipe.getvalue()


# ---------------------------------------------------------------- the benchmark script


def test_bench_prepack_quick_smoke(tmp_path):
    """``benchmarks/bench_prepack.py --quick`` runs, prints its table and writes its JSON (figures are
    not checked: this is not a timed test)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "prepack.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_prepack.py"), "--quick", "--formats",
         "arrow,tar,parquet", "--data-dir", str(tmp_path / "data"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    assert "M tok/s" in proc.stdout and "arrow" in proc.stdout and "tar" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["format"] for r in doc["results"]] == ["arrow", "tar", "parquet"]
    toks = {r["tokens"] for r in doc["results"]}
    assert len(toks) == 1 and 3e6 < toks.pop() < 5e6  # the same documents in every format
    for r in doc["results"]:
        assert len(r["seconds"]) == 2 and r["best_tokens_per_s"] > 0 and 0.9 < r["efficiency"] <= 1
        assert r["meets_target"] in (True, False, None)
    assert doc["machine"]["cpus"] >= 1 and doc["config"]["quick"] is True
    assert not os.listdir(tmp_path / "data" / "out")  # outputs are removed after each format


def test_constants_and_the_overflow_check_have_one_home():
    """IGNORE_INDEX, the algorithm and overflow lists and the file-level overflow check are defined once
    and shared by pack, the loader and the CLI (an edit in one place changes them all)."""
    import packer_algos
    from packloader import batch, cli, pack_writer, prepacked, stream

    assert pack_writer.IGNORE_INDEX is batch.IGNORE_INDEX and prepacked.IGNORE_INDEX is batch.IGNORE_INDEX
    assert pack_writer.ALGORITHMS is packer_algos.ALGORITHMS and pack_writer.OVERFLOW is packer_algos.OVERFLOW_POLICIES
    actions = {a.dest: a for sp in cli.build_parser()._subparsers._group_actions[0].choices.values()
               for a in sp._actions}
    assert tuple(actions["algorithm"].choices) == packer_algos.ALGORITHMS
    assert tuple(actions["overflow"].choices) == packer_algos.OVERFLOW_POLICIES
    import inspect

    for mod in (pack_writer, stream):  # the overflow check is check_fits, not a copy
        src = inspect.getsource(mod)
        assert "check_fits(" in src and "tokens is longer than capacity" not in src
    from packloader import place

    assert "-100" not in inspect.getsource(place._place_kernel)
