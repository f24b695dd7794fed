"""``pack`` reading shards named by URI (issue 17): shards in a moto S3 bucket pack to the bytes of the
same shards packed from local paths; the index names the URIs; re-runs skip; a missing object is named;
``--out`` stays a filesystem path. Skipped without ``moto[server]`` and ``boto3`` (the ``dev`` extra).
The Ray engine reading ``s3://`` is in ``test_ray_cluster.py``."""
from __future__ import annotations

import json
import os

import pytest

from packloader import pack_dataset
from packloader.errors import DataError
from tests.packloader.conftest import random_sequences, sft_labels, write_arrow, write_parquet, write_tar


def assert_same_packing(local_dir, uri_dir, uris) -> None:
    """``uri_dir`` (packed from ``uris``) holds the bytes of ``local_dir`` (packed from local copies)
    up to the job hashes (they name the sources: paths there, URIs here), which are substituted; the
    index lists the URIs; every count and size agrees."""
    a = json.load(open(os.path.join(local_dir, "index.json")))
    b = json.load(open(os.path.join(uri_dir, "index.json")))
    assert b["sources"] == list(uris)
    assert len(a["job_hashes"]) == len(b["job_hashes"]) and set(a["job_hashes"]).isdisjoint(b["job_hashes"])
    hashes = dict(zip(a["job_hashes"], b["job_hashes"]))

    def subst(x: bytes) -> bytes:
        for ha, hb in hashes.items():
            x = x.replace(ha.encode(), hb.encode()).replace(ha[:10].encode(), hb[:10].encode())
        return x

    assert len(a["files"]) == len(b["files"]) > 0
    for fa, fb in zip(a["files"], b["files"]):
        assert subst(fa["name"].encode()).decode() == fb["name"]
        assert {k: fa[k] for k in ("rows", "tokens", "bytes", "job")} == {k: fb[k] for k in ("rows", "tokens", "bytes", "job")}
        with open(os.path.join(local_dir, fa["name"]), "rb") as f, open(os.path.join(uri_dir, fb["name"]), "rb") as g:
            assert subst(f.read()) == g.read(), fa["name"]
    for k in ("total_rows", "total_tokens", "total_sequences", "total_pieces", "settings", "capacity"):
        assert a[k] == b[k], k
    drop = lambda r: {k: v for k, v in r.items() if not k.endswith("_seconds") and k not in  # noqa: E731
                      ("tokens_per_second", "reused_files")}
    assert drop(a["report"]) == drop(b["report"])


WRITERS = {
    "arrow": lambda p, s, l: write_arrow(p + ".arrow", s, l, batch_rows=400),
    "parquet": lambda p, s, l: write_parquet(p + ".parquet", s, l, row_group_size=500),
    "tar": lambda p, s, l: write_tar(p + ".tar", s, l),
}


def _shards(s3_store, tmp_path, fmt, n=4):
    """``n`` local shards and their uploads; returns (local paths, brace pattern, URIs)."""
    local, uris = [], []
    prefix = f"pack-{tmp_path.name}"
    for k in range(n):
        seqs = random_sequences(500, seed=20 + k, max_len=700)
        p = WRITERS[fmt](str(tmp_path / f"shard-{k:03d}"), seqs, sft_labels(seqs, seed=k) if k % 2 else None)
        local.append(p)
        uris.append(s3_store.upload(p, f"{prefix}/{os.path.basename(p)}"))
    ext = os.path.splitext(local[0])[1]
    return local, f"s3://{s3_store.bucket}/{prefix}/shard-{{000..{n - 1:03d}}}{ext}", uris


@pytest.mark.parametrize("fmt,kw", [
    ("arrow", dict()),
    ("arrow", dict(workers=2, rows_per_file=40)),           # spawned workers re-create the filesystem
    ("parquet", dict(global_packing=True, workers=2)),
    ("tar", dict(overflow="split", algorithm="ffd", seed=1)),
])
def test_pack_from_s3_writes_the_local_bytes(s3_store, tmp_path, fmt, kw):
    local, pattern, uris = _shards(s3_store, tmp_path, fmt)
    kw = dict(capacity=1024, quiet=True, **kw)
    pack_dataset(local, tmp_path / "local", **kw)
    rep = pack_dataset([pattern], tmp_path / "s3", **kw)
    assert_same_packing(tmp_path / "local", tmp_path / "s3", uris)
    assert rep.reused_files == 0
    # a re-run: up to date, no file rewritten (the run's lock comes and goes in .packloader/, by design)
    before = _file_mtimes(tmp_path / "s3")
    assert pack_dataset(uris, tmp_path / "s3", **kw).reused_files == rep.files
    assert _file_mtimes(tmp_path / "s3") == before


