#!/usr/bin/env bash
# First GPU call: upstream wheels built in the background; our build + kernel tests + bench in the foreground.
set -u
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=/tmp/plcache
mkdir -p $OUT/wheels
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee $OUT/run.log
BUILD_LOGS=/tmp/uplogs bash benchmarks/gpu/build_upstream_wheels.sh .gpu $OUT/wheels 90 > /tmp/upstream.log 2>&1 &
up=$!
t0=$(date +%s)
python3 -c "from ops import _cuda; _cuda.load(); print('ours built')" 2>&1 | tail -20 | tee -a $OUT/run.log
echo "our build: $(( $(date +%s) - t0 )) s" | tee -a $OUT/run.log
timeout 240 python3 -m pytest -m gpu -q -x -s tests/ops/test_cuda_kernels.py 2>&1 | tail -60 > $OUT/gpu_tests.txt
tail -25 $OUT/gpu_tests.txt
wait $up; echo "upstream: $(cat /tmp/upstream.log | tail -3)" | tee -a $OUT/run.log
timeout 200 python3 benchmarks/bench_ops.py --out $OUT/ops.json --iters 10 2>&1 | tee -a $OUT/run.log | tail -30
cd $OUT/wheels && for f in *.whl; do sz=$(stat -c %s "$f"); if [ $sz -gt 16000000 ]; then split -b 15000000 -d "$f" "$f.part"; rm "$f"; fi; done; ls -la $OUT/wheels
