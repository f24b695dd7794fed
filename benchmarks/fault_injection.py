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
5. Concurrent writers (``--concurrency-trials`` per case): two ``pack`` (or two ``prepare``) processes into
   one ``--out``, the second started 0-0.3 s after the first, with equal or different settings: at most one
   fails, with the lock's error; the directory verifies and holds exactly its manifest's files, every
   sequence once.
6. Duplicate inputs (``--duplicate-trials``): one file under two names (``./``, absolute path, symlink, hard
   link, overlapping globs) packed once with a warning; a tar shard with a member or a key given twice
   refused, naming the shard and the key.

Run from the repository root::

    python benchmarks/fault_injection.py --pack-trials 25 --fuzz-cases 1000 --loader-trials 5   # docs/reliability.md
    python benchmarks/fault_injection.py --pack-trials 0 --fuzz-cases 0 --loader-trials 0 \
        --concurrency-trials 10 --duplicate-trials 25 --json benchmarks/results/fault_injection/fault_injection_issue36.json
    python benchmarks/fault_injection.py --pack-trials 2 --fuzz-cases 200 --loader-trials 1   # quick
    python benchmarks/fault_injection.py --pack-trials 0 --fuzz-cases 0 --loader-trials 0 --ray-trials 10 \
        --json benchmarks/results/fault_injection/fault_injection_ray.json                      # Ray only

Prints the table and writes ``benchmarks/results/fault_injection/fault_injection.json``.
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


def _cli(*args, **kw):
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "packloader.cli", *[str(a) for a in args]], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _check_pack_dir(out, n_seqs: int) -> list[str]:
    """Problems of a pack directory: it must verify, hold exactly its index's files and every sequence once."""
    problems = []
    r = _cli("report", out, "--verify", "-q")
    _, err = r.communicate(timeout=300)
    if r.returncode:
        problems.append(f"report --verify: {err.strip()}")
        return problems
    with open(os.path.join(out, "index.json"), encoding="utf-8") as f:
        index = json.load(f)
    listed = sorted(e["name"] for e in index["files"])
    on_disk = sorted(n for n in os.listdir(out) if n not in (".packloader", "index.json"))
    if on_disk != listed:
        problems.append(f"files not in index.json: {sorted(set(on_disk) - set(listed))}")
    if index["total_sequences"] != n_seqs:
        problems.append(f"{index['total_sequences']} sequences packed, {n_seqs} given")
    if os.path.exists(os.path.join(out, ".packloader", "lock")):
        problems.append("lock file left")
    return problems


def _check_prepare_dir(out, n_records: int) -> list[str]:
    from packloader.sources import open_shard

    with open(os.path.join(out, "prepare.json"), encoding="utf-8") as f:
        m = json.load(f)
    problems = []
    on_disk = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    if on_disk != sorted(m["shards"]) or m.get("replacing"):
        problems.append(f"shards not in prepare.json: {sorted(set(on_disk) - set(m['shards']))}")
    globbed = 0
    for n in on_disk:  # what `out/*.arrow` reads, as the README does
        sh = open_shard(os.path.join(out, n))
        globbed += len(sh)
        sh.close()
    if globbed != n_records:
        problems.append(f"out/*.arrow holds {globbed} sequences, {n_records} records given")
    if os.path.exists(os.path.join(out, ".packloader", "lock")):
        problems.append("lock file left")
    return problems


