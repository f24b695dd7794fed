"""Pre-packing throughput: token shards in, packed Arrow IPC rows out (``pack_dataset``), one process.

Generates synthetic token shards once (lognormal document lengths, random ids) into a git-ignored folder
(default ``.bench_data/prepack/``), in every requested source format:

* ``arrow``: uncompressed Arrow IPC files, ``list<int32>`` tokens in record batches of ``--batch-rows``
  rows (1,000 like Hugging Face ``datasets``), read memory-mapped;
* ``tar``: WebDataset shards, one ``KEY.input_ids.npy`` member per document;
* ``parquet`` (optional): uncompressed Parquet.

Then, per format, packs all shards ``--repeats`` times into a fresh output directory with
``pack_dataset(..., workers=1)`` and reports input tokens per second of wall time (planning, reading,
scattering and writing included). A warm-up pack of a small shard of each format runs first, so the Numba
JIT compile (or cache load) is excluded. The inputs are in the page cache (they were just written or read);
the outputs go through the page cache to the output folder's disk.

Targets (issue 3): Arrow IPC >= 50 M tokens/s, WebDataset tar >= 10 M tokens/s.

With ``--engine ray`` it compares the engines instead, on the Arrow shards: ``pack_dataset(...,
engine="local", workers=W)`` (W processes) against ``engine="ray", workers=W`` (W Ray tasks in flight on
one local Ray instance with 2 CPUs, started once, outside the timed runs: its start-up time is reported
apart) for W = 1 and 2, in one run; both outputs are checked equal byte for byte. Writes
``benchmarks/results/prepack/prepack_ray.json``.

With ``--s3-moto`` it compares reading the shards from local paths with reading the same shards from
``s3://`` URIs (pyarrow's S3 filesystem) served by a ``moto`` S3 server on 127.0.0.1, run as a separate
process (``pip install 'moto[server]' boto3``), one packing process, per format. This is a LOCAL EMULATION:
moto is a Python web server keeping objects in memory, on the same 2 cores as the packer; its numbers say
what the URI path costs next to a memory map on this machine, not what S3 delivers (per-connection
bandwidth, latency, parallel streams). Writes ``benchmarks/results/prepack/prepack_s3_moto.json``.

Usage::

    python benchmarks/bench_prepack.py                       # ~200 M tokens per format, ~1-2 minutes
    python benchmarks/bench_prepack.py --engine ray          # local vs Ray, 1 and 2 workers
    python benchmarks/bench_prepack.py --quick               # seconds (smoke test)
    python benchmarks/bench_prepack.py --s3-moto --tokens 5e7 --shards 4 --formats arrow,tar,parquet
    python benchmarks/bench_prepack.py --tokens 4e8 --shards 16 --formats arrow,tar,parquet \\
        --out benchmarks/results/prepack/prepack.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _synthetic import machine_info, synth_lengths, write_arrow_shard, write_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TARGETS = {"arrow": 50e6, "tar": 10e6}
EXT = {"arrow": "arrow", "tar": "tar", "parquet": "parquet"}
GEN_VERSION = 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few million tokens, runs in seconds")
    p.add_argument("--tokens", type=float, default=2e8, help="total input tokens per format (default 2e8)")
    p.add_argument("--shards", type=int, default=8, help="shards per format (default 8)")
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--algorithm", default="bfd")
    p.add_argument("--overflow", default="split", help="documents longer than capacity (default split)")
    p.add_argument("--median-length", type=float, default=600.0, help="median document length (lognormal)")
    p.add_argument("--sigma", type=float, default=1.1, help="lognormal sigma of document lengths")
    p.add_argument("--max-length", type=int, default=16384, help="longest document")
    p.add_argument("--batch-rows", type=int, default=1000, help="rows per Arrow record batch in the inputs")
    p.add_argument("--formats", default="arrow,tar", help="comma-separated: arrow, tar, parquet")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(ROOT, ".bench_data", "prepack"),
                   help="where the synthetic shards are kept (git-ignored)")
    p.add_argument("--out-dir", default=None, help="where packed outputs go (default DATA_DIR/out)")
    p.add_argument("--out", default=None,
                   help="JSON results file (default benchmarks/results/prepack/prepack.json, or prepack_ray.json "
                        "with --engine ray)")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: one process per format; ray: local vs Ray engine, 1 and 2 workers (Arrow)")
    p.add_argument("--s3-moto", action="store_true",
                   help="local paths vs s3:// URIs served by a local moto S3 server (an emulation), 1 process")
    a = p.parse_args(argv)
    if a.out is None:
        name = "prepack_ray.json" if a.engine == "ray" else "prepack_s3_moto.json" if a.s3_moto else "prepack.json"
        a.out = os.path.join(ROOT, "benchmarks", "results", "prepack", name)
    if a.engine == "ray":
        a.formats = "arrow"
    if a.quick:
        a.tokens = min(a.tokens, 4e6)
        a.shards = min(a.shards, 2)
        a.repeats = min(a.repeats, 2)
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    for f in a.formats:
        if f not in EXT:
            p.error(f"unknown format {f!r}")
    return a


# ---------------------------------------------------------------------------------------------- data


def write_parquet_shard(path, offsets, tokens, batch_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    from packloader._outdir import atomic_path

    with atomic_path(path, fsync=False, beside=True) as tmp:
        pq.write_table(pa.table({"input_ids": arr}), tmp, compression="none", row_group_size=max(batch_rows, 16384))


def ensure_data(a) -> dict:
    """Generate (or reuse) the shards; returns {format: (paths, tokens, sequences)}."""
    from packloader.prepare import write_webdataset_shard

    spec = {"version": GEN_VERSION, "tokens": int(a.tokens), "shards": a.shards, "median": a.median_length,
            "sigma": a.sigma, "max_length": a.max_length, "batch_rows": a.batch_rows, "seed": a.seed}
    os.makedirs(a.data_dir, exist_ok=True)
    spec_path = os.path.join(a.data_dir, "spec.json")
    old = None
    if os.path.isfile(spec_path):
        with open(spec_path) as f:
            old = json.load(f)
    if old is None or old.get("spec") != spec:
        old = {"spec": spec, "formats": {}}
        for name in os.listdir(a.data_dir):
            if name.startswith("shard-"):
                os.remove(os.path.join(a.data_dir, name))
    out = {}
    per_shard = int(a.tokens) // a.shards
    for fmt in a.formats:
        paths = [os.path.join(a.data_dir, f"shard-{k:03d}.{EXT[fmt]}") for k in range(a.shards)]
        done = old["formats"].get(fmt)
        if done and all(os.path.isfile(p) for p in paths):
            out[fmt] = (paths, done["tokens"], done["sequences"])
            continue
        t0 = time.perf_counter()
        n_tok = n_seq = 0
        for k, path in enumerate(paths):
            rng = np.random.default_rng([a.seed, k])  # the same documents in every format
            lens = synth_lengths(rng, per_shard, a.median_length, a.sigma, a.max_length)
            offsets = np.zeros(len(lens) + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            tokens = rng.integers(0, 50_277, int(offsets[-1]), dtype=np.int32)
            if fmt == "arrow":
                write_arrow_shard(path, offsets, tokens, batch_rows=a.batch_rows)
            elif fmt == "parquet":
                write_parquet_shard(path, offsets, tokens, a.batch_rows)
            else:
                write_webdataset_shard(path, offsets, tokens)
            n_tok += int(offsets[-1])
            n_seq += len(lens)
        old["formats"][fmt] = {"tokens": n_tok, "sequences": n_seq}
        with open(spec_path, "w") as f:
            json.dump(old, f, indent=1)
        size = sum(os.path.getsize(p) for p in paths)
        print(f"generated {len(paths)} {fmt} shards: {n_seq:,} documents, {n_tok:,} tokens, "
              f"{size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        out[fmt] = (paths, n_tok, n_seq)
    return out


def warm_up(a, out_root):
    """Pack a small shard of every format once: compiles / loads the Numba kernels."""
    from packloader.pack_writer import pack_dataset
    from packloader.prepare import write_webdataset_shard

    rng = np.random.default_rng(1)
    lens = synth_lengths(rng, 200_000, a.median_length, a.sigma, a.max_length)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = rng.integers(0, 50_277, int(offsets[-1]), dtype=np.int32)
    d = os.path.join(out_root, "warmup")
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    for fmt in a.formats:
        p = os.path.join(d, f"w.{EXT[fmt]}")
        if fmt == "arrow":
            write_arrow_shard(p, offsets, tokens, batch_rows=a.batch_rows)
        elif fmt == "parquet":
            write_parquet_shard(p, offsets, tokens, a.batch_rows)
        else:
            write_webdataset_shard(p, offsets, tokens)
        pack_dataset([p], os.path.join(d, f"out-{fmt}"), capacity=a.capacity, algorithm=a.algorithm,
                     overflow=a.overflow, quiet=True)
    shutil.rmtree(d)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- run


def bench_format(a, fmt, paths, n_tok, out_root, input_bytes: int | None = None) -> dict:
    from packloader.pack_writer import pack_dataset

    out = os.path.join(out_root, f"packed-{fmt}")
    runs = []
    for _ in range(a.repeats):
        shutil.rmtree(out, ignore_errors=True)  # a fresh directory: nothing to reuse
        t0 = time.perf_counter()
        rep = pack_dataset(paths, out, capacity=a.capacity, algorithm=a.algorithm, overflow=a.overflow,
                           workers=1, quiet=True)
        dt = time.perf_counter() - t0
        assert rep.tokens == n_tok and rep.reused_files == 0
        runs.append({"seconds": dt, "read_s": rep.read_seconds, "plan_s": rep.plan_seconds,
                     "write_s": rep.write_seconds, "rows": rep.rows, "efficiency": rep.efficiency})
    out_bytes = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".arrow"))
    shutil.rmtree(out, ignore_errors=True)
    secs = [r["seconds"] for r in runs]
    best = min(range(len(runs)), key=lambda i: secs[i])
    return {
        "format": fmt,
        "tokens": n_tok,
        "input_bytes": sum(os.path.getsize(p) for p in paths) if input_bytes is None else input_bytes,
        "output_bytes": out_bytes,
        "seconds": secs,
        "best_tokens_per_s": n_tok / secs[best],
        "median_tokens_per_s": n_tok / statistics.median(secs),
        "best_run": runs[best],
        "rows": runs[best]["rows"],
        "efficiency": runs[best]["efficiency"],
        "target_tokens_per_s": TARGETS.get(fmt),
        "meets_target": (n_tok / secs[best] >= TARGETS[fmt]) if fmt in TARGETS else None,
    }


def _same_bytes(d1, d2) -> bool:
    names = sorted(n for n in os.listdir(d1) if n.endswith(".arrow"))
    if names != sorted(n for n in os.listdir(d2) if n.endswith(".arrow")):
        return False
    for n in names:
        with open(os.path.join(d1, n), "rb") as f1, open(os.path.join(d2, n), "rb") as f2:
            if f1.read() != f2.read():
                return False
    return True


def bench_engines(a, paths, n_tok, out_root) -> dict:
    """local vs ray, W = 1 and 2; the Ray instance is started once (timed apart)."""
    import logging

    import ray

    from packloader.pack_writer import pack_dataset

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    ray_start = time.perf_counter() - t0
    kw = dict(capacity=a.capacity, algorithm=a.algorithm, overflow=a.overflow, quiet=True)
    rows = []
    try:
        # warm-up: every Ray worker process loads the Numba kernels once
        pack_dataset(paths[:2], os.path.join(out_root, "warm-ray"), engine="ray", workers=2, **kw)
        shutil.rmtree(os.path.join(out_root, "warm-ray"))
        for w in (1, 2):
            for engine in ("local", "ray"):
                out = os.path.join(out_root, f"packed-{engine}-{w}")
                secs = []
                for _ in range(a.repeats):
                    shutil.rmtree(out, ignore_errors=True)
                    t0 = time.perf_counter()
                    rep = pack_dataset(paths, out, engine=engine, workers=w, **kw)
                    secs.append(time.perf_counter() - t0)
                    assert rep.tokens == n_tok and rep.reused_files == 0
                rows.append({"engine": engine, "workers": w, "seconds": secs,
                             "best_tokens_per_s": n_tok / min(secs),
                             "median_tokens_per_s": n_tok / statistics.median(secs)})
            same = _same_bytes(os.path.join(out_root, f"packed-local-{w}"), os.path.join(out_root, f"packed-ray-{w}"))
            rows[-1]["same_bytes_as_local"] = same
            assert same, f"ray output differs from local with {w} workers"
    finally:
        ray.shutdown()
        for name in os.listdir(out_root):
            if name.startswith("packed-"):
                shutil.rmtree(os.path.join(out_root, name), ignore_errors=True)
    return {"ray_version": ray.__version__, "ray_start_seconds": ray_start, "rows": rows}


def main_engines(a) -> int:
    load0 = os.getloadavg()
    data = ensure_data(a)
    paths, n_tok, n_seq = data["arrow"]
    out_root = a.out_dir or os.path.join(a.data_dir, "out")
    os.makedirs(out_root, exist_ok=True)
    warm = warm_up(a, out_root)
    res = bench_engines(a, paths, n_tok, out_root)
    load1 = os.getloadavg()
    print(f"pre-packing engines: {len(paths)} Arrow shards, {n_tok:,} tokens, {n_seq:,} documents, capacity "
          f"{a.capacity}, {a.algorithm}, overflow={a.overflow}, {a.repeats} runs each; Ray {res['ray_version']} "
          f"local instance (2 CPUs) started once in {res['ray_start_seconds']:.1f} s, not timed; "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f} on {os.cpu_count()} CPUs")
    head = (f"{'engine':<7} {'workers':>7} {'best s':>8} {'median s':>9} {'best M tok/s':>13} {'median M tok/s':>15}"
            "  same bytes")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        same = r.get("same_bytes_as_local")
        print(f"{r['engine']:<7} {r['workers']:>7} {min(r['seconds']):>8.3f} {statistics.median(r['seconds']):>9.3f} "
              f"{r['best_tokens_per_s'] / 1e6:>13.1f} {r['median_tokens_per_s'] / 1e6:>15.1f}  "
              f"{'-' if same is None else ('yes' if same else 'NO')}")

    doc = {
        "benchmark": "prepack_engines",
        "command": "python benchmarks/bench_prepack.py " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "machine": machine_info(load0, load1),
        "warmup_seconds": warm,
        "tokens": n_tok,
        "documents": n_seq,
        **res,
    }
    write_result(a.out, doc)
    return 0


def _moto_server():
    """A moto S3 server in its own process on a free port; returns (process, endpoint URL)."""
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the moto server did not start (pip install 'moto[server]')")
            time.sleep(0.2)


def main_s3(a) -> int:
    """Local paths vs s3:// URIs on a local moto server (an emulation), per format, 1 process."""
    import boto3

    load0 = os.getloadavg()
    data = ensure_data(a)
    out_root = a.out_dir or os.path.join(a.data_dir, "out")
    os.makedirs(out_root, exist_ok=True)
    proc, endpoint = _moto_server()
    try:
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=endpoint)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        uris, upload_s = {}, {}
        for fmt in a.formats:
            t0 = time.perf_counter()
            uris[fmt] = []
            for p in data[fmt][0]:
                client.upload_file(p, "bench", f"tok/{os.path.basename(p)}")
                uris[fmt].append(f"s3://bench/tok/{os.path.basename(p)}")
            upload_s[fmt] = time.perf_counter() - t0
        warm = warm_up(a, out_root)
        results = []
        for fmt in a.formats:
            paths, n_tok = data[fmt][:2]
            size = sum(os.path.getsize(p) for p in paths)
            local = bench_format(a, fmt, paths, n_tok, out_root)
            remote = bench_format(a, fmt, uris[fmt], n_tok, out_root, input_bytes=size)
            assert (remote["rows"], remote["efficiency"]) == (local["rows"], local["efficiency"])
            results += [dict(local, source="local path"), dict(remote, source="s3:// (moto, local emulation)")]
    finally:
        proc.terminate()
        proc.wait()
    load1 = os.getloadavg()
    print(f"pre-packing from local paths vs s3:// URIs on a LOCAL moto S3 server (a separate Python process on this "
          f"machine: an emulation, not S3's bandwidth or latency); 1 process, capacity {a.capacity}, {a.algorithm}, "
          f"{a.repeats} runs each; load average {load0[0]:.2f} -> {load1[0]:.2f} on {os.cpu_count()} CPUs")
    head = (f"{'format':<8} {'source':<31} {'tokens':>12} {'MB':>7} {'best s':>7} {'median s':>9} "
            f"{'best M tok/s':>13} {'read/plan/write s (best)':>25}")
    print(head)
    print("-" * len(head))
    for r in results:
        b = r["best_run"]
        print(f"{r['format']:<8} {r['source']:<31} {r['tokens']:>12,} {r['input_bytes'] / 1e6:>7.0f} "
              f"{min(r['seconds']):>7.3f} {statistics.median(r['seconds']):>9.3f} {r['best_tokens_per_s'] / 1e6:>13.1f} "
              f"{b['read_s']:>7.3f} /{b['plan_s']:>6.3f} /{b['write_s']:>7.3f}")
    doc = {
        "benchmark": "prepack_s3_moto",
        "note": "s3:// served by a local moto server (Python, in-memory, same machine): an emulation, not S3",
        "command": "python benchmarks/bench_prepack.py " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "machine": machine_info(load0, load1, moto=__import__("moto").__version__),
        "warmup_seconds": warm,
        "upload_seconds": upload_s,
        "results": results,
    }
    write_result(a.out, doc)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.engine == "ray":
        return main_engines(a)
    if a.s3_moto:
        return main_s3(a)

    load0 = os.getloadavg()
    data = ensure_data(a)
    out_root = a.out_dir or os.path.join(a.data_dir, "out")
    os.makedirs(out_root, exist_ok=True)
    warm = warm_up(a, out_root)
    results = [bench_format(a, fmt, *data[fmt][:2], out_root) for fmt in a.formats]
    load1 = os.getloadavg()

    head = (f"{'source':<8} {'tokens':>13} {'documents':>10} {'best s':>8} {'median s':>9} {'best M tok/s':>13} "
            f"{'median M tok/s':>15} {'read/plan/write s (best)':>25} {'target':>8}  ok")
    print(f"pre-packing, 1 process: capacity {a.capacity}, {a.algorithm}, overflow={a.overflow}, "
          f"{a.repeats} runs each, warm-up {warm:.1f} s excluded; load average {load0[0]:.2f} -> {load1[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(head)
    print("-" * len(head))
    for r in results:
        b = r["best_run"]
        tgt = r["target_tokens_per_s"]
        print(f"{r['format']:<8} {r['tokens']:>13,} {data[r['format']][2]:>10,} {min(r['seconds']):>8.3f} "
              f"{statistics.median(r['seconds']):>9.3f} {r['best_tokens_per_s'] / 1e6:>13.1f} "
              f"{r['median_tokens_per_s'] / 1e6:>15.1f} "
              f"{b['read_s']:>7.3f} /{b['plan_s']:>6.3f} /{b['write_s']:>7.3f} "
              f"{'' if tgt is None else f'{tgt / 1e6:.0f} M':>8}  "
              f"{'-' if r['meets_target'] is None else ('yes' if r['meets_target'] else 'NO')}")
    print(f"(packed rows: {results[0]['rows']:,} at {100 * results[0]['efficiency']:.2f} % efficiency; "
          f"output {results[0]['output_bytes'] / 1e9:.2f} GB per run)")

    doc = {
        "benchmark": "prepack",
        "config": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "machine": machine_info(load0, load1),
        "warmup_seconds": warm,
        "results": results,
    }
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
