#!/usr/bin/env bash
# One GPU call: upstream wheels built in the background (sm_90 only); our kernels built, tested against
# float64 / per-sequence runs, then benchmarked against upstream. Everything lands under $OUT.
#   carry: .gpu (the two upstream sdists, see benchmarks/gpu/build_upstream_wheels.sh)
set -u
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=/tmp/plcache PYTHONPATH=$PWD
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee $OUT/run.log
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a $OUT/run.log
if ls .gpu/up/upstream.tar.xz.part* >/dev/null 2>&1; then
  # a packed install from an earlier call (see the end of this script)
  mkdir -p /tmp/upsite && (cat .gpu/up/upstream.tar.xz.part* | xz -d -T0 | tar x -C /tmp/upsite && echo "upstream unpacked") \
    > /tmp/upstream.log 2>&1 & up=$!
  export PYTHONPATH=$PYTHONPATH:/tmp/upsite
else
  MAX_JOBS=${UP_JOBS:-12} BUILD_LOGS=/tmp/uplogs bash benchmarks/gpu/build_upstream_wheels.sh .gpu /tmp/wheels 90 > /tmp/upstream.log 2>&1 & up=$!
fi
t0=$(date +%s)
python3 -c "from ops import _cuda; _cuda.load(); print('ours built')" 2>&1 | tail -20 | tee -a $OUT/run.log
echo "our build: $(( $(date +%s) - t0 )) s" | tee -a $OUT/run.log
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -s -p no:cacheprovider ${GPU_TESTS:-tests/ops/test_cuda_kernels.py} > $OUT/tests.log 2>&1
echo "gpu tests rc=$?" | tee -a $OUT/run.log; grep -E "passed|failed|^FAILED|^E " $OUT/tests.log | tail -30
wait $up; echo "upstream: $(tail -3 /tmp/upstream.log)" | tee -a $OUT/run.log
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_ops.py --out $OUT/ops.json --iters 10 2>&1 | tee -a $OUT/run.log | tail -30
[ -z "${SKIP_STACK:-}" ] && timeout ${STACK_TIMEOUT:-120} python3 benchmarks/bench_mamba_stack.py --out $OUT/mamba_stack.json 2>&1 | tee -a $OUT/run.log | tail -20
if [ -n "${GPU_TESTS2:-}" ]; then
  echo "===== $GPU_TESTS2" >> $OUT/tests.log
  timeout ${TEST2_TIMEOUT:-120} python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout=150 --durations=0 $GPU_TESTS2 ${TEST2_ARGS:+-k "$TEST2_ARGS"} >> $OUT/tests.log 2>&1
  echo "gpu tests 2 rc=$?" | tee -a $OUT/run.log; grep -E "passed|failed|^FAILED|^E " $OUT/tests.log | tail -30
fi
if ls /tmp/wheels/*.whl >/dev/null 2>&1; then
  # pack the freshly built upstream install (stripped, xz) so later calls unpack it in seconds
  python3 -m pip install -q --no-deps --no-index --target /tmp/upsite_pack /tmp/wheels/*.whl && \
  find /tmp/upsite_pack -name "*.so" -exec strip --strip-unneeded {} + ; \
  mkdir -p $OUT/up && tar c -C /tmp/upsite_pack . | xz -6 -T0 | split -b 15000000 -d - $OUT/up/upstream.tar.xz.part
  ls -la $OUT/up | tee -a $OUT/run.log
fi