def concurrency_campaign(trials: int, seed: int) -> list[dict]:
    """Two ``pack`` / ``prepare`` processes into one ``--out`` at (nearly) the same moment."""
    from packloader.demo import TOKENIZER, data_path
    from tests.packloader.conftest import random_sequences, write_arrow
    from tests.packloader.test_data_safety import write_jsonl

    if not trials:
        return []
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory() as d:
        src = [write_arrow(os.path.join(d, f"s{k}.arrow"), random_sequences(6000, seed=k, max_len=300))
               for k in range(4)]
        text = write_jsonl(os.path.join(d, "in.jsonl"), 6000)
        args = {"pack": lambda out, v: ("pack", *src, "--out", out, "--capacity", v, "-q"),
                "prepare": lambda out, v: ("prepare", text, "--tokenizer", data_path(TOKENIZER), "--out", out,
                                           "--shard-size", v, "-q")}
        values = {"pack": (1024, 2048), "prepare": (1000, 700)}
        for tool in ("pack", "prepare"):
            for settings in ("equal", "different"):
                for t in range(trials):
                    out = os.path.join(d, f"{tool}-{settings}-{t}")
                    a, b = values[tool] if settings == "different" else (values[tool][0],) * 2
                    delay = rng.uniform(0, 0.3)
                    first = _cli(*args[tool](out, a))
                    time.sleep(delay)
                    second = _cli(*args[tool](out, b))
                    outs = [p.communicate(timeout=600) for p in (first, second)]
                    rcs = [first.returncode, second.returncode]
                    r = {"tool": tool, "settings": settings, "delay": round(delay, 3), "rc": rcs, "problems": []}
                    refused = [o[1] for rc, o in zip(rcs, outs) if rc]
                    r["refused"] = len(refused)
                    if len(refused) > 1 or any("output directory is in use by" not in e for e in refused):
                        r["problems"].append(f"failures: {refused}")
                    if len(refused) < 2:
                        r["problems"] += (_check_pack_dir(out, 24000) if tool == "pack"
                                          else _check_prepare_dir(out, 6000))
                    results.append(r)
    return results


def duplicate_campaign(trials: int, seed: int) -> list[dict]:
    """One file under two names (packed once, with a warning); a tar key given twice (refused)."""
    import io
    import tarfile
    import warnings

    import numpy as np

    from packloader.errors import DataError
    from packloader.pack_writer import pack_dataset
    from tests.packloader.conftest import random_sequences, write_arrow

    if not trials:
        return []
    rng = random.Random(seed)
    results = []
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            for t in range(trials):
                n = rng.randint(5, 200)
                base = write_arrow(f"b{t}.arrow", random_sequences(n, seed=t, max_len=80))
                how = rng.choice(["./", "absolute", "symlink", "hard link", "overlapping globs"])
                if how == "./":
                    names = [base, "./" + base]
                elif how == "absolute":
                    names = [base, os.path.abspath(base)]
                elif how == "symlink":
                    os.symlink(base, f"l{t}.arrow")
                    names = [base, f"l{t}.arrow"]
                elif how == "hard link":
                    os.link(base, f"h{t}.arrow")
                    names = [f"h{t}.arrow", base]
                else:
                    names = [f"b{t}.arr*", f"./b{t}.*"]
                r = {"case": "names", "how": how, "problems": []}
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    rep = pack_dataset(names, f"out-{t}", capacity=128, quiet=True)
                if rep.sequences != n:
                    r["problems"].append(f"{rep.sequences} sequences packed from a file of {n}")
                if not any("read once" in str(x.message) for x in w):
                    r["problems"].append("no warning")
                results.append(r)

                seqs = random_sequences(rng.randint(2, 50), seed=t, max_len=40)
                members = []
                for i, s_ in enumerate(seqs):
                    b = io.BytesIO()
                    np.save(b, s_)
                    members.append((f"k{i:04d}.input_ids.npy", b.getvalue()))
                i = rng.randrange(len(members))
                how = rng.choice(["member twice", "key again later"])
                members.insert(i + 1 if how == "member twice" else len(members), members[i])
                path = f"dup{t}.tar"
                with tarfile.open(path, "w") as tf:
                    for name, data in members:
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
                key = members[i][0].split(".")[0]
                r = {"case": "tar key", "how": how, "problems": []}
                try:
                    pack_dataset(path, f"outt-{t}", capacity=64, quiet=True)
                    r["problems"].append("packed without an error")
                except DataError as e:
                    if path not in str(e) or repr(key) not in str(e):
                        r["problems"].append(f"error does not name shard and key: {e}")
                results.append(r)
        finally:
            os.chdir(here)
    return results


