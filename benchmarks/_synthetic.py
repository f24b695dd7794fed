"""Synthetic token shards, and the machine record and JSON writing, shared by the benchmarks (bench_prepack.py,
bench_loader.py)."""
from __future__ import annotations

import os

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


def machine_info(load_before, load_after, **extra) -> dict:
    """What a CPU benchmark ran on: cores, platform, library versions, the load averages around the run."""
    import platform

    import numba
    import pyarrow

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "pyarrow": pyarrow.__version__, "numba": numba.__version__, **extra,
            "loadavg_before": load_before, "loadavg_after": load_after}


def write_result(path, doc: dict) -> None:
    """``doc`` (plus its creation time) as JSON at ``path``, creating the folder."""
    import json
    import time

    doc = dict(doc, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


def init_distributed(device_kind: str):
    """``torchrun`` process group for a benchmark: NCCL on this rank's GPU (``LOCAL_RANK``) or gloo on the CPU.
    Returns ``(device, rank, world_size)``."""
    import torch
    import torch.distributed as dist

    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_rank(), dist.get_world_size()
