#!/usr/bin/env bash
# Nsight Compute profile of the selective-scan kernels with and without carried states, at bench_long_context.py's
# kernel size (B=8, D=4096, L=4096, dstate 16, bf16, z, two sequences a row): the plain kernels, the states variant
# with no state used, and with a carried piece a row (its first sequence starts from a state, every sequence returns
# its final state), forward and backward, one launch each.
#
#   bash benchmarks/gpu/profile_states.sh OUTDIR        # -> OUTDIR/ncu_states.txt
#
# Needs ncu and our kernels (ops) importable.
set -u
out=${1:?usage: profile_states.sh OUTDIR}; mkdir -p "$out"
cat > /tmp/profile_states_driver.py <<'PY'
import torch
import ops  # noqa: F401  (registers the kernel ops)
from ops.states import state_slots
dev, dt = "cuda", torch.bfloat16
b, d, n, L = 8, 4096, 16, 4096
g = torch.Generator(device=dev).manual_seed(0)
u = torch.randn(b, d, L, device=dev, generator=g).to(dt)
delta = (0.5 * torch.randn(b, d, L, device=dev, generator=g) - 1).to(dt)
A = -torch.exp(0.5 * torch.randn(d, n, device=dev, generator=g))
B = torch.randn(b, n, L, device=dev, generator=g).to(dt)
C = torch.randn(b, n, L, device=dev, generator=g).to(dt)
D, z, db = torch.randn(d, device=dev), torch.randn(b, d, L, device=dev).to(dt), torch.randn(d, device=dev)
pos = torch.arange(L, device=dev, dtype=torch.int32).repeat(b, 1)
pos[:, 1000:] = torch.arange(L - 1000, device=dev)
count = int((pos == 0).sum())
h0 = torch.randn(count, d, n, device=dev)
none = state_slots(pos, torch.zeros(count, dtype=torch.bool, device=dev), False)
one = state_slots(pos, torch.arange(count, device=dev) % 2 == 0, True)
dout = torch.randn_like(u)
args = (u, delta, A, B, C, D, z, db, pos, True)
cases = [((), ()), ((none, h0, 0), (none, h0, None)), ((one, h0, count), (one, h0, torch.randn(count, d, n, device=dev)))]
for extra, bwd_extra in cases:   # profiled in this order: plain, none used, a carried piece a row (fwd, bwd each)
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
