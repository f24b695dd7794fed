"""The table of an A/B run (ab_kernels.sh): OUTDIR/base_<r>.json and OUTDIR/work_<r>.json, each a bench_ops.py
JSON (rows of op, impl, phase, ms) or a bench_train.py one (results of width, lengths, mode: ms a step), grouped by
row; each side's times in run order, their medians and work / base. Writes OUTDIR/ab.json.

    python3 benchmarks/gpu/ab_summary.py OUTDIR
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load_side(out: Path, side: str) -> dict:
    """{(op, impl, phase): [ms of round 1, round 2, ...]} of one side, rounds in order."""
    times: dict = {}
    files = sorted(out.glob(f"{side}_*.json"), key=lambda p: int(p.stem.split("_")[-1]))
    for f in files:
        data = json.loads(f.read_text())
        if "rows" in data:   # bench_ops.py
            for row in data["rows"]:
                times.setdefault((row["op"], row["impl"], row["phase"]), []).append(row["ms"])
        for r in data.get("results", []):   # bench_train.py: a step's ms by (width, lengths, mode)
            if not r.get("oom") and "ms_per_step" in r:
                times.setdefault((f"{r['width']} {r['lengths']}", r["mode"], "step"), []).append(r["ms_per_step"])
    return times


def summarize(out: Path) -> list:
    base, work = load_side(out, "base"), load_side(out, "work")
    rows = []
    for key in [k for k in work if k in base]:
        b, w = statistics.median(base[key]), statistics.median(work[key])
        rows.append({"op": key[0], "impl": key[1], "phase": key[2], "base_ms": base[key], "work_ms": work[key],
                     "base_median": b, "work_median": w, "work_over_base": round(w / b, 4) if b else None})
    return rows


def main(argv: list) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    rows = summarize(out)
    if not rows:
        print(f"ab_summary: no rows found in both {out}/base_*.json and {out}/work_*.json")
        return 1
    print(f"{'op':15s} {'impl':34s} {'phase':8s} {'base ms (runs)':>26s} {'work ms (runs)':>26s} {'work/base':>9s}")
    for r in rows:
        fmt = lambda v: ", ".join(f"{x:.3f}" for x in v)  # noqa: E731
        print(f"{r['op']:15s} {r['impl'][:34]:34s} {r['phase']:8s} {fmt(r['base_ms']):>26s} {fmt(r['work_ms']):>26s}"
              f" {r['work_over_base']:>9.3f}")
    (out / "ab.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