def table(pack, fuzz, loader, concurrent=(), duplicates=()) -> tuple[list[tuple], dict]:
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
    for tool in ("pack", "prepare"):
        for settings in ("equal", "different"):
            rs = [r for r in concurrent if r["tool"] == tool and r["settings"] == settings]
            if rs:
                bad = [r for r in rs if r["problems"]]
                refused = sum(r["refused"] == 1 for r in rs)
                what = {"pack": ("`pack`", "--capacity 1024 / 2048"),
                        "prepare": ("`prepare`", "--shard-size 1000 / 700")}
                rows.append((f"two {what[tool][0]} processes into one --out, second started 0-0.3 s later, "
                             f"{settings} settings" + (f" ({what[tool][1]})" if settings == "different" else ""),
                             len(rs), f"{len(rs) - len(bad)} directories verify, hold exactly their manifest's files "
                             f"and every sequence once; second run refused naming the first in {refused}, ran "
                             f"after it in {len(rs) - refused}", str(len(bad))))
    for case, label in (("names", "one file under two names (`./`, absolute, symlink, hard link, overlapping "
                                  "globs)"),
                        ("tar key", "tar shard with a member or a key given twice")):
        rs = [r for r in duplicates if r["case"] == case]
        if rs:
            bad = [r for r in rs if r["problems"]]
            ok = ("packed once, with a warning naming both names" if case == "names"
                  else "refused naming the shard and the key")
            rows.append((label, len(rs), f"{len(rs) - len(bad)} {ok}", str(len(bad))))
    summary = {"pack_trials": len(pack), "pack_problems": sum(bool(r["problems"]) for r in pack),
               "fuzz_cases": sum(fuzz.values()), "fuzz_lost": sum(v for k, v in fuzz.items() if k[2] == "lost"),
               "loader_trials": len(loader), "loader_problems": sum(bool(r["problems"]) for r in loader),
               "concurrency_trials": len(concurrent),
               "concurrency_problems": sum(bool(r["problems"]) for r in concurrent),
               "duplicate_trials": len(duplicates), "duplicate_problems": sum(bool(r["problems"]) for r in duplicates)}
    return rows, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack-trials", type=int, default=25, help="kills per (workers, mode) case")
    ap.add_argument("--fuzz-cases", type=int, default=1000, help="truncations and corruptions per format, each")
    ap.add_argument("--loader-trials", type=int, default=5, help="trials per signal")
    ap.add_argument("--ray-trials", type=int, default=0,
                    help="kills of `pack --engine ray` per mode (fresh, re-pack); needs ray")
    ap.add_argument("--concurrency-trials", type=int, default=10,
                    help="two pack / prepare processes into one --out, per (tool, equal / different settings)")
    ap.add_argument("--duplicate-trials", type=int, default=25,
                    help="one file under two names, and a tar key given twice, each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json",
                    default=os.path.join(ROOT, "benchmarks", "results", "fault_injection", "fault_injection.json"))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    fuzz = fuzz_campaign(a.fuzz_cases, a.seed)
    loader = loader_campaign(a.loader_trials, a.seed)
    pack = pack_campaign(a.pack_trials, a.seed, a.ray_trials)
    concurrent = concurrency_campaign(a.concurrency_trials, a.seed)
    duplicates = duplicate_campaign(a.duplicate_trials, a.seed)
    rows, summary = table(pack, fuzz, loader, concurrent, duplicates)
    print("| injected | times | survived | lost |")
    print("|---|---:|---|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]} | {r[3]} |")
    findings = [r for r in pack + loader + concurrent + duplicates if r["problems"]]
    for f in findings:
        print("problem:", f)
    secs = time.perf_counter() - t0
    print(f"\n{summary}; {secs:.0f} s on {platform.node()} ({os.cpu_count()} cores)")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"command": "python benchmarks/fault_injection.py " + " ".join(argv or sys.argv[1:]),
                   "seconds": round(secs, 1), "summary": summary,
                   "table": [dict(zip(("injected", "times", "survived", "lost"), r)) for r in rows],
                   "pack": pack, "loader": loader, "concurrent": concurrent, "duplicates": duplicates,
                   "fuzz": [{"format": k[0], "kind": k[1], "outcome": k[2], "count": v} for k, v in sorted(fuzz.items())]},
                  f, indent=1)
    print(f"wrote {a.json}")
    return 1 if findings or summary["fuzz_lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
