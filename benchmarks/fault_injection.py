"""Fault injection: what packloader survives, what it loses (the reliability table of docs/reliability.md).

Three campaigns, each counted:

1. ``pack`` killed (SIGKILL) at random moments, 1 and 2 workers, on a fresh directory and while
   re-packing a finished one with other settings (``tests/packloader/fault_harness.py``): processes left,
   damaged finished directories, and whether a re-run equals an uninterrupted run byte for byte.
2. The shard readers on damaged files (``tests/packloader/test_reader_fuzz.py``): every cut of a file at a
   random byte, random byte flips / zeroed ranges / appended bytes; outcomes exact / error naming the
   file / changed values (payload flips in formats without checksums) / lost or invented sequences.
3. ``PackedDataLoader`` workers (2 workers, ``timeout=2``) sent SIGKILL, SIGTERM or SIGSTOP at a random
   batch: one ``WorkerError`` naming the worker within the timeout, and a resume from ``state_dict()``
   that yields exactly the batches of an uninterrupted run.
4. ``pack --engine ray --workers 2`` (``--ray-trials`` per mode; needs ``ray``): one Ray worker running a
   pack task SIGKILLed at a random moment, then the driver SIGKILLed at a random moment (half of the
   kills after the first task started), on a fresh and on a finished ``--out``; the same checks as 1,
   against the uninterrupted *local* run's bytes.

Run from the repository root::

    python benchmarks/fault_injection.py --pack-trials 25 --fuzz-cases 1000 --loader-trials 5   # docs/reliability.md
    python benchmarks/fault_injection.py --pack-trials 2 --fuzz-cases 200 --loader-trials 1   # quick
    python benchmarks/fault_injection.py --pack-trials 0 --fuzz-cases 0 --loader-trials 0 --ray-trials 10 \
        --json benchmarks/results/fault_injection_ray.json                                  # Ray only

Prints the table and writes ``benchmarks/results/fault_injection.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pack_campaign(trials: int, seed: int, ray_trials: int = 0) -> list[dict]:
    from tests.packloader import fault_harness as fh

    if not trials and not ray_trials:
        return []
    with tempfile.TemporaryDirectory() as work:
        return fh.campaign(work, trials_per_case=trials, seed=seed, n_shards=4, n_seqs=1500,
                           workers=(1, 2) if trials else (1,), ray_trials_per_case=ray_trials)


def fuzz_campaign(cases: int, seed: int) -> Counter:
    from tests.packloader.test_reader_fuzz import FORMATS, classify, original

    rng = random.Random(seed)
    out: Counter = Counter()
    for fmt in FORMATS:
        raw = original(fmt)[0]
        for _ in range(cases):  # truncations
            out[(fmt, "truncate", classify(fmt, raw[:rng.randrange(len(raw))], "t"))] += 1
        for _ in range(cases):  # corruptions
            b = bytearray(raw)
            how = rng.choice(["flip", "zero", "append"])
            if how == "flip":
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] ^= rng.randint(1, 255)
            elif how == "zero":
                a = rng.randrange(len(b))
                n = rng.randint(1, 600)
                b[a:a + n] = bytes(len(b[a:a + n]))
            else:
                b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 600)))
            out[(fmt, "corrupt", classify(fmt, bytes(b), "c"))] += 1
    return out


def loader_campaign(trials: int, seed: int) -> list[dict]:
    from packloader import PackedDataLoader
    from packloader.errors import WorkerError
    from tests.packloader.conftest import random_sequences, write_arrow

    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory() as d:
        paths = [write_arrow(os.path.join(d, f"s{k}.arrow"), random_sequences(150, seed=k, max_len=300))
                 for k in range(3)]
        kw = dict(capacity=512, overflow="split", batch_size=2, num_workers=2, timeout=2, seed=3)
        ref = [b["input_ids"].clone() for b in PackedDataLoader(paths, **kw)]
        for sig in ("SIGKILL", "SIGTERM", "SIGSTOP"):
            for _ in range(trials):
                loader = PackedDataLoader(paths, **kw)
                it = iter(loader)
                k = rng.randrange(1, len(ref) - 4)
                got = [next(it)["input_ids"].clone() for _ in range(k)]
                victim = rng.randrange(2)
                pid = it._it._workers[victim].pid
                os.kill(pid, getattr(signal, sig))
                t0 = time.monotonic()
                r = {"signal": sig, "after_batches": k, "worker": victim, "problems": []}
                try:
                    for b in it:
                        got.append(b["input_ids"].clone())
                    r["problems"].append("no error")
                except WorkerError as e:
                    r["seconds_to_error"] = round(time.monotonic() - t0, 2)
                    if e.worker != victim:
                        r["problems"].append(f"names worker {e.worker}, not {victim}")
                    if r["seconds_to_error"] > kw["timeout"] + 3:
                        r["problems"].append("error later than the timeout + 3 s")
                except Exception as e:  # noqa: BLE001 - any other error is a finding
                    r["problems"].append(f"{type(e).__name__}: {e}")
                fresh = PackedDataLoader(paths, **kw)
                fresh.load_state_dict(loader.state_dict())
                got += [b["input_ids"].clone() for b in fresh]
                r["resume_exact"] = len(got) == len(ref) and all(bool((a == b).all()) for a, b in zip(got, ref))
                if not r["resume_exact"]:
                    r["problems"].append("resume differs from the uninterrupted run")
                results.append(r)
    return results


def table(pack, fuzz, loader) -> tuple[list[tuple], dict]:
    rows = []
    for w in (1, 2):
        for mode in ("fresh", "repack"):
            rs = [r for r in pack if r["workers"] == w and r["mode"] == mode and r.get("engine", "local") == "local"]
            if not rs:
                continue
            killed = sum(r["killed"] for r in rs)
            bad = [r for r in rs if r["problems"]]
            what = "fresh --out" if mode == "fresh" else "re-pack of a finished --out (other capacity)"
            rows.append((f"SIGKILL `pack --workers {w}`, random moment, {what}", len(rs),
                         f"{len(rs) - len(bad)} re-runs byte-identical to an uninterrupted run; "
                         f"{killed} killed mid-run; orphan processes: {sum(r['orphans'] for r in rs)}"
                         + ("; finished directory readable and whole after every kill" if mode == "repack" else ""),
                         f"{len(bad)}"))
    for mode in ("fresh", "repack"):
        rs = [r for r in pack if r.get("engine") == "ray" and r["mode"] == mode]
        if not rs:
            continue
        bad = [r for r in rs if r["problems"]]
        what = "fresh --out" if mode == "fresh" else "re-pack of a finished --out (other capacity)"
        rows.append((f"SIGKILL a Ray worker mid-task, then `pack --engine ray --workers 2`, random moments, {what}",
                     len(rs), f"{len(rs) - len(bad)} re-runs byte-identical to an uninterrupted local run; "
                     f"{sum(r['killed'] for r in rs)} drivers killed mid-run, {sum(r['workers_killed'] for r in rs)} "
                     f"Ray workers killed mid-task; orphan processes: {sum(r['orphans'] for r in rs)}"
                     + ("; finished directory readable and whole after every kill" if mode == "repack" else ""),
                     f"{len(bad)}"))
    for fmt in ("arrow", "stream", "parquet", "tar"):
        for kind in ("truncate", "corrupt"):
            c = {o: fuzz.get((fmt, kind, o), 0) for o in ("exact", "error", "changed", "changed-lengths", "lost")}
            n = sum(c.values())
            if not n:
                continue
            name = {"arrow": "Arrow IPC file", "stream": "Arrow IPC stream", "parquet": "Parquet (page CRC)",
                    "tar": "WebDataset tar"}[fmt]
            what = "cut at a random byte" if kind == "truncate" else "random byte flips / zeroed range / appended bytes"
            survived = f"{c['exact']} read exactly, {c['error']} refused naming the file"
            if c["changed"] or c["changed-lengths"]:
                also = f"; {c['changed-lengths']} of them also lengths" if c["changed-lengths"] else ""
                survived += (f", {c['changed'] + c['changed-lengths']} read changed (token values{also}; "
                             "the format has no checksum)")
            rows.append((f"{name}: {what}", n, survived, str(c["lost"])))
    for sig in ("SIGKILL", "SIGTERM", "SIGSTOP"):
        rs = [r for r in loader if r["signal"] == sig]
        if rs:
            bad = [r for r in rs if r["problems"]]
            worst = max((r.get("seconds_to_error", 0) for r in rs), default=0)
            rows.append((f"{sig} to a `PackedDataLoader` worker (2 workers, timeout=2 s)", len(rs),
                         f"{len(rs) - len(bad)} one WorkerError naming the worker (at most {worst:.1f} s), resume "
                         f"exact in {sum(r.get('resume_exact', False) for r in rs)}", str(len(bad))))
    summary = {"pack_trials": len(pack), "pack_problems": sum(bool(r["problems"]) for r in pack),
               "fuzz_cases": sum(fuzz.values()), "fuzz_lost": sum(v for k, v in fuzz.items() if k[2] == "lost"),
               "loader_trials": len(loader), "loader_problems": sum(bool(r["problems"]) for r in loader)}
    return rows, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack-trials", type=int, default=25, help="kills per (workers, mode) case")
    ap.add_argument("--fuzz-cases", type=int, default=1000, help="truncations and corruptions per format, each")
    ap.add_argument("--loader-trials", type=int, default=5, help="trials per signal")
    ap.add_argument("--ray-trials", type=int, default=0,
                    help="kills of `pack --engine ray` per mode (fresh, re-pack); needs ray")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "fault_injection.json"))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    fuzz = fuzz_campaign(a.fuzz_cases, a.seed)
    loader = loader_campaign(a.loader_trials, a.seed)
    pack = pack_campaign(a.pack_trials, a.seed, a.ray_trials)
    rows, summary = table(pack, fuzz, loader)
    print("| injected | times | survived | lost |")
    print("|---|---:|---|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]} | {r[3]} |")
    findings = [r for r in pack + loader if r["problems"]]
    for f in findings:
        print("problem:", f)
    secs = time.perf_counter() - t0
    print(f"\n{summary}; {secs:.0f} s on {platform.node()} ({os.cpu_count()} cores)")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"command": "python benchmarks/fault_injection.py " + " ".join(argv or sys.argv[1:]),
                   "seconds": round(secs, 1), "summary": summary,
                   "table": [dict(zip(("injected", "times", "survived", "lost"), r)) for r in rows],
                   "pack": pack, "loader": loader,
                   "fuzz": [{"format": k[0], "kind": k[1], "outcome": k[2], "count": v} for k, v in sorted(fuzz.items())]},
                  f, indent=1)
    print(f"wrote {a.json}")
    return 1 if findings or summary["fuzz_lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