def _file_mtimes(root) -> dict:
    """{relative path: mtime} of every file below ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root)] = os.stat(path).st_mtime_ns
    return out


def test_pack_rerun_after_a_crash_and_a_changed_object(s3_store, tmp_path):
    """Finished jobs are skipped on a re-run (per shard); an object replaced in the bucket (same size,
    other bytes) is packed again and the result equals a fresh local packing of the new content."""
    local, pattern, uris = _shards(s3_store, tmp_path, "arrow", n=3)
    kw = dict(capacity=1024, quiet=True)
    out = tmp_path / "s3"
    pack_dataset([pattern], out, **kw)
    os.remove(out / "index.json")  # killed before its index
    assert pack_dataset([pattern], out, **kw).reused_files == 3
    # shard 1 replaced by other content of the same size
    seqs = random_sequences(500, seed=99, max_len=700)
    new = write_arrow(str(tmp_path / "new.arrow"), seqs, batch_rows=400)
    old_size = os.path.getsize(local[1])
    assert os.path.getsize(new) != old_size or open(new, "rb").read() != open(local[1], "rb").read()
    os.replace(new, local[1])
    s3_store.upload(local[1], uris[1].split(f"{s3_store.bucket}/", 1)[1])
    rep = pack_dataset([pattern], out, **kw)
    assert rep.reused_files == 2
    pack_dataset(local, tmp_path / "local", **kw)
    assert_same_packing(tmp_path / "local", out, uris)


def test_pack_missing_object_is_named(s3_store, tmp_path):
    local, pattern, uris = _shards(s3_store, tmp_path, "arrow", n=2)
    missing = uris[0].replace("shard-000", "shard-002")
    with pytest.raises(DataError, match="no such object") as e:
        pack_dataset([pattern.replace("{000..001}", "{000..002}")], tmp_path / "o", capacity=1024, quiet=True)
    assert missing in str(e.value)
    assert not (tmp_path / "o").exists()


def test_out_uri_is_refused_and_file_uri_is_a_path(s3_store, tmp_path):
    local, pattern, uris = _shards(s3_store, tmp_path, "arrow", n=2)
    for out in (f"s3://{s3_store.bucket}/packed", "gs://bucket/packed"):
        with pytest.raises(DataError, match="output directory is a URI.*filesystem path") as e:
            pack_dataset(uris, out, capacity=1024, quiet=True)
        assert out in str(e.value)
    assert not os.path.exists("s3:") and not os.path.exists("gs:")
    pack_dataset(uris, "file://" + str(tmp_path / "viafile"), capacity=1024, quiet=True)
    pack_dataset(uris, tmp_path / "plain", capacity=1024, quiet=True)
    for n in os.listdir(tmp_path / "plain"):
        if n.endswith(".arrow"):
            assert open(tmp_path / "plain" / n, "rb").read() == open(tmp_path / "viafile" / n, "rb").read()


def test_cli_packs_from_s3(s3_store, tmp_path):
    from packloader.cli import main

    local, pattern, uris = _shards(s3_store, tmp_path, "tar", n=2)
    assert main(["pack", pattern, "--capacity", "1024", "--out", str(tmp_path / "o"), "-q"]) == 0
    pack_dataset(local, tmp_path / "local", capacity=1024, quiet=True)
    assert_same_packing(tmp_path / "local", tmp_path / "o", uris)


@pytest.mark.parametrize("global_packing", [False, True])
def test_object_replaced_mid_run_is_an_error(s3_store, tmp_path, monkeypatch, global_packing):
    """An object replaced after the driver fingerprinted it and before its job read it: the job says so,
    naming the URI, and nothing is committed (the index would name one version, the rows hold another)."""
    from packloader import pack_writer

    local, pattern, uris = _shards(s3_store, tmp_path, "arrow", n=2)
    real = pack_writer._source_digests

    def digests_then_replace(paths):
        out = real(paths)
        s3_store.put(uris[1].split(f"{s3_store.bucket}/", 1)[1], open(local[0], "rb").read())
        return out

    monkeypatch.setattr(pack_writer, "_source_digests", digests_then_replace)
    with pytest.raises(DataError, match="the object changed while pack was running") as e:
        pack_dataset([pattern], tmp_path / "o", capacity=1024, global_packing=global_packing, quiet=True)
    assert uris[1] in str(e.value)
    assert not (tmp_path / "o" / "index.json").exists()


def test_streaming_loader_reads_s3(s3_store, tmp_path):
    """PackedDataLoader streaming from an s3:// pattern (its worker re-creates the filesystem) yields the
    batches it yields from the local copies."""
    import numpy as np

    from packloader import PackedDataLoader

    local, pattern, uris = _shards(s3_store, tmp_path, "parquet", n=2)
    kw = dict(capacity=1024, batch_size=3, seed=5, return_ids=True)
    a = list(PackedDataLoader(local, **kw))
    b = list(PackedDataLoader([pattern], num_workers=1, **kw))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(np.asarray(x[k]), np.asarray(y[k])), k
