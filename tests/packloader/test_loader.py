"""PackedDataLoader end to end: formats, pre-packed directories, determinism, DataLoader options, bad input."""
import gc
import json
import warnings
import weakref

import numpy as np
import pytest
import torch

from packloader import DataError, PackedDataLoader
from tests.packloader.conftest import random_sequences, sft_labels, write_arrow, write_parquet, write_tar
from tests.packloader.loader_fixtures import (assert_exact_cover, batch_fingerprint, check_stream_batch,
                                              write_prepacked)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning",
                                        "ignore:.*pin_memory.*:UserWarning")

WRITERS = {"arrow": write_arrow, "parquet": write_parquet, "tar": write_tar}


def fresh_seed():
    return int(np.random.default_rng().integers(1 << 30))


def make_shards(root, fmt, n_shards=3, n_seqs=40, labels=False, max_len=250):
    seed = fresh_seed()
    paths, seqs, labs = [], [], []
    for k in range(n_shards):
        s = random_sequences(n_seqs, seed=seed + k, max_len=max_len)
        lab = sft_labels(s, seed=seed + 50 + k) if labels else None
        ext = {"arrow": "arrow", "parquet": "parquet", "tar": "tar"}[fmt]
        paths.append(WRITERS[fmt](root / f"shard-{k:03d}.{ext}", s, lab))
        seqs.append(s)
        labs.append(lab)
    return paths, seqs, labs


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "tar"])
def test_streaming_formats_give_source_tokens_and_cover_once(tmp_path, fmt):
    paths, seqs, _ = make_shards(tmp_path, fmt)
    loader = PackedDataLoader(str(tmp_path / f"shard-{{000..002}}.{'arrow' if fmt == 'arrow' else fmt}"),
                              capacity=300, batch_size=3, return_ids=True, seed=fresh_seed())
    assert loader.sources == paths
    pieces = []
    for b in loader:
        pieces += check_stream_batch(b, seqs, 300)
        assert b["input_ids"].dtype == torch.int64 and b["seq_idx"].dtype == torch.int32
    assert_exact_cover(pieces, seqs)


def test_labels_column_is_used(tmp_path):
    paths, seqs, labs = make_shards(tmp_path, "arrow", labels=True)
    loader = PackedDataLoader(paths, capacity=256, batch_size=2, return_ids=True)
    n_loss = 0
    for b in loader:
        lab = b["labels"].numpy()
        # walk pieces per row, compare with the source label column (first token always -100)
        fill = {}
        for r, f, q, st, n in b["sample_ids"].tolist():
            t = fill.get(r, 0)
            want = labs[f][q][st:st + n].astype(np.int64).copy()
            want[0] = -100
            np.testing.assert_array_equal(lab[r, t:t + n], want)
            fill[r] = t + n
        n_loss += b["num_loss_tokens"]
    expected = sum(int((l[1:] != -100).sum()) for ls in labs for l in ls if len(l))
    assert n_loss == expected


def test_offline_algorithm_and_no_shuffle(tmp_path):
    paths, seqs, _ = make_shards(tmp_path, "arrow")
    pieces = []
    loader = PackedDataLoader(paths, capacity=256, batch_size=4, algorithm="bfd", return_ids=True)
    for b in loader:
        pieces += check_stream_batch(b, seqs, 256)
    assert_exact_cover(pieces, seqs)
    # shuffle=False with next_fit: sequences come in file order
    loader = PackedDataLoader(paths, capacity=256, batch_size=4, algorithm="next_fit", shuffle=False,
                              return_ids=True)
    order = [tuple(x[1:3]) for b in loader for x in b["sample_ids"].tolist()]
    assert order == sorted(order)


