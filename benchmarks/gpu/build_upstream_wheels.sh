#!/usr/bin/env bash
# Builds mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0 from their sdists for ONE architecture as wheels
# (a variant of ../shared/gpu/build-upstream.sh that keeps the wheels so later GPU calls install in seconds).
#   build_upstream_wheels.sh SDIST_DIR WHEEL_DIR [ARCH]
set -u
src=$(cd "$1" && pwd); whl=$2; arch=${3:-90}
mkdir -p "$whl"; whl=$(cd "$whl" && pwd)
work=$(mktemp -d); logs=${BUILD_LOGS:-$work}; mkdir -p "$logs"
for f in "$src"/causal_conv1d-*.tar.gz "$src"/mamba_ssm-*.tar.gz; do tar xzf "$f" -C "$work" || exit 1; done
python3 - "$arch" "$work"/causal_conv1d-*/setup.py "$work"/mamba_ssm-*/setup.py <<'PY' || exit 1
import re, sys
arch = sys.argv[1]
for path in sys.argv[2:]:
    s = open(path).read()
    pair = r'(\s*)cc_flag\.append\("-gencode"\)(\n\s*)cc_flag\.append\("arch=compute_(?!%s,)\d+,code=sm_\d+"\)' % arch
    s = re.sub(pair, r'\1pass\2pass', s)
    kept = re.findall(r'arch=compute_(\d+)', s)
    if kept != [arch]:
        sys.exit(f"{path}: expected only compute_{arch} to remain, found {kept}")
    compile(s, path, "exec")
    open(path, "w").write(s)
PY
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
( cd "$work"/causal_conv1d-*/ && CAUSAL_CONV1D_FORCE_BUILD=TRUE python3 -m pip wheel --no-build-isolation --no-deps --no-index . -w "$whl" ) > "$logs/causal-conv1d.log" 2>&1 & cc=$!
( cd "$work"/mamba_ssm-*/ && MAMBA_FORCE_BUILD=TRUE python3 -m pip wheel --no-build-isolation --no-deps --no-index . -w "$whl" ) > "$logs/mamba-ssm.log" 2>&1 & mb=$!
wait $cc; rc_cc=$?; wait $mb; rc_mb=$?
echo "causal-conv1d wheel rc=$rc_cc, mamba-ssm wheel rc=$rc_mb, $(( $(date +%s) - start )) s, logs in $logs"
[ $rc_cc -eq 0 ] && [ $rc_mb -eq 0 ] || { tail -5 "$logs"/*.log; exit 1; }
python3 -m pip install -q --no-deps --no-index "$whl"/*.whl && \
python3 -c "import causal_conv1d, selective_scan_cuda; from mamba_ssm.modules.mamba_simple import Mamba; print('upstream kernels import')"
