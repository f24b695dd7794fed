#!/usr/bin/env bash
# FSDP2 scaling (bench_fsdp.py on 1 and all GPUs, each step profiled per rank) and compute balancing
# (bench_balance.py on 2 GPUs) on one multi-GPU machine, meant to run in the background like multi_gpu.sh:
#
#   setsid nohup bash benchmarks/gpu/fsdp.sh /tmp/R "$OUT/up" > /tmp/fsdp.log 2>&1 < /dev/null &
#   ... later calls: bash benchmarks/gpu/collect.sh /tmp/R "$OUT" 540
#
# mamba-ssm and causal-conv1d (the dense baseline's model): unpacked from $UPSTREAM_PACK (default .gpu/up) or
# built from the source archives in .gpu (run.sh's header says how to fetch them; about 5 minutes) and then packed
# into PACKDIR (second argument) for the next machine. Knobs: WIDTHS (default 1.4b), FSDP_STEPS (8), FSDP_ARGS
# (more bench_fsdp.py options, e.g. --no-reshard), BALANCE_ARGS
# (default: rows of 32,768 tokens, where attention dominates), SKIP_BALANCE=1.
set -u
R=${1:?usage: fsdp.sh OUTDIR [PACKDIR]}; pack=${2:-}
mkdir -p "$R/traces"; R=$(cd "$R" && pwd)
export PYTHONUNBUFFERED=1 PACKLOADER_CACHE=${PACKLOADER_CACHE:-/tmp/plcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/coresite .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/upsite:/tmp/coresite${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s); stamp() { echo "[$1 $(( $(date +%s) - t0 )) s]" >> "$R/progress"; }
nvidia-smi -L > "$R/gpus.txt"; N=$(wc -l < "$R/gpus.txt"); git log -1 --format=%H > "$R/commit.txt" 2>/dev/null
git status --short > "$R/dirty.txt" 2>/dev/null
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
up=""
if ls "${UPSTREAM_PACK:-.gpu/up}"/upstream.tar.xz.part* >/dev/null 2>&1; then
  mkdir -p /tmp/upsite && cat "${UPSTREAM_PACK:-.gpu/up}"/upstream.tar.xz.part* | xz -d -T0 | tar x -C /tmp/upsite
  stamp upstream_unpacked
else
  ( MAX_JOBS=$(nproc) BUILD_LOGS=/tmp/uplogs bash benchmarks/gpu/build_upstream_wheels.sh .gpu /tmp/wheels "$arch" \
      > "$R/upstream_build.log" 2>&1 ) & up=$!
fi
MAX_JOBS=16 python3 -c "from ops import _build; print('kernels', _build.load_extension().__file__)" > "$R/jit.log" 2>&1
stamp jit
if [ -n "$up" ]; then
  wait $up; stamp upstream_built
  python3 -m pip install -q --no-deps --no-index --target /tmp/upsite /tmp/wheels/*.whl
  if [ -n "$pack" ]; then
    cp -r /tmp/upsite /tmp/upsite_pack && find /tmp/upsite_pack -name "*.so" -exec strip --strip-unneeded {} +
    mkdir -p "$pack" && tar c -C /tmp/upsite_pack . | xz -6 -T0 | split -b 15000000 -d - "$pack/upstream.tar.xz.part"
    ls -la "$pack" >> "$R/upstream_build.log"; stamp packed
  fi
fi
python3 -c "import torch, selective_scan_cuda, causal_conv1d; print('upstream imports')" >> "$R/upstream_build.log" 2>&1
quiet="^W1\|^\*\*\*\|OMP_NUM\|UserWarning\|warnings.warn\|_warn_once"
nw=$(echo "${WIDTHS:-1.4b}" | tr , "\n" | wc -l)   # timeouts grow with the widths
F="$R/fsdp"; common="--widths ${WIDTHS:-1.4b} --steps ${FSDP_STEPS:-8} --trace-dir /tmp/traces ${FSDP_ARGS:-}"
timeout $((240 * nw)) torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp.py $common --ref-worlds $N --out-dir "$F" 2>&1 \
  | grep -v "$quiet" > "$R/fsdp_1gpu.log"; stamp fsdp_1
timeout $((200 * nw)) torchrun --standalone --nproc_per_node $N benchmarks/bench_fsdp.py $common --ref-worlds "" --out-dir "$F" \
  2>&1 | grep -v "$quiet" > "$R/fsdp_${N}gpu.log"; stamp "fsdp_$N"
python3 benchmarks/bench_fsdp.py --report --out-dir "$F" > "$R/fsdp_report.txt" 2>&1
cp /tmp/traces/*packed-${N}gpu.json.gz "$R/traces/" 2>/dev/null
if [ -z "${SKIP_BALANCE:-}" ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 torchrun --standalone --nproc_per_node 2 benchmarks/bench_balance.py \
    ${BALANCE_ARGS:---capacity 32768 --rows 1 --steps 24} --out "$R/balance.json" 2>&1 | grep -v "$quiet" \
    > "$R/balance.log"; stamp balance
fi
stamp done
