"""``packloader demo``: the whole path on the corpus embedded in the package, offline.

1. tokenize 4,000 GSM8K training problems (embedded, MIT) with the GPT-NeoX-20B tokenizer (embedded,
   Apache-2.0) into Arrow shards, prompt masked for supervised fine-tuning;
2. pre-pack them twice at capacity 2048, with ``next_fit`` (in-order greedy, the usual baseline) and
   ``bfd`` (best-fit decreasing);
3. read a packed row back and check it against the source tokens;
4. print both reports side by side and write ``lengths.png`` (length histogram, fill of rows).

Example::

    >>> from packloader.demo import run_demo
    >>> reports = run_demo("demo_out")                                   # doctest: +SKIP

Re-running reuses finished outputs (same inputs and settings) and rewrites only what changed.
"""
from __future__ import annotations

import os
import time
from importlib import resources

import numpy as np

from packloader._log import log

__all__ = ["run_demo", "data_path", "CORPUS", "TOKENIZER", "DEMO_CAPACITY"]

CORPUS = "gsm8k_train_sample.jsonl.gz"
TOKENIZER = "gpt-neox-20b-tokenizer.json.gz"
DEMO_CAPACITY = 2048


def data_path(name: str) -> str:
    """Path of a file embedded in ``packloader/data``."""
    p = resources.files("packloader").joinpath("data", name)
    path = os.fspath(p)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"embedded data file {name!r} is missing from the installed package ({path})")
    return path


def _check_row(ds, shards_dir: str) -> str:
    """Compare packed row 0 with the source sequences it came from; return a one-line summary."""
    from packloader.sources import open_shard

    ids, labels, offs, lens = ds.read_rows(0, 1)
    _, sf, sr, ss = ds.read_sources(0, 1)
    cache = {}
    pos = 0
    for k in range(int(offs[1])):
        src = ds.sources[int(sf[k])]
        if src not in cache:
            cache[src] = open_shard(src).read_all()
        b = cache[src]
        n = int(lens[k])
        want = b.sequence(int(sr[k]))[int(ss[k]):int(ss[k]) + n]
        if not np.array_equal(ids[0, pos:pos + n], want) or labels[0, pos] != -100:
            raise AssertionError(f"packed row 0, piece {k}: tokens differ from {src} row {int(sr[k])}")
        pos += n
    if (ids[0, pos:] != 0).any() or (labels[0, pos:] != -100).any():
        raise AssertionError("packed row 0: padding is not 0 / -100")
    return (f"row 0 holds {int(offs[1])} sequences ({pos} of {ds.capacity} tokens); every token matches its "
            "source, labels -100 at each sequence start and on padding")


def run_demo(out_dir="demo_out", *, capacity: int = DEMO_CAPACITY, algorithms=("next_fit", "bfd"),
             limit: int | None = None, shard_size: int = 1000, plot: bool = True, quiet: bool = False,
             stream=None) -> dict:
    """Run the demo; return ``{algorithm: PackingReport}``.

    Args:
        out_dir: where to write ``tokens/``, ``packed-<algorithm>/`` and ``lengths.png``.
        capacity: tokens per packed row (GSM8K problems are 50-450 tokens: 2048 holds about a dozen).
        algorithms: the packing algorithms compared.
        limit: use only the first ``limit`` problems (tests).
        shard_size: problems per token shard.
        plot: write ``lengths.png``.
        quiet: print nothing (the reports are returned).
        stream: where the table goes (default stdout).

    The reports' throughput excludes the one-time Numba compilation: the packing kernels are compiled
    (or loaded from Numba's on-disk cache) on a small warm-up shard first, and that time is printed on its
    own line.
    """
    import sys

    from packloader.pack_writer import pack_dataset
    from packloader.prepacked import PrepackedDataset
    from packloader.prepare import prepare_jsonl
    from packloader.report import plot_reports, side_by_side

    stream = stream or sys.stdout
    t0 = time.perf_counter()
    out_dir = os.fspath(out_dir)
    tok_dir = os.path.join(out_dir, "tokens")
    log(f"packloader demo: {CORPUS} + {TOKENIZER} (embedded) -> {out_dir}", quiet=quiet)
    prep = prepare_jsonl(data_path(CORPUS), tok_dir, tokenizer=data_path(TOKENIZER),
                         fields=("question", "answer"), mask_prompt=True, format="arrow",
                         shard_size=shard_size, limit=limit, quiet=quiet, progress=False)
    # one-time Numba compilation (cached on disk after the first run), timed apart from the packing
    t_compile = time.perf_counter()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="packloader-demo-warmup-") as warm:
        for alg in algorithms:
            pack_dataset(prep.paths[:1], os.path.join(warm, alg), capacity=capacity, algorithm=alg,
                         quiet=True, progress=False)
    t_compile = time.perf_counter() - t_compile
    reports = {}
    for alg in algorithms:
        reports[alg] = pack_dataset(prep.paths, os.path.join(out_dir, f"packed-{alg}"), capacity=capacity,
                                    algorithm=alg, quiet=quiet, progress=False)
    best = algorithms[-1]
    ds = PrepackedDataset(os.path.join(out_dir, f"packed-{best}"))
    check = _check_row(ds, tok_dir)
    ds.close()
    titles = [f"{a}" for a in algorithms]
    if quiet:
        if plot:
            plot_reports([reports[a] for a in algorithms], os.path.join(out_dir, "lengths.png"), titles=titles)
        return reports
    print("", file=stream)
    print(f"packloader demo: {prep.sequences:,} GSM8K problems, {prep.tokens:,} tokens "
          f"({prep.loss_tokens:,} with loss), capacity {capacity}", file=stream)
    print(side_by_side([reports[a] for a in algorithms], titles=titles), file=stream)
    if len(algorithms) >= 2:
        a, b = reports[algorithms[0]], reports[algorithms[-1]]
        if a.rows:
            print(f"{algorithms[-1]} needs {b.rows:,} rows where {algorithms[0]} needs {a.rows:,} "
                  f"({100 * (a.rows - b.rows) / a.rows:.1f} % fewer); padding {a.padding_tokens:,} -> "
                  f"{b.padding_tokens:,} tokens; lower bound ceil(tokens / capacity) = {b.lower_bound:,} rows; "
                  f"unpacked in batches of {b.baseline_batch_size} padded to their longest: "
                  f"{b.baseline_padding:,} padding tokens; one sequence per step: {b.unpacked_rows:,} steps.",
                  file=stream)
    print(f"one-time Numba compilation (warm-up, not in the throughput above): {t_compile:.2f} s", file=stream)
    print(f"check: {check}", file=stream)
    if plot:
        png = plot_reports([reports[a] for a in algorithms], os.path.join(out_dir, "lengths.png"), titles=titles)
        print(f"plot: {png}", file=stream)
    print(f"outputs under {out_dir}/ (tokens/, {', '.join(f'packed-{a}/' for a in algorithms)}); "
          f"{time.perf_counter() - t0:.1f} s", file=stream)
    return reports
