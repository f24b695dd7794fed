"""Helpers for the PackedDataLoader tests: a pre-packed directory writer (per docs/architecture.md),
and checkers that compare loader batches with the source sequences."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa

from packloader.prepacked import packed_schema

IGNORE = -100


def write_prepacked(directory, seqs_by_file, capacity: int, *, rows_per_file: int = 7, batch_rows: int = 3,
                    algorithm: str = "bfd") -> tuple[str, list[tuple[int, int, int, int]]]:
    """Pack ``seqs_by_file`` (list of lists of int32 arrays) with ``packer_algos.pack`` and write a
    pre-packed directory. Returns (directory, rows) where rows[i] is the list of
    (file, row, start, length) pieces of packed row i."""
    from packer_algos import pack

    os.makedirs(directory, exist_ok=True)
    flat = [(f, r, s) for f, seqs in enumerate(seqs_by_file) for r, s in enumerate(seqs)]
    lengths = np.array([len(s) for _, _, s in flat], dtype=np.int64)
    plan = pack(lengths, capacity, algorithm, overflow="split")
    rows = []
    for b in range(plan.n_bins):
        items, starts, lens = plan.bin(b)
        rows.append([(flat[i][0], flat[i][1], int(st), int(n)) for i, st, n in zip(items, starts, lens)])
    files, total_tokens = [], 0
    schema = packed_schema(capacity)
    for k, lo in enumerate(range(0, len(rows), rows_per_file)):
        chunk = rows[lo:lo + rows_per_file]
        ids = np.zeros((len(chunk), capacity), np.int32)
        lab = np.full((len(chunk), capacity), IGNORE, np.int32)
        seq_lens, sfile, srow, sstart = [], [], [], []
        for i, pieces in enumerate(chunk):
            t = 0
            for f, r, st, n in pieces:
                toks = seqs_by_file[f][r][st:st + n]
                ids[i, t:t + n] = toks
                lab[i, t + 1:t + n] = toks[1:]
                t += n
            total_tokens += t
            seq_lens.append([p[3] for p in pieces])
            sfile.append([p[0] for p in pieces])
            srow.append([p[1] for p in pieces])
            sstart.append([p[2] for p in pieces])
        c = capacity
        table = pa.table({
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), c),
            "labels": pa.FixedSizeListArray.from_arrays(pa.array(lab.reshape(-1)), c),
            "seq_lens": pa.array(seq_lens, pa.list_(pa.int32())),
            "source_file": pa.array(sfile, pa.list_(pa.int32())),
            "source_row": pa.array(srow, pa.list_(pa.int64())),
            "source_start": pa.array(sstart, pa.list_(pa.int32())),
        }).cast(schema)
        name = f"part-{k:05d}.arrow"
        with pa.OSFile(os.path.join(directory, name), "wb") as fh, pa.ipc.new_file(fh, schema) as w:
            for rb in table.to_batches(max_chunksize=batch_rows):
                w.write_batch(rb)
        files.append({"name": name, "rows": len(chunk), "tokens": int(sum(sum(x) for x in seq_lens)),
                      "bytes": os.path.getsize(os.path.join(directory, name))})
    h = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    index = {"format": "packloader-packed", "version": 1, "capacity": capacity, "algorithm": algorithm,
             "files": files, "sources": [f"src-{i}" for i in range(len(seqs_by_file))], "content_hash": h,
             "total_rows": len(rows), "total_tokens": total_tokens,
             "total_sequences": int((lengths > 0).sum())}
    with open(os.path.join(directory, "index.json"), "w") as fh:
        json.dump(index, fh)
    return os.fspath(directory), rows


def check_stream_batch(batch, seqs_by_file, capacity: int) -> list[tuple[int, int, int, int]]:
    """Assert that a streaming batch (``return_ids=True``) holds exactly the source tokens its
    ``sample_ids`` name, with the documented labels / position_ids / seq_idx; return its pieces."""
    ids = batch["input_ids"].numpy()
    lab = batch["labels"].numpy()
    pos = batch["position_ids"].numpy()
    seq = batch["seq_idx"].numpy()
    B, L = ids.shape
    assert L == capacity
    table = batch["sample_ids"].numpy()
    fill = np.zeros(B, np.int64)
    nseg = np.zeros(B, np.int64)
    pieces = []
    for r, f, q, st, n in table.tolist():
        t = fill[r]
        src = seqs_by_file[f][q][st:st + n]
        assert len(src) == n and t + n <= L
        np.testing.assert_array_equal(ids[r, t:t + n], src)
        np.testing.assert_array_equal(pos[r, t:t + n], np.arange(n))
        assert (seq[r, t:t + n] == nseg[r]).all()
        assert lab[r, t] == IGNORE
        np.testing.assert_array_equal(lab[r, t + 1:t + n], src[1:])
        fill[r] += n
        nseg[r] += 1
        pieces.append((f, q, st, n))
    for r in range(B):
        t = fill[r]
        if t < L:  # padding tail: its own segment, no loss, positions count from 0
            assert (lab[r, t:] == IGNORE).all()
            np.testing.assert_array_equal(pos[r, t:], np.arange(L - t))
            assert (seq[r, t:] == nseg[r]).all()
    assert batch["num_loss_tokens"] == int((lab != IGNORE).sum())
    cu = batch["cu_seqlens"].numpy()
    assert cu[0] == 0 and cu[-1] == B * L and (np.diff(cu) > 0).all()
    assert batch["max_seqlen"] == int(np.diff(cu).max())
    return pieces


def assert_exact_cover(pieces, seqs_by_file):
    """Every non-empty source sequence is covered exactly once by the (file, row, start, length) pieces."""
    by_seq: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for f, q, st, n in pieces:
        by_seq.setdefault((f, q), []).append((st, n))
    want = {(f, q) for f, seqs in enumerate(seqs_by_file) for q, s in enumerate(seqs) if len(s)}
    assert set(by_seq) == want, (len(set(by_seq) ^ want), sorted(set(by_seq) ^ want)[:5])
    for (f, q), parts in by_seq.items():
        parts.sort()
        t = 0
        for st, n in parts:
            assert st == t, (f, q, parts)
            t += n
        assert t == len(seqs_by_file[f][q]), (f, q, parts)


def batch_fingerprint(batch) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        v = batch[k]
        h.update(k.encode())
        h.update(v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
    return h.hexdigest()[:16]