def test_deterministic_and_set_epoch_reshuffles(tmp_path):
    paths, _, _ = make_shards(tmp_path, "arrow")
    kw = dict(capacity=256, batch_size=2, seed=11)
    a = PackedDataLoader(paths, **kw)
    b = PackedDataLoader(paths, num_workers=2, **kw)
    ep0 = [batch_fingerprint(x) for x in a]
    assert [batch_fingerprint(x) for x in b] == ep0
    assert [batch_fingerprint(x) for x in a] == ep0  # iterating again without set_epoch repeats
    a.set_epoch(1)
    b.set_epoch(1)
    ep1 = [batch_fingerprint(x) for x in a]
    assert ep1 != ep0 and [batch_fingerprint(x) for x in b] == ep1
    c = PackedDataLoader(paths, capacity=256, batch_size=2, seed=12)
    assert [batch_fingerprint(x) for x in c] != ep0


def test_persistent_workers_follow_set_epoch(tmp_path):
    paths, _, _ = make_shards(tmp_path, "arrow")
    ref = PackedDataLoader(paths, capacity=256, batch_size=2, seed=3)
    pw = PackedDataLoader(paths, capacity=256, batch_size=2, seed=3, num_workers=2, persistent_workers=True,
                          prefetch_factor=1, pin_memory=True)
    for epoch in range(3):
        ref.set_epoch(epoch)
        pw.set_epoch(epoch)
        assert [batch_fingerprint(x) for x in pw] == [batch_fingerprint(x) for x in ref]


def test_hf_compat_keys(tmp_path):
    paths, _, _ = make_shards(tmp_path, "arrow", n_shards=1)
    b = next(iter(PackedDataLoader(paths, capacity=128, overflow="split", batch_size=2, hf_compat=True)))
    assert torch.equal(b["cu_seq_lens_q"], b["cu_seqlens"]) and torch.equal(b["cu_seq_lens_k"], b["cu_seqlens"])
    assert b["max_length_q"] == b["max_length_k"] == b["max_seqlen"]
    assert int(b["cu_seqlens"][-1]) == 2 * 128


def test_prepacked_directory(tmp_path):
    seed = fresh_seed()
    seqs = [random_sequences(30, seed=seed + k, max_len=200) for k in range(3)]
    d, rows = write_prepacked(tmp_path / "packed", seqs, 256, rows_per_file=5, batch_rows=2)
    all_rows, pieces, counts = [], [], []
    for rank in range(3):
        loader = PackedDataLoader(d, batch_size=2, rank=rank, world_size=3, return_ids=True, seed=seed)
        assert loader.capacity == 256
        batches = list(loader)
        counts.append(len(batches))
        for b in batches:
            pieces += check_stream_batch(b, seqs, 256)
            for r, g in enumerate(b["row_ids"].tolist()):
                if g >= 0:
                    assert [tuple(p) for p in b["sample_ids"][b["sample_ids"][:, 0] == r][:, 1:].tolist()] == \
                        [tuple(p) for p in rows[g]]
            all_rows += [g for g in b["row_ids"].tolist() if g >= 0]
    assert len(set(counts)) == 1
    assert sorted(all_rows) == list(range(len(rows)))
    assert_exact_cover(pieces, seqs)
    with pytest.raises(ValueError, match="capacity=512 does not match"):
        PackedDataLoader(d, capacity=512)


def test_prepacked_from_pack_dataset(tmp_path):
    from packloader import pack_dataset

    paths, seqs, _ = make_shards(tmp_path, "arrow", n_shards=2)
    pack_dataset(paths, tmp_path / "out", capacity=256, algorithm="bfd", quiet=True)
    loader = PackedDataLoader(tmp_path / "out", batch_size=4, num_workers=1, return_ids=True)
    pieces = [p for b in loader for p in check_stream_batch(b, seqs, 256)]
    assert_exact_cover(pieces, seqs)


# ---- bad input ------------------------------------------------------------------------------------

def test_empty_source_is_named(tmp_path):
    p = write_arrow(tmp_path / "empty.arrow", [])
    with pytest.raises(DataError, match="empty.arrow.*no tokens"):
        PackedDataLoader(p, capacity=64)
    with pytest.raises(DataError, match="matches no shard"):
        PackedDataLoader(str(tmp_path / "nothing-*.arrow"), capacity=64)
    with pytest.raises(ValueError, match="empty list"):
        PackedDataLoader([], capacity=64)


