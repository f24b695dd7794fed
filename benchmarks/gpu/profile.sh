#!/usr/bin/env bash
# Nsight Compute profiles of the conv and scan kernels, ours against upstream (one call of each; clocks left alone).
#   bash benchmarks/gpu/profile.sh OUTDIR       (upstream on PYTHONPATH, e.g. after call1.sh's unpack)
set -u
out=${1:-/tmp/prof}; mkdir -p $out
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section InstructionStats"
# every PACKLOADER_CONV_CF variant, then causal-conv1d
timeout 150 ncu --clock-control none $sec -k regex:"cf_vec|causal" \
  python3 benchmarks/gpu/conv_variants.py --once > $out/ncu_conv.txt 2>&1
[ -n "${PROFILE_SCAN:-}" ] && timeout 200 ncu --clock-control none $sec -k regex:'scan|selective' \
  python3 benchmarks/gpu/scan_once.py > $out/ncu_scan.txt 2>&1
ls -la $out
