#!/usr/bin/env bash
# Nsight Compute profile of the selective-scan kernels with and without carried states, at bench_long_context.py's
# kernel size (B=8, D=4096, L=4096, dstate 16, bf16, z, two sequences a row): the plain kernels, the states variant
# with no state used, and with a carried piece a row (its first sequence starts from a state, every sequence returns
# its final state), forward and backward, one launch each.
#
#   bash benchmarks/gpu/profile_states.sh OUTDIR        # -> OUTDIR/ncu_states.txt
#
# Needs ncu and our kernels (ops) importable; run from the repository root (the cases: bench_long_context.py).
set -u
out=${1:?usage: profile_states.sh OUTDIR}; mkdir -p "$out"
cat > /tmp/profile_states_driver.py <<'PY'
import sys
import torch
sys.path.insert(0, "benchmarks")
from bench_long_context import kernel_cases   # the benchmark's inputs and cases (also registers the kernel ops)
args, dout, cases = kernel_cases("cuda")
for extra, bwd_extra in cases.values():   # profiled in this order: plain, none used, a carried piece a row
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*args, *extra)
    torch.ops.packloader.selective_scan_bwd(*args, saved, dout, False, *bwd_extra)
torch.cuda.synchronize()
PY
ncu --clock-control none --kernel-name regex:"scan_fwd_kernel|scan_bwd_kernel" --launch-count 6 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
  --section MemoryWorkloadAnalysis --print-details all python3 /tmp/profile_states_driver.py > "$out/ncu_states.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z_]+.*scan|Duration|Executed Instructions  |Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|Achieved Occupancy|Branch Instructions  " "$out/ncu_states.txt" | head -120
