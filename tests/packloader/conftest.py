"""Shared fixtures for packloader tests: small token shards in every supported format.

Use the ``shard_factory`` fixture::

    def test_something(shard_factory):
        seqs = shard_factory.sequences(100, seed=0)              # list of int32 arrays
        path = shard_factory.arrow("a.arrow", seqs)               # also .parquet(), .tar()
        paths = shard_factory.many("arrow", n_shards=3, n_seqs=50)

The writers are plain functions too (``write_arrow``, ``write_parquet``, ``write_tar``,
``random_sequences``) importable as ``from tests.packloader.conftest import write_arrow``.
"""
from __future__ import annotations

import io
import os
import pathlib
import tarfile

import numpy as np
import pyarrow as pa
import pytest


def random_sequences(n: int, *, seed: int = 0, min_len: int = 1, max_len: int = 300,
                     vocab: int = 50_000, lognormal: bool = True) -> list[np.ndarray]:
    """``n`` int32 token arrays with lengths in [min_len, max_len] (lognormal-ish by default)."""
    rng = np.random.default_rng(seed)
    if lognormal:
        lens = np.exp(rng.normal(np.log(max(min_len, max_len / 5)), 0.8, n)).astype(np.int64)
    else:
        lens = rng.integers(min_len, max_len + 1, n)
    lens = np.clip(lens, min_len, max_len)
    return [rng.integers(0, vocab, int(k), dtype=np.int32) for k in lens]


def sft_labels(seqs, *, seed: int = 1) -> list[np.ndarray]:
    """Labels like an SFT corpus: -100 over a random prompt prefix, the tokens after it."""
    rng = np.random.default_rng(seed)
    out = []
    for s in seqs:
        lab = s.copy()
        lab[: int(rng.integers(0, len(s) + 1))] = -100
        out.append(lab)
    return out


def _list_array(seqs, large: bool, value_type=pa.int32()):
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    values = np.concatenate(seqs) if seqs else np.zeros(0, np.int32)
    values = pa.array(values, type=value_type)
    if large:
        return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), values)


def make_table(seqs, labels=None, *, column: str = "input_ids", labels_column: str = "labels",
               large: bool = False, value_type=pa.int32(), extra: bool = True) -> pa.Table:
    cols = {column: _list_array(seqs, large, value_type)}
    if labels is not None:
        cols[labels_column] = _list_array(labels, large)
    if extra:
        cols["doc_id"] = pa.array(np.arange(len(seqs), dtype=np.int64))
    return pa.table(cols)


def write_arrow(path, seqs, labels=None, *, batch_rows: int | None = None, stream: bool = False, **kw) -> str:
    """Uncompressed Arrow IPC file (``stream=True``: IPC stream format) with record batches of
    ``batch_rows`` rows."""
    table = make_table(seqs, labels, **kw)
    path = os.fspath(path)
    opener = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(path, "wb") as f, opener(f, table.schema) as w:
        if len(table):
            for b in table.to_batches(max_chunksize=batch_rows or len(table)):
                w.write_batch(b)
    return path