def test_too_long_sequence_with_overflow_error_names_file_and_row(tmp_path):
    seqs = random_sequences(10, seed=1, max_len=50)
    seqs[6] = np.arange(1, 100, dtype=np.int32)
    p = write_arrow(tmp_path / "long.arrow", seqs)
    with pytest.raises(DataError, match="long.arrow, row 6: sequence of 99 tokens is longer than capacity 64"):
        PackedDataLoader(p, capacity=64, overflow="error")


@pytest.mark.parametrize("kw, msg", [
    ({"batch_size": 0}, "batch_size"),
    ({"buffer_size": -1}, "buffer_size"),
    ({"num_workers": -1}, "num_workers"),
    ({"capacity": 0}, "capacity"),
    ({"algorithm": "magic"}, "algorithm"),
    ({"rank": 2, "world_size": 2}, "rank"),
])
def test_bad_arguments_are_named(tmp_path, kw, msg):
    p = write_arrow(tmp_path / "a.arrow", random_sequences(5, seed=0, max_len=20))
    with pytest.raises(ValueError, match=msg):
        PackedDataLoader(p, **kw)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_errors_reach_the_main_process(tmp_path, persistent):
    """A shard that changes after the loader read its lengths fails clearly inside a worker; the workers
    are stopped at once (not left to the garbage collector), and the next epoch fails the same way."""
    p = write_arrow(tmp_path / "a.arrow", random_sequences(20, seed=0, max_len=100))
    loader = PackedDataLoader(p, capacity=128, batch_size=2, num_workers=2, persistent_workers=persistent)
    (tmp_path / "a.arrow").write_bytes(b"not arrow any more")
    it = iter(loader)
    with pytest.raises(Exception, match="a.arrow"):
        next(it)
    assert it._it._workers and not any(w.is_alive() for w in it._it._workers)
    with pytest.raises(Exception, match="a.arrow"):
        list(loader)


@pytest.mark.parametrize("persistent", [False, True])
def test_abandoned_worker_iterators_are_freed_without_the_garbage_collector(tmp_path, persistent):
    """No loader <-> iterator reference cycle: an abandoned iterator (and with persistent workers, the
    loader) is freed by reference counting, so its workers stop at once. (torch's worker shutdown run
    from the cyclic garbage collector waits 5 s per worker.)"""
    paths, _, _ = make_shards(tmp_path, "arrow")
    loader = PackedDataLoader(paths, capacity=256, batch_size=2, num_workers=2, persistent_workers=persistent)
    gc.disable()
    try:
        it = iter(loader)
        next(it)
        inner = weakref.ref(it._it)
        workers = list(it._it._workers)
        del it
        if persistent:
            assert inner() is not None  # kept by the DataLoader for the next epoch, as torch does
            del loader
        assert inner() is None
    finally:
        gc.enable()
    for w in workers:
        w.join(timeout=10)
        assert not w.is_alive()


def test_state_is_small_json(tmp_path):
    paths, _, _ = make_shards(tmp_path, "arrow")
    loader = PackedDataLoader(paths, capacity=128, overflow="split", batch_size=2)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    text = json.dumps(sd)
    assert len(text) < 1000 and sd["batches_consumed"] == 1
    assert json.loads(text) == sd


