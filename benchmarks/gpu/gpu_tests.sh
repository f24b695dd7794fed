#!/usr/bin/env bash
# Every GPU test on one machine of N GPUs in one go: the one-GPU tests are dealt out over the GPUs in turn (one pytest
# a GPU), then the tests that need several GPUs (MULTI_GPU_TESTS) run with all of them. Results under OUTDIR (shard_K.log, multi.log, a progress line
# per finished part); meant to run in the background after fsdp.sh (which unpacks mamba-ssm into /tmp/upsite and builds
# our kernels into PACKLOADER_CACHE), or alone (then what needs mamba-ssm skips, and the kernels build first):
#
#   setsid nohup bash benchmarks/gpu/gpu_tests.sh /tmp/T > /tmp/tests.log 2>&1 < /dev/null &
#   ... later calls: bash benchmarks/gpu/collect.sh /tmp/T "$OUT/tests" 540
#
# Knobs: GPU_TESTS (the paths collected; default tests/), TEST_TIMEOUT (seconds a shard may take; default 420),
# SHARDS_PER_GPU (pytest processes side by side on each GPU; default 1: on one H200, 5 ran the whole one-GPU suite in
# about 4 minutes after the build), OPS_BUILD (an earlier build of our kernels to reuse: ops_build.sh; the build made
# here is packed as OUTDIR/ops_build.tar.xz). Each test's result is logged as it finishes (-v): a shard cut by its
# timeout keeps what it ran.
set -u
R=${1:?usage: gpu_tests.sh OUTDIR}
mkdir -p "$R"; R=$(cd "$R" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache}
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/coresite ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/coresite .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/upsite:/tmp/coresite${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s); stamp() { echo "[$1 $(( $(date +%s) - t0 )) s]" >> "$R/progress"; }
nvidia-smi -L > "$R/gpus.txt"; N=$(wc -l < "$R/gpus.txt"); git log -1 --format=%H > "$R/commit.txt" 2>/dev/null
git status --short > "$R/dirty.txt" 2>/dev/null
MULTI_GPU_TESTS="tests/ops/test_context_parallel.py tests/packloader/test_fsdp_example.py"
. benchmarks/gpu/ops_build.sh
ops_build_unpack > "$R/jit.log"
MAX_JOBS=$(nproc) python3 -c "from ops import _build; print('kernels', _build.load_extension().__file__)" \
  >> "$R/jit.log" 2>&1; stamp jit
ops_build_pack "$R"
python3 -c "import torch, selective_scan_cuda, causal_conv1d; print('mamba-ssm and causal-conv1d import')" > "$R/upstream.txt" 2>&1
python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider ${GPU_TESTS:-tests/} 2>/dev/null | grep "::" \
  > "$R/collected.txt"
S=$(( N * ${SHARDS_PER_GPU:-1} ))
grep -v -F "$(echo $MULTI_GPU_TESTS | tr ' ' '\n')" "$R/collected.txt" \
  | awk -v n="$S" -v r="$R" '{ print > (r "/shard_" (NR - 1) % n ".txt") }'
pids=()
for ((k = 0; k < S; k++)); do
  [ -s "$R/shard_$k.txt" ] || continue
  mapfile -t ids < "$R/shard_$k.txt"
  CUDA_VISIBLE_DEVICES=$(( k % N )) timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -v -rs -p no:cacheprovider \
    "${ids[@]}" > "$R/shard_$k.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for ((k = 0; k < S; k++)); do [ -f "$R/shard_$k.log" ] && stamp "shard $k: $(tail -1 "$R/shard_$k.log")"; done
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -q -rs -p no:cacheprovider $MULTI_GPU_TESTS > "$R/multi.log" 2>&1
stamp "multi-GPU: $(tail -1 "$R/multi.log")"
stamp done
