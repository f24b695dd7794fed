#!/usr/bin/env bash
# The one-GPU checks of packloader's current code in one go (no upstream build: what needs mamba-ssm skips), meant
# for one call of the lent machine (about 8 minutes on an H100); results under OUTDIR.
#
#   bash benchmarks/gpu/one_gpu.sh OUTDIR
#
# Jobs: every GPU test, the functional ops against their kernels, the carry's cost (2 rows, one step profiled).
# packloader's pure-Python dependencies the image lacks travel as wheels in .whl/ (name it in carry; see run.sh).
set -u
R=${1:?usage: one_gpu.sh OUTDIR}
mkdir -p "$R"; R=$(cd "$R" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/coresite .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/coresite${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s); stamp() { echo "[$1 $(( $(date +%s) - t0 )) s]" | tee -a "$R/progress"; }
nvidia-smi -L > "$R/gpus.txt"; git log -1 --format=%H > "$R/commit.txt" 2>/dev/null
git status --short > "$R/dirty.txt" 2>/dev/null
MAX_JOBS=$(nproc) python3 -c "from ops import _build; print('kernels', _build.load_extension().__file__)" \
  > "$R/jit.log" 2>&1; stamp jit
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${GPU_TESTS:-tests/} \
  > "$R/gpu_tests.log" 2>&1; stamp "gpu_tests $(tail -1 "$R/gpu_tests.log")"
timeout 150 python3 benchmarks/bench_ops.py --only functional --out "$R/ops_functional.json" \
  > "$R/ops_functional.log" 2>&1; stamp functional
timeout 200 python3 benchmarks/bench_long_context.py --parts cost --rows 2 --cost-steps 8 \
  --trace-dir "$R/traces/carry" --out "$R/cost_rows2.json" > "$R/carry_rows2.log" 2>&1; stamp carry2
stamp done