@pytest.mark.parametrize("kind", ["stream", "prepacked"])
def test_batch_keys_and_dtypes_are_the_documented_ones(tmp_path, kind):
    """Every loader batch has exactly the keys of packloader.batch.BATCH_KEYS (+ the hf_compat names),
    with the documented shapes and dtypes; cu_seqlens spans the flattened B*L tokens and agrees with
    seq_idx / position_ids."""
    from packloader.batch import BATCH_KEYS

    paths, seqs, _ = make_shards(tmp_path, "arrow", n_shards=2)
    src = paths
    if kind == "prepacked":
        src, _ = write_prepacked(tmp_path / "pp", seqs, 256)
    loader = PackedDataLoader(src, capacity=256, batch_size=3, hf_compat=True, num_workers=1)
    dtypes = {"int64": torch.int64, "int32": torch.int32}
    n = 0
    for b in loader:
        n += 1
        assert set(b) == set(BATCH_KEYS) | {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
        for key, (shape, dtype) in BATCH_KEYS.items():
            if dtype is None:
                assert type(b[key]) is int, key
            else:
                assert b[key].dtype == dtypes[dtype], key
                if shape == "[B, L]":
                    assert tuple(b[key].shape) == (3, 256), key
        pos, seg = b["position_ids"].reshape(-1), b["seq_idx"]
        starts = torch.nonzero(pos == 0).reshape(-1)
        cu = b["cu_seqlens"]
        assert cu.tolist() == starts.tolist() + [3 * 256]
        # a new segment starts exactly where seq_idx changes or a row begins
        seg_start = torch.ones(3, 256, dtype=torch.bool)
        seg_start[:, 1:] = seg[:, 1:] != seg[:, :-1]
        assert torch.equal(seg_start.reshape(-1), pos == 0)
        assert b["max_seqlen"] == int(torch.diff(cu).max()) == b["max_length_q"] == b["max_length_k"]
        assert torch.equal(b["cu_seq_lens_q"], cu) and torch.equal(b["cu_seq_lens_k"], cu)
        assert b["num_loss_tokens"] == int((b["labels"] != -100).sum())
    assert n == len(loader) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-accelerator fallback")
def test_pin_memory_without_accelerator_warns_and_still_yields(tmp_path):
    paths, _, _ = make_shards(tmp_path, "arrow", n_shards=1)
    with pytest.warns(UserWarning, match="pin_memory=True but no accelerator"):
        loader = PackedDataLoader(paths, capacity=128, overflow="split", batch_size=2, pin_memory=True, num_workers=1)
    assert loader.pin_memory is False
    ref = PackedDataLoader(paths, capacity=128, overflow="split", batch_size=2)
    assert [batch_fingerprint(b) for b in loader] == [batch_fingerprint(b) for b in ref]


def test_bench_loader_quick_smoke(tmp_path):
    """``benchmarks/bench_loader.py --quick`` runs both cases, prints its table and writes its JSON
    (the figures themselves are for a quiet machine, not checked here)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "loader.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_loader.py"), "--quick",
                           "--tokens", "1e6", "--data-dir", str(tmp_path / "data"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prepacked" in proc.stdout and "stream" in proc.stdout and "x 1M tok/s" in proc.stdout
    doc = json.loads(out.read_text())
    cases = {r["case"]: r for r in doc["results"]}
    assert set(cases) == {"prepacked", "stream"}
    assert cases["prepacked"]["num_workers"] == 0 and cases["stream"]["num_workers"] == 2
    for r in cases.values():
        assert r["tokens"] == doc["data"]["tokens"] > 0
        assert r["best_tokens_per_s"] > 0 and r["ratio_to_1M_tokens_per_s"] == r["best_tokens_per_s"] / 1e6
        assert isinstance(r["meets_target"], bool)
    # the pre-packed directory was written by packloader's own pack_dataset
    assert json.loads((tmp_path / "data" / "packed" / "index.json").read_text())["format"] == "packloader-packed"


# ---------------------------------------------------------------- overflow: one default, counted, said once

def _long_shard(tmp_path, name="long.arrow"):
    """10 short sequences and two longer than 64 tokens (rows 3: 99 tokens, 6: 150 tokens)."""
    seqs = random_sequences(10, seed=3, max_len=50)
    seqs[3] = np.arange(1, 100, dtype=np.int32)
    seqs[6] = np.arange(1, 151, dtype=np.int32)
    return write_arrow(tmp_path / name, seqs), seqs


def test_overflow_default_is_error_naming_file_row_and_length(tmp_path):
    p, _ = _long_shard(tmp_path)
    with pytest.raises(DataError, match=r"long.arrow, row 3: sequence of 99 tokens is longer than capacity 64 "
                                        r"\(2 such sequence"):
        PackedDataLoader(p, capacity=64)
    with pytest.raises(ValueError, match="overflow must be one of"):
        PackedDataLoader(p, capacity=64, overflow="wrap")


@pytest.mark.parametrize("policy, counts", [
    ("split", {"split": 2, "truncated": 0, "dropped": 0, "split_tokens": 249, "lost_tokens": 0}),
    ("truncate", {"split": 0, "truncated": 2, "dropped": 0, "split_tokens": 0, "lost_tokens": 35 + 86}),
    ("drop", {"split": 0, "truncated": 0, "dropped": 2, "split_tokens": 0, "lost_tokens": 249}),
])
def test_overflow_policies_are_counted_warned_once_and_saved(tmp_path, policy, counts):
    p, seqs = _long_shard(tmp_path)
    with pytest.warns(UserWarning, match=f"2 sequence.s. longer than capacity 64 were") as rec:
        loader = PackedDataLoader(p, capacity=64, batch_size=2, overflow=policy, seed=fresh_seed(),
                                  return_ids=True)
    assert sum("longer than capacity" in str(w.message) for w in rec) == 1
    assert loader.overflow_counts == {"policy": policy, **counts}
    # the counts agree with what the batches hold: every token but the lost ones is placed
    real = sum(len(s) for s in seqs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # iterating does not warn again
        placed = sum(int(b["sample_ids"][:, 4].sum()) for b in loader)
    assert placed == real - counts["lost_tokens"]
    state = loader.state_dict()
    assert state["overflow_counts"] == loader.overflow_counts
    json.dumps(state)
    with pytest.warns(UserWarning, match="longer than capacity"):
        fresh = PackedDataLoader(p, capacity=64, batch_size=2, overflow=policy, seed=loader.seed,
                                 return_ids=True)
    fresh.load_state_dict(state)
    assert fresh.overflow_counts == loader.overflow_counts
    bad = {**state, "overflow_counts": {**state["overflow_counts"], "lost_tokens": 1}}
    with pytest.raises(ValueError, match="overflow_counts"):
        fresh.load_state_dict(bad)


def test_no_overflow_no_warning_and_zero_counts(tmp_path):
    p, _ = _long_shard(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = PackedDataLoader(p, capacity=200, overflow="split")
    assert loader.overflow_counts == {"policy": "split", "split": 0, "truncated": 0, "dropped": 0,
                                      "split_tokens": 0, "lost_tokens": 0}


def test_prepacked_directory_refuses_another_algorithm_or_overflow(tmp_path):
    from packloader import pack_dataset

    p, _ = _long_shard(tmp_path)
    out = tmp_path / "packed"
    pack_dataset([p], out, capacity=64, algorithm="bfd", overflow="truncate", quiet=True)
    with pytest.raises(ValueError, match=r"algorithm='ffd' does not match the pre-packed directory .*"
                                         r"packed with algorithm 'bfd'"):
        PackedDataLoader(str(out), algorithm="ffd")
    with pytest.raises(ValueError, match=r"overflow=.split. does not match .* \(packed with overflow .truncate."):
        PackedDataLoader(str(out), overflow="split")
    with pytest.warns(UserWarning, match="truncated .* when the directory was packed"):
        loader = PackedDataLoader(str(out), algorithm="bfd", overflow="truncate")
    assert loader.overflow_counts == {"policy": "truncate", "split": 0, "truncated": 2, "dropped": 0,
                                      "split_tokens": None, "lost_tokens": 35 + 86}
    with pytest.warns(UserWarning, match="truncated"):
        PackedDataLoader(str(out))  # unset: the directory's own


def test_prepacked_row_order_is_computed_once_per_epoch(tmp_path, monkeypatch):
    """The epoch's row permutation is drawn once per epoch, not once per batch (it was: a third of the
    pre-packed loader's time); the batches are the same as with a fresh permutation each time."""
    from packloader import prepacked, rows as rows_mod

    seed = fresh_seed()
    seqs = [random_sequences(40, seed=seed + k, max_len=200) for k in range(2)]
    d, _ = write_prepacked(tmp_path / "packed", seqs, 256, rows_per_file=7)
    want = [batch_fingerprint(b) for b in PackedDataLoader(d, batch_size=2, seed=seed)]
    calls = []
    real = rows_mod.epoch_rng

    def counting(seed_, epoch, salt, extra=0):
        calls.append((epoch, salt))
        return real(seed_, epoch, salt, extra)

    monkeypatch.setattr(prepacked, "epoch_rng", counting)
    loader = PackedDataLoader(d, batch_size=2, seed=seed)
    got = [batch_fingerprint(b) for b in loader]
    assert got == want and len(got) > 3
    assert calls.count((0, rows_mod.SALT_ROWS)) <= 2  # (the plan's row lengths, then the batches)
    loader.set_epoch(1)
    assert [batch_fingerprint(b) for b in loader] != want
    rows = prepacked.PrepackedRows(d)
    o = rows.order(seed, 3, True)
    assert not o.flags.writeable and rows.order(seed, 3, True) is o
    assert np.array_equal(o, real(seed, 3, rows_mod.SALT_ROWS).permutation(rows.n_rows))
    assert np.array_equal(rows.order(seed, 3, False), np.arange(rows.n_rows))


@pytest.mark.parametrize("global_packing", [False, True])
def test_prepacked_file_replaced_by_another_valid_one_is_refused_at_open(tmp_path, global_packing):
    """Issue 36: a packed file replaced by another valid one of the same size (same rows, same schema) used
    to be served; the job hash each file carries is now checked against index.json when the loader is built
    (no data read), and ``verify=True`` checks the crc as well."""
    import os
    import shutil

    from packloader.pack_writer import pack_dataset
    from packloader.prepacked import PrepackedDataset

    src = [write_arrow(tmp_path / f"s{k}.arrow", random_sequences(60, seed=k, max_len=100)) for k in range(2)]
    kw = dict(capacity=128, global_packing=global_packing, quiet=True)
    pack_dataset(src, tmp_path / "a", **kw)
    pack_dataset(src, tmp_path / "b", vocab_size=50_000, **kw)  # same rows and bytes, another job hash
    a = sorted(n for n in os.listdir(tmp_path / "a") if n.endswith(".arrow"))
    b = sorted(n for n in os.listdir(tmp_path / "b") if n.endswith(".arrow"))
    assert os.path.getsize(tmp_path / "a" / a[0]) == os.path.getsize(tmp_path / "b" / b[0])
    shutil.copyfile(tmp_path / "b" / b[0], tmp_path / "a" / a[0])
    with pytest.raises(DataError, match=rf"{a[0]}: file was written by another packing job"):
        PackedDataLoader(str(tmp_path / "a"), batch_size=2)
    with pytest.raises(DataError, match="another packing job"):
        PrepackedDataset(tmp_path / "a")
    # a flipped token (same size, same job hash): found by the checksum, with verify=True
    pack_dataset(src, tmp_path / "c", **kw)
    c = sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".arrow"))[0]
    with PrepackedDataset(tmp_path / "c") as ds:
        first_tokens = ds.read_rows(0, 1)[0][0, :4].tobytes()
    raw = bytearray(open(tmp_path / "c" / c, "rb").read())
    pos = bytes(raw).find(first_tokens)
    assert pos > 0
    raw[pos] ^= 0x01
    open(tmp_path / "c" / c, "wb").write(bytes(raw))
    PackedDataLoader(str(tmp_path / "c"), batch_size=2)  # sizes, rows and job hashes agree
    with pytest.raises(DataError, match=rf"{c}: checksum mismatch"):
        PackedDataLoader(str(tmp_path / "c"), batch_size=2, verify=True)