def write_parquet(path, seqs, labels=None, *, row_group_size: int | None = None, **kw) -> str:
    import pyarrow.parquet as pq

    table = make_table(seqs, labels, **kw)
    path = os.fspath(path)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_tar(path, seqs, labels=None, *, bare_npy: bool = False, extra: bool = True,
              column: str = "input_ids", labels_column: str = "labels", dtype=None,
              key_prefix: str = "sample") -> str:
    """WebDataset tar: members ``KEY.input_ids.npy`` (or ``KEY.npy``), ``KEY.labels.npy``, ``KEY.json``."""
    path = os.fspath(path)

    def add(tf, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = 0
        tf.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w") as tf:
        for i, s in enumerate(seqs):
            key = f"{key_prefix}{i:06d}"
            arr = s if dtype is None else s.astype(dtype)
            add(tf, f"{key}.npy" if bare_npy else f"{key}.{column}.npy", _npy_bytes(arr))
            if labels is not None and labels[i] is not None:
                add(tf, f"{key}.{labels_column}.npy", _npy_bytes(labels[i]))
            if extra:
                add(tf, f"{key}.json", b'{"i": %d}' % i)
    return path


class ShardFactory:
    """Writes small shards under one temporary directory (see module docstring)."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)

    def path(self, name) -> str:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return str(p)

    sequences = staticmethod(random_sequences)
    sft_labels = staticmethod(sft_labels)

    def arrow(self, name, seqs, labels=None, **kw) -> str:
        return write_arrow(self.path(name), seqs, labels, **kw)

    def parquet(self, name, seqs, labels=None, **kw) -> str:
        return write_parquet(self.path(name), seqs, labels, **kw)

    def tar(self, name, seqs, labels=None, **kw) -> str:
        return write_tar(self.path(name), seqs, labels, **kw)

    def write(self, fmt: str, name, seqs, labels=None, **kw) -> str:
        return {"arrow": self.arrow, "parquet": self.parquet, "tar": self.tar}[fmt](name, seqs, labels, **kw)

    def many(self, fmt: str = "arrow", *, n_shards: int = 3, n_seqs: int = 50, seed: int = 0,
             max_len: int = 300, labels: bool = False, prefix: str = "shard") -> tuple[list[str], list[list[np.ndarray]]]:
        """``n_shards`` shards ``{prefix}-000.{ext}`` ...; returns (paths, sequences per shard)."""
        ext = {"arrow": "arrow", "parquet": "parquet", "tar": "tar"}[fmt]
        paths, all_seqs = [], []
        for k in range(n_shards):
            seqs = random_sequences(n_seqs, seed=seed + k, max_len=max_len)
            lab = sft_labels(seqs, seed=seed + 100 + k) if labels else None
            paths.append(self.write(fmt, f"{prefix}-{k:03d}.{ext}", seqs, lab))
            all_seqs.append(seqs)
        return paths, all_seqs


@pytest.fixture
def shard_factory(tmp_path) -> ShardFactory:
    """A :class:`ShardFactory` writing under ``tmp_path / "shards"``."""
    return ShardFactory(tmp_path / "shards")


def assert_packed_matches(out_dir, seqs_by_source: dict, labels_by_source: dict | None = None, *,
                          expect_all: bool = True) -> int:
    """Check a pre-packed directory against its sources, token by token.

    Args:
        out_dir: the ``pack_dataset`` output.
        seqs_by_source: ``{source path: list of int32 token arrays}``.
        labels_by_source: ``{source path: list of label arrays or None}`` (missing: labels = tokens).
        expect_all: every token of every non-empty sequence must appear exactly once.

    Checks: each piece equals its source slice; labels equal the source labels except -100 at each
    piece's first position; padding is 0 / -100; ``seq_lens`` sum to the row fill. Returns the rows.
    """
    from packloader.prepacked import PrepackedDataset

    labels_by_source = labels_by_source or {}
    with PrepackedDataset(out_dir) as ds:
        n = len(ds)
        ids, lab, offs, lens = ds.read_rows(0, n)
        soffs, sf, sr, ss = ds.read_sources(0, n)
        assert np.array_equal(offs, soffs)
        covered = {}
        for r in range(n):
            pos = 0
            for q in range(int(offs[r]), int(offs[r + 1])):
                src = ds.sources[int(sf[q])]
                L, row, start = int(lens[q]), int(sr[q]), int(ss[q])
                seq = seqs_by_source[src][row]
                assert np.array_equal(ids[r, pos:pos + L], seq[start:start + L]), (r, q, src, row)
                lsrc = labels_by_source.get(src)
                want = (seq if lsrc is None or lsrc[row] is None else lsrc[row])[start:start + L].copy()
                want[0] = -100
                assert np.array_equal(lab[r, pos:pos + L], want), (r, q, src, row)
                covered.setdefault((src, row), []).append((start, L))
                pos += L
            assert pos <= ds.capacity
            assert (ids[r, pos:] == 0).all() and (lab[r, pos:] == -100).all()
        if expect_all:
            for src, seqs in seqs_by_source.items():
                for row, seq in enumerate(seqs):
                    if len(seq) == 0:
                        assert (src, row) not in covered
                        continue
                    pieces = sorted(covered.get((src, row), []))
                    assert pieces, f"{src} row {row} missing"
                    pos = 0
                    for start, L in pieces:
                        assert start == pos, (src, row, pieces)
                        pos += L
                    assert pos == len(seq), (src, row, pieces)
        return n


@pytest.fixture
def seed():
    """A fresh random seed per test, printed so a failure can be replayed (PACKLOADER_TEST_SEED=...)."""
    env = os.environ.get("PACKLOADER_TEST_SEED")
    s = int(env) if env else int(np.random.SeedSequence().entropy % (2**31))
    print(f"random seed {s} (replay: PACKLOADER_TEST_SEED={s})")
    return s


# ----------------------------------------------------------------------------------------------------
# object storage: a moto S3 server (``pip install 'moto[server]' boto3``; the tests skip without it)

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}
S3_BUCKET = "packloader-test"


class S3Store:
    """The session's moto S3 server: ``endpoint`` (``http://127.0.0.1:PORT``), ``bucket``, ``client`` (boto3),
    ``env`` (the standard AWS variables pointing at it, set in ``os.environ`` while the session runs)."""

    def __init__(self, endpoint: str, client, env: dict):
        self.endpoint, self.client, self.env, self.bucket = endpoint, client, env, S3_BUCKET

    def upload(self, path, key: str) -> str:
        """Upload the local file ``path`` as ``key``; returns its ``s3://`` URI."""
        with open(path, "rb") as f:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=f.read())
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, body: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
        return f"s3://{self.bucket}/{key}"


@pytest.fixture(scope="session")
def s3_store():
    """A moto S3 server (``ThreadedMotoServer``) on 127.0.0.1 at a free port, with one bucket, and the
    standard AWS environment variables (credentials, region, ``AWS_ENDPOINT_URL``) pointing at it for the
    session, so that ``pyarrow.fs.FileSystem.from_uri("s3://...")`` reaches it in this process and in
    the processes it starts."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    boto3 = pytest.importorskip("boto3", reason="boto3 is not installed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    saved = {k: os.environ.get(k) for k in [*env, "AWS_SESSION_TOKEN", "AWS_PROFILE"]}
    os.environ.update(env)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(k, None)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        client.create_bucket(Bucket=S3_BUCKET)
        yield S3Store(endpoint, client, env)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
