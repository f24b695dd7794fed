"""Synthetic token shards shared by the benchmarks (bench_prepack.py, bench_loader.py)."""
from __future__ import annotations


import numpy as np


def synth_lengths(rng, n_tokens: int, median: float, sigma: float, max_len: int) -> np.ndarray:
    """Lognormal document lengths in [1, max_len] summing to about ``n_tokens``."""
    mean = median * np.exp(sigma**2 / 2)
    n = max(1, int(n_tokens / mean * 1.1))
    lens = np.clip(np.exp(rng.normal(np.log(median), sigma, n)), 1, max_len).astype(np.int64)
    k = int(np.searchsorted(np.cumsum(lens), n_tokens)) + 1
    return lens[:k]


def write_arrow_shard(path, offsets, tokens, labels=None, batch_rows=1000):
    """An uncompressed Arrow IPC file with a ``list<int32>`` ``input_ids`` (and ``labels``) column, written
    atomically (temp file + rename)."""
    import pyarrow as pa

    off = pa.array(offsets.astype(np.int32))
    cols = {"input_ids": pa.ListArray.from_arrays(off, pa.array(tokens))}
    if labels is not None:
        cols["labels"] = pa.ListArray.from_arrays(off, pa.array(labels))
    table = pa.table(cols)
    from packloader._outdir import atomic_path

    with atomic_path(path, fsync=False, beside=True) as tmp:
        with pa.OSFile(tmp, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table, max_chunksize=batch_rows)
