#!/usr/bin/env bash
# Every GPU test and benchmark of packloader, in one go on one GPU machine; everything lands in OUTDIR.
#
#   bash benchmarks/gpu/run.sh OUTDIR
#
# 1. The upstream baselines (mamba-ssm with its Mamba-1 CUDA scan, causal-conv1d), unless they import already:
#    unpacked from a packed install in $UPSTREAM_PACK (default .gpu/up, written by an earlier run, seconds), or
#    built from the source archives in $SDISTS (default .gpu; about 5 minutes, in the background while our kernels
#    build and the kernel tests run) for this GPU's architecture only. Fetch the archives beforehand where the
#    package registry is reachable:
#      CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE \
#      MAMBA_FORCE_BUILD=TRUE pip download --no-deps --no-binary :all: --no-build-isolation -d .gpu \
#        causal-conv1d==1.7.0 mamba-ssm==2.3.2.post1
#    A fresh build is packed (stripped, xz, 15 MB parts) into OUTDIR/up for the next machine ($UPSTREAM_PACK).
# 2. Our kernels: built just in time (ops/_build.py), or ahead of time with AOT=1
#    (PACKLOADER_BUILD_CUDA=1 pip install --no-build-isolation into a scratch folder). A just-in-time build is packed
#    into OUTDIR/ops_build.tar.xz; carried as $OPS_BUILD (default .gpu/ops_build.tar.xz) it saves the next machine the
#    build where the sources are the same (ops_build.sh).
# 3. The GPU tests: pytest -m gpu over $GPU_TESTS (default: tests/) -> OUTDIR/gpu_tests.log.
# 4. The benchmarks (unless SKIP_BENCH=1): bench_ops, bench_mamba_stack, bench_compile -> OUTDIR/*.json.
#
# Knobs: GPU_TESTS, PYTEST_ARGS (e.g. "-k conv"), TEST_TIMEOUT (s, default 300), SKIP_BENCH, BENCHES (default
# "ops mamba_stack compile"), AOT. PYTHONPATH gets the repository root, so the working tree is what runs.
set -u
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache} PYTHONPATH=$PWD:/tmp/upsite${PYTHONPATH:+:$PYTHONPATH}
log="$out/run.log"
# packloader's pure-Python core dependencies the GPU image lacks (braceexpand; the image is offline): wheels fetched
# beforehand into .whl/ (git-ignored; carry it), e.g. pip download --no-deps --only-binary=:all: -d .whl braceexpand
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/coresite .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/coresite
fi
python3 -c "import braceexpand" 2>/dev/null || echo "warning: braceexpand missing: the loader's tests and benchmarks fail (see .whl above)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_cap --format=csv | tee "$log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$log"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')

up=""
if python3 -c "import causal_conv1d, selective_scan_cuda" 2>/dev/null; then
  echo "upstream: already installed" | tee -a "$log"
elif ls "${UPSTREAM_PACK:-.gpu/up}"/upstream.tar.xz.part* >/dev/null 2>&1; then
  mkdir -p /tmp/upsite && cat "${UPSTREAM_PACK:-.gpu/up}"/upstream.tar.xz.part* | xz -d -T0 | tar x -C /tmp/upsite \
    && echo "upstream: unpacked" | tee -a "$log"
elif ls "${SDISTS:-.gpu}"/causal_conv1d-*.tar.gz >/dev/null 2>&1; then
  ( MAX_JOBS=${UP_JOBS:-12} BUILD_LOGS=/tmp/uplogs bash benchmarks/gpu/build_upstream_wheels.sh "${SDISTS:-.gpu}" \
      /tmp/wheels "$arch" > /tmp/upstream.log 2>&1 ) & up=$!
  echo "upstream: building for sm_$arch in the background" | tee -a "$log"
else
  echo "upstream: not available (no install, no pack, no source archives): comparisons with it skip" | tee -a "$log"
fi

t0=$(date +%s)
. benchmarks/gpu/ops_build.sh
ops_build_unpack | tee -a "$log"
if [ "${AOT:-0}" = 1 ]; then
  PACKLOADER_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}" MAX_JOBS=${MAX_JOBS:-8} \
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/aot . > "$out/aot_build.log" 2>&1
  echo "AOT build rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$log"
  cp /tmp/aot/ops/_C*.so ops/   # ops._C beside the working tree's ops package (git-ignored *.so)
fi
python3 -c "from ops import _build; m = _build.load_extension(); print('our kernels:', m.__file__)" 2>&1 | tail -3 | tee -a "$log"
echo "our build/load: $(( $(date +%s) - t0 )) s" | tee -a "$log"
ops_build_pack "$out"

# kernel tests first (they need no upstream), then wait for upstream, then the rest
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${GPU_TESTS:-tests/} ${PYTEST_ARGS:-} \
  > "$out/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$log"; grep -E "passed|failed|^FAILED|^ERROR" "$out/gpu_tests.log" | tail -40 | tee -a "$log"
if [ -n "$up" ]; then
  wait $up; echo "upstream build: $(tail -2 /tmp/upstream.log | tr '\n' ' ')" | tee -a "$log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  for b in ${BENCHES:-ops mamba_stack compile}; do
    [ -f benchmarks/bench_$b.py ] || continue
    timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_$b.py --out "$out/$b.json" 2>&1 | tail -25 | tee -a "$log"
  done
fi
if [ -n "$up" ] && ls /tmp/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/upsite_pack /tmp/wheels/*.whl && \
  find /tmp/upsite_pack -name "*.so" -exec strip --strip-unneeded {} + ; \
  mkdir -p "$out/up" && tar c -C /tmp/upsite_pack . | xz -6 -T0 | split -b 15000000 -d - "$out/up/upstream.tar.xz.part"
  ls -la "$out/up" | tee -a "$log"
fi
