#!/usr/bin/env bash
# A/B of our CUDA kernels in one run: ops/csrc at BASE (a git revision) against the working tree's, both built here
# side by side, then timed alternately, BASE then the working tree, ROUNDS times, by one benchmark (default
# benchmarks/bench_ops.py --only scan), so that the lent GPU's clock and power drift falls on both sides alike.
#
#   bash benchmarks/gpu/ab_kernels.sh BASE OUTDIR [ROUNDS] [BENCH ARGS...]
#   e.g. bash benchmarks/gpu/ab_kernels.sh HEAD~1 /tmp/ab 3 benchmarks/bench_ops.py --only scan
#
# -> OUTDIR/base_<r>.json, OUTDIR/work_<r>.json (the benchmark's own JSON, bench_ops.py's rows), their logs, and
#    OUTDIR/ab.json with the table ab_summary.py prints: each row's times, medians and work / base.
# Only ops/csrc differs between the sides (the Python is the working tree's), or the paths in AB_PATHS (e.g.
# AB_PATHS=ops: the whole package at BASE, for a change of the Python around the kernels; then time it with
# benchmarks/bench_train.py, whose JSON ab_summary.py reads as well). Each side's build lands in
# PACKLOADER_CACHE (default /tmp/plcache) under its own hash: an archive of BASE's build carried as $OPS_BUILD
# (ops_build.sh) saves its build. Needs git in this checkout.
set -u
base=${1:?usage: ab_kernels.sh BASE OUTDIR [ROUNDS] [BENCH ARGS...]}
out=${2:?usage: ab_kernels.sh BASE OUTDIR [ROUNDS] [BENCH ARGS...]}
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
bench=("$@"); [ ${#bench[@]} -gt 0 ] || bench=(benchmarks/bench_ops.py --only scan)
mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache}
here=$PWD
tree=$(mktemp -d)/base
mkdir -p "$tree" && cp -r ops packer_algos packloader benchmarks "$tree"/ || exit 1
paths=${AB_PATHS:-ops/csrc}
for p in $paths; do rm -rf "${tree:?}/$p"; done
git archive "$base" $paths | tar x -C "$tree" || { echo "ab_kernels: cannot read $paths at $base (git)"; exit 1; }
echo "base $(git rev-parse --short "$base") $paths in $tree; work: $here ($(git rev-parse --short HEAD) + changes)" \
  | tee "$out/ab.log"
source benchmarks/gpu/ops_build.sh && ops_build_unpack | tee -a "$out/ab.log"
build() { (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-8} \
  python3 -c "import torch, ops; ops.backends.load_kernels(); print('built')") > "$out/build_$2.log" 2>&1; }
build "$tree" base & build "$here" work & wait
grep -q built "$out/build_base.log" && grep -q built "$out/build_work.log" || { echo "ab_kernels: a build failed"; exit 1; }
for r in $(seq 1 "$rounds"); do
  for side in base work; do
    dir=$([ $side = base ] && echo "$tree" || echo "$here")
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" python3 "${bench[@]}" --out "$out/${side}_$r.json") \
      > "$out/${side}_$r.log" 2>&1 || echo "ab_kernels: $side round $r failed (see ${side}_$r.log)"
  done
done
python3 benchmarks/gpu/ab_summary.py "$out" | tee -a "$out/ab.log"
