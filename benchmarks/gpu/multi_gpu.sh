#!/usr/bin/env bash
# The multi-GPU checks of packloader in one go on a 2- or 4-GPU machine, meant to run in the background (the lent
# machine goes back after 30 s without a call): results and a progress line per finished job under OUTDIR.
#
#   setsid nohup bash benchmarks/gpu/multi_gpu.sh /tmp/R > /tmp/multi.log 2>&1 < /dev/null &
#   ... later calls: bash benchmarks/gpu/collect.sh /tmp/R "$OUT" 540     # waits for "done", packs <= 8 files
#
# Jobs: context parallelism over all the GPUs (exactness, scaling with a profiled step per rank, reach; the
# NCCL tests on 2 and 4 GPUs), the carry's cost (2 and 4 rows, profiled), the functional ops against their kernels,
# the FSDP example's 2-GPU test; SKIP_FSDP, SKIP_REACH, SKIP_FUNCTIONAL=1 leave a job out, GPU_TESTS names the
# one-GPU tests run, COST_STEPS the carry cost's timed steps (default 8).
# Our kernels are built just in time; no upstream build (none of these needs mamba-ssm). packloader's
# pure-Python dependencies the image lacks travel as wheels in .whl/ (name it in carry; see run.sh).
set -u
R=${1:?usage: multi_gpu.sh OUTDIR}
mkdir -p "$R/traces" "$R/long_context"; R=$(cd "$R" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/coresite .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/coresite${PYTHONPATH:+:$PYTHONPATH}
quiet="^W1\|^\*\*\*\|OMP_NUM\|UserWarning\|return.func\|Guessing\|_warn_once\|warnings.warn\|super().apply\|run_backward"
t0=$(date +%s); stamp() { echo "[$1 $(( $(date +%s) - t0 )) s]" >> "$R/progress"; }
nvidia-smi -L > "$R/gpus.txt"; N=$(wc -l < "$R/gpus.txt"); git log -1 --format=%H > "$R/commit.txt" 2>/dev/null
git status --short > "$R/dirty.txt" 2>/dev/null
MAX_JOBS=$(nproc) python3 -c "from ops import _build; print('kernels', _build.load_extension().__file__)" \
  > "$R/jit.log" 2>&1; stamp jit
timeout 300 torchrun --nproc_per_node $N benchmarks/bench_context_parallel.py --parts exact,scaling --iters 3 \
  --trace-dir "$R/traces" --out "$R/context_parallel" 2>&1 | grep -v "$quiet" > "$R/cp_bench.log"; stamp cp_bench
timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/ops/test_context_parallel.py \
  > "$R/cp_tests.log" 2>&1; stamp cp_tests
# the carry's cost alone on the machine (host-bound modes slow down under a neighbour's CPU load): one after another
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_long_context.py --parts cost --rows 2 --cost-steps ${COST_STEPS:-8} \
  --trace-dir "$R/traces/carry" --out "$R/long_context/cost_rows2.json" > "$R/carry_rows2.log" 2>&1; stamp carry2
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_long_context.py --parts cost --rows 4 --cost-steps ${COST_STEPS:-8} \
  --out "$R/long_context/cost_rows4.json" > "$R/carry_rows4.log" 2>&1; stamp carry4
[ -n "${SKIP_FUNCTIONAL:-}" ] || { CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_ops.py --only functional \
  --out "$R/ops_functional.json" > "$R/ops_functional.log" 2>&1; stamp functional; }
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
  ${GPU_TESTS:-tests/ops/test_carry.py tests/ops/test_boundaries.py} > "$R/gpu_tests_carry.log" 2>&1
stamp "gpu_tests $(tail -1 "$R/gpu_tests_carry.log")"
[ -n "${SKIP_FSDP:-}" ] || { timeout 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
  tests/packloader/test_fsdp_example.py > "$R/fsdp_tests.log" 2>&1; stamp fsdp_tests; }
[ -n "${SKIP_REACH:-}" ] || { timeout 300 torchrun --nproc_per_node $N benchmarks/bench_context_parallel.py \
  --parts reach --out "$R/context_parallel_reach" 2>&1 | grep -v "$quiet" > "$R/cp_reach.log"; stamp cp_reach; }
stamp done
