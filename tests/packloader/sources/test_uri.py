"""Shards named by URI (packloader.sources.uri): read from a moto S3 server exactly as from local files;
brace / glob / prefix patterns on the bucket's listing; errors that name the URI. Skipped without
``moto[server]`` and ``boto3`` (the ``dev`` extra)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from packloader.errors import DataError
from packloader.sources import open_shard, resolve_sources
from packloader.sources import uri as U
from tests.packloader.conftest import random_sequences, sft_labels, write_arrow, write_parquet, write_tar


def _same_batch(a, b):
    assert np.array_equal(a.offsets, b.offsets)
    assert np.array_equal(a.tokens, b.tokens)
    assert (a.labels is None) == (b.labels is None)
    if a.labels is not None:
        assert np.array_equal(a.labels, b.labels)


WRITERS = {
    "arrow": lambda p, s, l: write_arrow(p + ".arrow", s, l, batch_rows=70),
    "arrow-stream": lambda p, s, l: write_arrow(p + ".arrows", s, l, batch_rows=70, stream=True),
    "parquet": lambda p, s, l: write_parquet(p + ".parquet", s, l, row_group_size=90),
    "tar": lambda p, s, l: write_tar(p + ".tar", s, l),
    # names > 100 bytes (pax headers): the general indexer, which reads names out of the buffer
    "tar-long-names": lambda p, s, l: write_tar(p + ".tar", s, l, key_prefix="k" * 120),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_object_reads_like_the_local_file(s3_store, tmp_path, fmt):
    """Every sequence, label and length of a shard read by URI equals the local reader's; batches from
    a start row too; the shard is named by its URI."""
    seqs = random_sequences(300, seed=3, max_len=400)
    local = WRITERS[fmt](str(tmp_path / "a b"), seqs, sft_labels(seqs))
    uri = s3_store.upload(local, f"{tmp_path.name}/{os.path.basename(local)}").replace(" ", "%20")
    with open_shard(local, batch_rows=64) as a, open_shard(uri, batch_rows=64) as b:
        assert b.path == uri and type(a) is type(b) and len(a) == len(b) == 300
        assert np.array_equal(a.lengths(), b.lengths())
        _same_batch(a.read_all(), b.read_all())
        for x, y in zip(a.iter_batches(start=101), b.iter_batches(start=101), strict=True):
            assert x.row_start == y.row_start
            _same_batch(x, y)


def test_file_uri_is_the_local_path(tmp_path):
    """file:// URIs take the local readers (memory-mapped) and resolve to local paths."""
    p = write_arrow(str(tmp_path / "x y.arrow"), random_sequences(10))
    uri = "file://" + str(tmp_path / "x%20y.arrow")
    assert resolve_sources([uri]) == [p]
    assert resolve_sources(["file://" + str(tmp_path / "*.arrow")]) == [p]
    with open_shard(uri) as sh:
        assert sh.path == p and len(sh) == 10


@pytest.fixture(scope="module")
def listing(s3_store, tmp_path_factory):
    """A prefix with shard-000..004.arrow, a .json, a nested shard, a key with a space; returns its URI."""
    d = tmp_path_factory.mktemp("listing")
    src = write_arrow(str(d / "s.arrow"), random_sequences(5))
    prefix = f"listing-{d.name}"
    for k in range(5):
        s3_store.upload(src, f"{prefix}/shard-{k:03d}.arrow")
    s3_store.put(f"{prefix}/notes.json", b"{}")
    s3_store.upload(src, f"{prefix}/sub/shard-005.arrow")
    s3_store.upload(src, f"{prefix}/with space.arrow")
    return f"s3://{s3_store.bucket}/{prefix}"


