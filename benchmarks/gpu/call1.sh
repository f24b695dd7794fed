#!/usr/bin/env bash
# One GPU call: upstream wheels built in the background (sm_90 only); our kernels built, tested against
# float64 / per-sequence runs, then benchmarked against upstream. Everything lands under $OUT.
#   carry: .gpu (the two upstream sdists, see benchmarks/gpu/build_upstream_wheels.sh)
set -u
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=/tmp/plcache PYTHONPATH=$PWD
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee $OUT/run.log
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a $OUT/run.log
if [ -d .gpu/wheels ] && ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .gpu/wheels/*.whl > /tmp/upstream.log 2>&1 & up=$!
else
  MAX_JOBS=12 BUILD_LOGS=/tmp/uplogs bash benchmarks/gpu/build_upstream_wheels.sh .gpu /tmp/wheels 90 > /tmp/upstream.log 2>&1 & up=$!
fi
t0=$(date +%s)
python3 -c "from ops import _cuda; _cuda.load(); print('ours built')" 2>&1 | tail -20 | tee -a $OUT/run.log
echo "our build: $(( $(date +%s) - t0 )) s" | tee -a $OUT/run.log
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests/ops/test_cuda_kernels.py} > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" | tee -a $OUT/run.log; tail -30 $OUT/gpu_tests.txt
wait $up; echo "upstream: $(tail -3 /tmp/upstream.log)" | tee -a $OUT/run.log
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_ops.py --out $OUT/ops.json --iters 10 2>&1 | tee -a $OUT/run.log | tail -30
timeout ${STACK_TIMEOUT:-120} python3 benchmarks/bench_mamba_stack.py --out $OUT/mamba_stack.json 2>&1 | tee -a $OUT/run.log | tail -20
if [ -n "${GPU_TESTS2:-}" ]; then
  timeout ${TEST2_TIMEOUT:-120} python3 -m pytest -m gpu -q -p no:cacheprovider $GPU_TESTS2 > $OUT/gpu_tests2.txt 2>&1
  echo "gpu tests 2 rc=$?" | tee -a $OUT/run.log; tail -30 $OUT/gpu_tests2.txt
fi
ls -la /tmp/wheels 2>/dev/null | tee -a $OUT/run.log
tot=$(du -cb /tmp/wheels/*.whl 2>/dev/null | tail -1 | cut -f1)
if [ -n "$tot" ] && [ "$tot" -lt 60000000 ]; then
  mkdir -p $OUT/wheels && cd /tmp/wheels && for f in *.whl; do
    if [ $(stat -c %s "$f") -gt 16000000 ]; then split -b 15000000 -d "$f" "$OUT/wheels/$f.part"; else cp "$f" $OUT/wheels/; fi
  done; ls -la $OUT/wheels
fi
