"""Benchmark of the packer_algos algorithms (CPU) against lightbinpack and Graphcore's published figures.

    python benchmarks/bench_packing.py                     # full run, JSON to benchmarks/results/packing/packing.json
    python benchmarks/bench_packing.py --quick --out /tmp/p.json   # small sizes, a few seconds

Two data sets, one run, every timing taken after JIT warm-up as the best (minimum) of ``--repeat`` runs
(the median is recorded too):

1. ``lognormal``: ``--n`` (1,000,000) lengths drawn lognormal(mu=5.5, sigma=0.9), rounded and clipped
   to [1, 4096], capacity 4096, seed ``--seed``. Algorithms ``bfd``, ``ffd``, ``first_fit``,
   ``next_fit``, ``online`` (buffer 1000), and ``lightbinpack.obfd`` (C++ best-fit decreasing, PyPI
   ``lightbinpack``; its API takes a Python list and returns a list of lists). obfd's time is the call
   alone, with the list made beforehand (the stricter comparison for us); the time of
   ``lengths.tolist()`` is reported beside it. Our times include everything ``pack`` does: input
   checks, the overflow policy and the full PackPlan (item ids per row). Target: bfd and ffd take at
   most half of obfd's time, with no more rows.
2. ``wikipedia``: the Graphcore length histogram of English Wikipedia (``../shared/data/
   graphcore_wikipedia_lengths.json``, 16,279,552 sequences, capacity 512). ``bfd`` / ``ffd`` are timed
   *including* expanding the histogram into a lengths array (``np.repeat``); ``online`` (buffer 1000)
   and ``next_fit`` run on the lengths in a shuffled order (the shuffle is not timed). Targets: bfd at
   most 8,148,000 rows (efficiency >= 99.83%) within 2 s; online efficiency >= 99.5% at >= 5 million
   items/s. Graphcore's published rows for SPFHP / LPFHP are listed for comparison (their times come
   from their paper's machine and count histogram-level packing only, no per-sequence assignment).
   Skipped with a message when the shared data folder is absent.

3. ``carry``: ``overflow="carry"`` against ``overflow="split"`` (issue 31: within 1 % packing
   efficiency), algorithms ``bfd`` and ``online``, on the Wikipedia histogram at capacity 512 (nothing is
   cut: the two must agree) and 128 (a quarter of the sequences become chains), and on lognormal mixes
   (``--n`` lengths as in 1.) with 5 % of the documents 4-16x the capacity, capacities 4096 and 2048.
   Beside the plan's efficiency, the loader's: the rows of a schedule of 8 ranks x 8 rows (padding rows
   included) under the carry rule (``packloader.carry``, chains pinned to one rank) against the plain
   schedule of the split plan.

``--quick`` shrinks both sets (20,000 lognormal lengths; the Wikipedia histogram divided by 100) and
runs once: for smoke tests; targets are then reported but not judged.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packer_algos import pack  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "packing" / "packing.json"
DEFAULT_SHARED = ROOT.parent / "shared" / "data"
WIKI_FILE = "graphcore_wikipedia_lengths.json"
ALGOS = ("bfd", "ffd", "first_fit", "next_fit", "online")

# the issue's targets
LOGNORMAL_MAX_TIME_RATIO = 0.5        # bfd, ffd vs lightbinpack.obfd
WIKI_BFD_MAX_ROWS = 8_148_000
WIKI_BFD_MIN_EFFICIENCY = 0.9983
WIKI_BFD_MAX_SECONDS = 2.0
WIKI_ONLINE_MIN_EFFICIENCY = 0.995
WIKI_ONLINE_MIN_ITEMS_PER_S = 5e6
CARRY_MAX_EFFICIENCY_LOSS = 0.01      # carry vs split, packing efficiency (absolute)
CARRY_LONG_SHARE = 0.05               # documents 4-16x the capacity in the lognormal mixes
CARRY_SCHEDULE = (8, 8)               # world_size, batch_size of the loader-schedule figure


def timed(fn, repeat):
    """(result of the last call, best seconds, median seconds, all seconds)."""
    times = []
    out = None
    for _ in range(repeat):
        out = None  # free the previous result before the next run
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, min(times), statistics.median(times), times


def row_record(dataset, algorithm, rows, total_tokens, capacity, n_items, best, median, times, **extra):
    lb = -(-total_tokens // capacity)
    rec = {
        "dataset": dataset, "algorithm": algorithm, "rows": int(rows), "capacity": int(capacity),
        "items": int(n_items), "total_tokens": int(total_tokens),
        "efficiency": total_tokens / (rows * capacity) if rows else 0.0,
        "lower_bound": int(lb), "gap_rows": int(rows - lb),
        "gap_pct": 100.0 * (rows - lb) / lb if lb else 0.0,
        "seconds": best, "seconds_median": median, "seconds_all": times,
        "items_per_s": n_items / best if best else float("inf"),
    }
    rec.update(extra)
    return rec


def check_plan(plan, lengths, full):
    """Cheap consistency checks of a plan (all of PackPlan.validate when ``full``)."""
    if full:
        plan.validate(lengths)
        return
    if plan.n_pieces != lengths.size or plan.total_tokens != int(lengths.sum()):
        raise AssertionError(f"{plan.algorithm}: pieces/tokens do not add up")
    if plan.n_bins and plan.bin_lengths().max() > plan.capacity:
        raise AssertionError(f"{plan.algorithm}: a row exceeds capacity")


def lognormal_lengths(n, seed, capacity=4096):
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mean=5.5, sigma=0.9, size=n)
    return np.clip(np.rint(x), 1, capacity).astype(np.int64)


def warm_up(capacity):
    """Compile (or load from Numba's cache) every kernel on the dtypes the runs use."""
    small = lognormal_lengths(2000, 12345, capacity) % capacity + 1
    for a in ALGOS:
        kw = {"buffer_size": 1000} if a == "online" else {}
        pack(small, capacity, a, **kw).validate(small)


def load_lightbinpack():
    try:
        import lightbinpack
        return lightbinpack, None
    except Exception as e:  # ImportError, or a broken build
        return None, (f"lightbinpack is not importable ({type(e).__name__}: {e}); install it with "
                      "`pip install lightbinpack` (sdist only: needs a C++ compiler and pybind11). "
                      "Its rows are skipped.")


def run_obfd(lbp, lengths, capacity, repeat, full_check):
    lst = lengths.tolist()
    lbp.obfd(lst[:1000], capacity)  # warm-up
    _, conv_best, conv_med, conv_all = timed(lengths.tolist, repeat)
    bins, best, med, times = timed(lambda: lbp.obfd(lst, capacity), repeat)
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    nonempty = int((sizes > 0).sum())
    # check obfd's answer: every item once, no row over capacity
    flat = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
    if flat.size != lengths.size or (full_check
                                     and not np.array_equal(np.sort(flat), np.arange(lengths.size))):
        raise AssertionError("lightbinpack.obfd did not place every item exactly once")
    used = np.add.reduceat(lengths[flat], np.r_[0, np.cumsum(sizes[sizes > 0])[:-1]]) if flat.size else flat
    if used.size and used.max() > capacity:
        raise AssertionError("lightbinpack.obfd made a row over capacity")
    return row_record("lognormal", "lightbinpack.obfd", nonempty, int(lengths.sum()), capacity,
                      lengths.size, best, med, times,
                      list_conversion_seconds=conv_best, list_conversion_seconds_median=conv_med,
                      seconds_with_list_conversion=best + conv_best,
                      note="time of the obfd call on a prepared Python list; tolist() excluded "
                           "(see list_conversion_seconds)")


def bench_lognormal(n, seed, repeat, buffer_size, full_check, log):
    C = 4096
    lengths = lognormal_lengths(n, seed, C)
    total = int(lengths.sum())
    out = {"n": int(n), "seed": int(seed), "capacity": C,
           "distribution": "lognormal(5.5, 0.9) rounded, clipped to [1, 4096]",
           "total_tokens": total, "lower_bound": -(-total // C), "rows": []}
    for a in ALGOS:
        kw = {"buffer_size": buffer_size} if a == "online" else {}
        plan, best, med, times = timed(lambda: pack(lengths, C, a, **kw), repeat)
        check_plan(plan, lengths, full_check)
        extra = {"buffer_size": buffer_size} if a == "online" else {}
        out["rows"].append(row_record("lognormal", a, plan.n_bins, plan.total_tokens, C, n, best, med, times,
                                      **extra))
        del plan
    lbp, why = load_lightbinpack()
    if lbp is None:
        log(why)
        out["lightbinpack"] = {"available": False, "reason": why}
    else:
        rec = run_obfd(lbp, lengths, C, repeat, full_check)
        out["rows"].append(rec)
        mine = {r["algorithm"]: r for r in out["rows"]}
        out["lightbinpack"] = {
            "available": True, "version": getattr(lbp, "__version__", None),
            "ratio_seconds": {a: mine[a]["seconds"] / rec["seconds"] for a in ("bfd", "ffd")},
            "ratio_seconds_vs_obfd_with_list_conversion": {
                a: mine[a]["seconds"] / rec["seconds_with_list_conversion"] for a in ("bfd", "ffd")},
            "rows_vs_obfd": {a: mine[a]["rows"] - rec["rows"] for a in ("bfd", "ffd")},
        }
    return out


def load_wikipedia(shared):
    path = pathlib.Path(shared) / WIKI_FILE
    if not path.is_file():
        return None, path
    with open(path) as f:
        return json.load(f)["wikipedia"], path


def bench_wikipedia(wiki, path, scale_down, seed, repeat, buffer_size, full_check):
    C = int(wiki["capacity"])
    counts = np.asarray(wiki["counts"], dtype=np.int64)
    if counts.ndim != 1 or counts.size != C or counts.min() < 0:
        raise ValueError(f"{path}: 'counts' must be {C} non-negative integers (counts[i] = sequences "
                         f"of length i+1), got {counts.size} entries")
    if scale_down > 1:
        counts = counts // scale_down
    n = int(counts.sum())
    sizes = np.arange(1, C + 1, dtype=np.int64)
    total = int((sizes * counts).sum())
    out = {"file": str(path), "capacity": C, "n": n, "scale_down": scale_down, "total_tokens": total,
           "lower_bound": -(-total // C), "seed": int(seed), "rows": []}
    if scale_down == 1 and "lower_bound_bins" in wiki and out["lower_bound"] != wiki["lower_bound_bins"]:
        raise AssertionError(f"{path}: lower bound {out['lower_bound']} != lower_bound_bins "
                             f"{wiki['lower_bound_bins']}")
    expanded = np.repeat(sizes, counts)
    for a in ("bfd", "ffd"):
        plan, best, med, times = timed(lambda: pack(np.repeat(sizes, counts), C, a), repeat)
        check_plan(plan, expanded, full_check)
        out["rows"].append(row_record("wikipedia", a, plan.n_bins, plan.total_tokens, C, n, best, med, times,
                                      includes="np.repeat histogram expansion + pack"))
        del plan
    shuffled = expanded[np.random.default_rng(seed).permutation(n)]
    del expanded
    for a in ("online", "next_fit"):
        kw = {"buffer_size": buffer_size} if a == "online" else {}
        plan, best, med, times = timed(lambda: pack(shuffled, C, a, **kw), repeat)
        check_plan(plan, shuffled, full_check)
        extra = {"buffer_size": buffer_size} if a == "online" else {}
        out["rows"].append(row_record("wikipedia", a, plan.n_bins, plan.total_tokens, C, n, best, med, times,
                                      includes="pack on shuffled lengths", **extra))
        del plan
    pub = wiki.get("published", {})
    out["published"] = []
    if scale_down == 1:
        for name in ("SPFHP", "LPFHP"):
            if f"{name}_bins" in pub:
                rows = int(pub[f"{name}_bins"])
                out["published"].append({
                    "algorithm": f"graphcore {name} (published)", "rows": rows,
                    "efficiency": total / (rows * C),
                    "published_efficiency": pub.get(f"{name}_depth12_efficiency"),
                    "gap_rows": rows - out["lower_bound"],
                    "gap_pct": 100.0 * (rows - out["lower_bound"]) / out["lower_bound"],
                    "seconds": pub.get(f"{name}_seconds")})
        if "NNLSHP_depth3_efficiency" in pub:
            out["published"].append({"algorithm": "graphcore NNLSHP (published)", "rows": None,
                                     "efficiency": pub["NNLSHP_depth3_efficiency"], "seconds": None})
    return out


def long_doc_lengths(n, seed, capacity):
    """Lognormal lengths with CARRY_LONG_SHARE of the documents 4-16x ``capacity``."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(5.5, 0.9, n)), 1, capacity).astype(np.int64)
    long = rng.random(n) < CARRY_LONG_SHARE
    lengths[long] = rng.integers(4 * capacity, 16 * capacity + 1, int(long.sum()))
    return lengths


def schedule_efficiency(plan, carry):
    """Tokens / slots of the loader's schedule of ``plan`` on CARRY_SCHEDULE ranks x rows (padding rows
    included): the carry rule for a carry plan, the plain assignment otherwise."""
    from packer_algos.chains import chain_links
    from packloader.carry import CarrySchedule
    from packloader.distributed import assign_rows

    W, B = CARRY_SCHEDULE
    tokens = plan.bin_lengths()
    if carry:
        pred = chain_links(plan.bin_offsets, plan.item_ids, plan.starts, plan.lengths).pred_row
        n_batches = CarrySchedule(tokens, pred, W, B, False).n_batches
    else:
        n_batches = assign_rows(tokens, W, B, False).shape[1]
    return plan.total_tokens / (n_batches * W * B * plan.capacity)


def bench_carry(n, seed, buffer_size, wiki, log):
    """split vs carry: rows and efficiency of the plan and of the loader's schedule."""
    cases = []
    if wiki is not None:
        counts = np.asarray(wiki["counts"], dtype=np.int64)
        lengths = np.repeat(np.arange(1, counts.size + 1, dtype=np.int64), counts // (100 if n < 100_000 else 1))
        lengths = lengths[np.random.default_rng(seed).permutation(lengths.size)]
        cases += [("wikipedia", 512, lengths), ("wikipedia", 128, lengths)]
    for cap in (4096, 2048):
        cases.append((f"lognormal+{int(100 * CARRY_LONG_SHARE)}%x4-16", cap, long_doc_lengths(n, seed, cap)))
    rows = []
    for dataset, cap, lengths in cases:
        for algorithm in ("bfd", "online"):
            kw = {"buffer_size": buffer_size} if algorithm == "online" else {}
            rec = {"dataset": dataset, "capacity": cap, "algorithm": algorithm, "items": int(lengths.size),
                   "cut": int((lengths > cap).sum())}
            for overflow in ("split", "carry"):
                t0 = time.perf_counter()
                plan = pack(lengths, cap, algorithm, overflow=overflow, **kw)
                rec[f"{overflow}_seconds"] = time.perf_counter() - t0
                if overflow == "carry":
                    plan.validate(lengths)  # chains in order, every token once
                rec[f"{overflow}_rows"] = plan.n_bins
                rec[f"{overflow}_efficiency"] = plan.efficiency
                rec[f"{overflow}_schedule_efficiency"] = schedule_efficiency(plan, overflow == "carry")
                del plan
            rec["efficiency_loss"] = rec["split_efficiency"] - rec["carry_efficiency"]
            log(f"  {dataset} C={cap} {algorithm}: split {100 * rec['split_efficiency']:.3f}% carry "
                f"{100 * rec['carry_efficiency']:.3f}%")
            rows.append(rec)
    return {"long_share": CARRY_LONG_SHARE, "schedule": {"world_size": CARRY_SCHEDULE[0],
                                                         "batch_size": CARRY_SCHEDULE[1]}, "rows": rows}


def fmt_carry_table(carry):
    W, B = CARRY_SCHEDULE
    head = (f"{'dataset':22s} {'cap':>5s} {'algorithm':9s} {'cut':>8s} {'split rows':>11s} {'carry rows':>11s} "
            f"{'split eff':>9s} {'carry eff':>9s} {'loss':>7s} {f'sched {W}x{B} split/carry':>24s}")
    lines = [head, "-" * len(head)]
    for r in carry["rows"]:
        lines.append(f"{r['dataset']:22s} {r['capacity']:>5d} {r['algorithm']:9s} {r['cut']:>8,d} "
                     f"{r['split_rows']:>11,d} {r['carry_rows']:>11,d} {100 * r['split_efficiency']:>8.3f}% "
                     f"{100 * r['carry_efficiency']:>8.3f}% {100 * r['efficiency_loss']:>6.3f}% "
                     f"{100 * r['split_schedule_efficiency']:>11.3f}% / {100 * r['carry_schedule_efficiency']:.3f}%")
    return "\n".join(lines)


def evaluate_targets(res, quick):
    targets = []

    def add(name, value, op, limit):
        ok = value <= limit if op == "<=" else value >= limit
        targets.append({"target": name, "value": value, "op": op, "limit": limit,
                        "met": None if quick else bool(ok)})

    ln = res["lognormal"]
    mine = {r["algorithm"]: r for r in ln["rows"]}
    if ln.get("lightbinpack", {}).get("available"):
        obfd = mine["lightbinpack.obfd"]
        for a in ("bfd", "ffd"):
            add(f"lognormal {a} seconds / obfd seconds", mine[a]["seconds"] / obfd["seconds"], "<=",
                LOGNORMAL_MAX_TIME_RATIO)
            add(f"lognormal {a} rows - obfd rows", mine[a]["rows"] - obfd["rows"], "<=", 0)
    wk = res.get("wikipedia")
    if wk and not wk.get("skipped"):
        w = {r["algorithm"]: r for r in wk["rows"]}
        add("wikipedia bfd rows", w["bfd"]["rows"], "<=", WIKI_BFD_MAX_ROWS)
        add("wikipedia bfd efficiency", w["bfd"]["efficiency"], ">=", WIKI_BFD_MIN_EFFICIENCY)
        add("wikipedia bfd seconds (incl. histogram expansion)", w["bfd"]["seconds"], "<=",
            WIKI_BFD_MAX_SECONDS)
        add("wikipedia online efficiency", w["online"]["efficiency"], ">=", WIKI_ONLINE_MIN_EFFICIENCY)
        add("wikipedia online items/s", w["online"]["items_per_s"], ">=", WIKI_ONLINE_MIN_ITEMS_PER_S)
        for p in wk.get("published", []):
            if p["algorithm"].startswith("graphcore LPFHP"):
                add("wikipedia bfd rows - Graphcore LPFHP rows", w["bfd"]["rows"] - p["rows"], "<=", 0)
    for r in res.get("carry", {}).get("rows", []):
        add(f"carry loss vs split {r['dataset']} C={r['capacity']} {r['algorithm']}",
            r["efficiency_loss"], "<=", CARRY_MAX_EFFICIENCY_LOSS)
    return targets


def fmt_table(res):
    head = f"{'dataset':10s} {'algorithm':30s} {'rows':>11s} {'efficiency':>10s} {'gap to LB':>17s} " \
           f"{'seconds':>9s} {'items/s':>12s}"
    lines = [head, "-" * len(head)]
    for key in ("lognormal", "wikipedia"):
        part = res.get(key)
        if not part or part.get("skipped"):
            continue
        for r in part["rows"]:
            lines.append(f"{key:10s} {r['algorithm']:30s} {r['rows']:>11,d} {100 * r['efficiency']:>9.3f}% "
                         f"{r['gap_rows']:>9,d} ({r['gap_pct']:5.2f}%) {r['seconds']:>9.4f} "
                         f"{r['items_per_s']:>12,.0f}")
        for p in part.get("published", []):
            rows = f"{p['rows']:>11,d}" if p.get("rows") else f"{'-':>11s}"
            gap = f"{p['gap_rows']:>9,d} ({p['gap_pct']:5.2f}%)" if p.get("rows") else f"{'-':>17s}"
            sec = f"{p['seconds']:>9.3f}" if p.get("seconds") is not None else f"{'-':>9s}"
            lines.append(f"{key:10s} {p['algorithm']:30s} {rows} {100 * p['efficiency']:>9.3f}% {gap} {sec} "
                         f"{'-':>12s}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON output (default {DEFAULT_OUT})")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")
    ap.add_argument("--n", type=int, default=None,
                    help="lognormal lengths (default 1,000,000; --quick 20,000)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="timed runs per row, best taken (default 3; --quick 1)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the lognormal draw and the Wikipedia shuffle")
    ap.add_argument("--buffer-size", type=int, default=1000, help="buffer of the online packer")
    ap.add_argument("--shared-data", default=str(DEFAULT_SHARED),
                    help=f"folder holding {WIKI_FILE} (default {DEFAULT_SHARED})")
    ap.add_argument("--validate", action="store_true",
                    help="run the full PackPlan.validate on every plan (slow on 16M sequences)")
    args = ap.parse_args(argv)
    n = args.n if args.n is not None else (20_000 if args.quick else 1_000_000)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if n < 1 or repeat < 1 or args.buffer_size < 1:
        ap.error("--n, --repeat and --buffer-size must be >= 1")

    def log(msg):
        print(msg, flush=True)

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    warm_up(4096)
    warm_up(512)
    res = {
        "benchmark": "packing", "quick": args.quick, "repeat": repeat,
        "timing": "best (minimum) of `repeat` runs after JIT warm-up; median and all runs recorded",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "numba": __import__("numba").__version__, "loadavg_before": list(load_before)},
    }
    log(f"lognormal: {n:,} lengths, capacity 4096, {repeat} run(s) each ...")
    res["lognormal"] = bench_lognormal(n, args.seed, repeat, args.buffer_size,
                                       args.validate or n <= 2_000_000, log)
    wiki, path = load_wikipedia(args.shared_data)
    if wiki is None:
        msg = f"skipping the Wikipedia part: {path} not found (the shared data folder ../shared is absent)"
        log(msg)
        res["wikipedia"] = {"skipped": True, "reason": msg}
    else:
        scale = 100 if args.quick else 1
        log(f"wikipedia: {path} (counts // {scale}) ..." if scale > 1 else f"wikipedia: {path} ...")
        res["wikipedia"] = bench_wikipedia(wiki, path, scale, args.seed, repeat, args.buffer_size,
                                           args.validate or args.quick)
    log("carry vs split ...")
    res["carry"] = bench_carry(n, args.seed, args.buffer_size, wiki, log)
    res["machine"]["loadavg_after"] = list(os.getloadavg())
    res["wall_seconds"] = time.perf_counter() - t_start
    res["targets"] = evaluate_targets(res, args.quick)

    print()
    print(fmt_table(res))
    print("\noverflow='carry' against 'split' (plan efficiency, and the loader's schedule incl. padding rows):")
    print(fmt_carry_table(res["carry"]))
    lp = res["lognormal"].get("lightbinpack", {})
    if lp.get("available"):
        r = lp["ratio_seconds"]
        rc = lp["ratio_seconds_vs_obfd_with_list_conversion"]
        print(f"\ntime ratio vs lightbinpack.obfd {lp['version']} (obfd call on a prepared list): "
              f"bfd {r['bfd']:.3f}, ffd {r['ffd']:.3f}; counting obfd's tolist() too: "
              f"bfd {rc['bfd']:.3f}, ffd {rc['ffd']:.3f}")
    print("\ntargets" + (" (not judged in --quick)" if args.quick else "") + ":")
    for t in res["targets"]:
        verdict = "-" if t["met"] is None else ("MET" if t["met"] else "MISSED")
        v = t["value"]
        vs = (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.4f}") if isinstance(v, float) else f"{v:,d}"
        print(f"  {t['target']:52s} {vs:>16s} {t['op']} {t['limit']:<12,} {verdict}")
    print(f"\nload average before {load_before[0]:.2f}, after {res['machine']['loadavg_after'][0]:.2f} "
          f"({os.cpu_count()} cpus); wall {res['wall_seconds']:.1f} s")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