def test_braces_globs_and_prefixes(listing):
    names = lambda uris: [u[len(listing) + 1:] for u in uris]  # noqa: E731
    assert names(resolve_sources(f"{listing}/shard-{{002..000}}.arrow")) == [f"shard-{k:03d}.arrow" for k in (2, 1, 0)]
    assert names(resolve_sources(f"{listing}/shard-*.arrow")) == [f"shard-{k:03d}.arrow" for k in range(5)]
    assert names(resolve_sources(f"{listing}/shard-00[13].arrow")) == ["shard-001.arrow", "shard-003.arrow"]
    assert names(resolve_sources(f"{listing}/shard-00[!13].arrow")) == ["shard-000.arrow", "shard-002.arrow",
                                                                          "shard-004.arrow"]
    assert names(resolve_sources(f"{listing}/**/shard-*.arrow")) == [f"shard-{k:03d}.arrow" for k in range(5)] + [
        "sub/shard-005.arrow"]
    assert names(resolve_sources(f"{listing}/*/shard-*.arrow")) == ["sub/shard-005.arrow"]
    # a prefix: the shards directly inside it, sorted (not the .json, not the nested one)
    assert names(resolve_sources(listing + "/")) == [f"shard-{k:03d}.arrow" for k in range(5)] + ["with%20space.arrow"]
    assert names(resolve_sources(listing)) == names(resolve_sources(listing + "/"))
    # percent-encoding, both ways; duplicates dropped (first kept)
    got = resolve_sources([f"{listing}/with%20space.arrow", f"{listing}/with*", f"{listing}/shard-000.arrow"])
    assert names(got) == ["with%20space.arrow", "shard-000.arrow"]
    with open_shard(got[0]) as sh:
        assert len(sh) == 5


def test_errors_name_the_uri(listing, s3_store, tmp_path):
    missing = f"{listing}/shard-009.arrow"
    with pytest.raises(DataError, match="no such object") as e:
        resolve_sources([f"{listing}/shard-000.arrow", missing])
    assert missing in str(e.value)
    with pytest.raises(DataError, match="no such object") as e:
        resolve_sources(f"{listing}/shard-{{003..009}}.arrow")  # braces do not drop a missing object
    assert f"{listing}/shard-005.arrow" in str(e.value)
    with pytest.raises(DataError, match="no such object") as e:
        open_shard(missing)
    assert missing in str(e.value)
    with pytest.raises(DataError, match="matches no shard"):
        resolve_sources(f"{listing}/nothing-*.arrow")
    with pytest.raises(DataError, match="no such object"):
        resolve_sources(f"s3://no-such-bucket-{tmp_path.name.lower()[:20]}/x.arrow")
    with pytest.raises(DataError, match="unsupported shard suffix"):
        resolve_sources(f"{listing}/notes.json")
    with pytest.raises(DataError, match="bucket .* cannot be a pattern"):
        resolve_sources("s3://packloader-*/x.arrow")
    # a secret in the URI: refused, and not repeated in the message
    with pytest.raises(DataError, match="carries a secret") as e:
        resolve_sources(f"s3://AKIA:hunter2@{s3_store.bucket}/x.arrow")
    assert "hunter2" not in str(e.value)
    # a damaged object: the reader's error, naming the URI
    good = write_arrow(str(tmp_path / "g.arrow"), random_sequences(200, seed=1))
    blob = open(good, "rb").read()
    bad = s3_store.put(f"{tmp_path.name}/cut.arrow", blob[: len(blob) // 2])
    with pytest.raises(DataError, match="corrupt or unreadable Arrow") as e:
        open_shard(bad)
    assert bad in str(e.value)
    bad_tar = s3_store.put(f"{tmp_path.name}/cut.tar", open(write_tar(str(tmp_path / "t.tar"), random_sequences(20)),
                                                            "rb").read()[:3000])
    with pytest.raises(DataError, match="tar") as e:
        open_shard(bad_tar)
    assert bad_tar in str(e.value)


def test_object_digest_changes_with_the_content(s3_store, tmp_path):
    uri = s3_store.put(f"{tmp_path.name}/d.arrow", b"a" * 300_000)
    d0 = U.object_digest(uri)
    assert U.object_digest(uri) == d0
    s3_store.put(f"{tmp_path.name}/d.arrow", b"a" * 299_999 + b"b")  # same size, last byte changed
    assert U.object_digest(uri) != d0
