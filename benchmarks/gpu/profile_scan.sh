#!/usr/bin/env bash
# Nsight Compute profile of the selective-scan kernels at bench_ops.py's size (B=8, D=4096, L=4096, dstate 16, bf16,
# about 13 sequences per row): ours (forward and backward) and mamba-ssm's (no boundaries), one launch each.
#
#   bash benchmarks/gpu/profile_scan.sh OUTDIR        # -> OUTDIR/ncu_scan.txt, OUTDIR/ncu_scan_bwd_sass.csv
#
# The CSV is our backward kernel's SASS, one row an instruction with its executed count and stall samples (the source
# page of ncu; the kernels are built with -lineinfo): where its instructions go, readable without ncu.
#
# Needs ncu, our kernels (ops) and mamba-ssm importable (benchmarks/gpu/run.sh sets that up).
set -u
out=${1:?usage: profile_scan.sh OUTDIR}; mkdir -p "$out"
cat > /tmp/profile_scan_driver.py <<'PY'
import torch
import ops  # noqa: F401  (registers the kernel ops)
from packer_algos import pack
torch.manual_seed(0)
Bz, D, L, N, dt = 8, 4096, 4096, 16, torch.bfloat16
dev = "cuda"
u = torch.randn(Bz, D, L, device=dev, dtype=dt)
delta = (0.5 * torch.randn(Bz, D, L, device=dev) - 4.0).to(dt)
A = -torch.exp(0.5 * torch.randn(D, N, device=dev))
Bm, Cm = torch.randn(Bz, N, L, device=dev, dtype=dt), torch.randn(Bz, N, L, device=dev, dtype=dt)
Dp, db = torch.randn(D, device=dev), 0.5 * torch.randn(D, device=dev)
z, dout = torch.randn(Bz, D, L, device=dev, dtype=dt), torch.randn(Bz, D, L, device=dev, dtype=dt)
pos = torch.cat([torch.arange(n) for n in [300] * 13 + [L - 3900]]).repeat(Bz, 1).int().to(dev)
out, saved, _ = torch.ops.packloader.selective_scan_fwd(u, delta, A, Bm, Cm, Dp, z, db, pos, True)
torch.ops.packloader.selective_scan_bwd(u, delta, A, Bm, Cm, Dp, z, db, pos, True, saved, dout, True)
try:
    import selective_scan_cuda
    B4, C4 = Bm.unsqueeze(1).contiguous(), Cm.unsqueeze(1).contiguous()   # upstream takes (b, groups, n, L)
    o, x, oz = selective_scan_cuda.fwd(u, delta, A, B4, C4, Dp, z, db, True)
    selective_scan_cuda.bwd(u, delta, A, B4, C4, Dp, z, db, dout, x, o, None, True, False)
except ImportError:
    print("mamba-ssm not importable: its kernels are not profiled")
torch.cuda.synchronize()
PY
ncu --kernel-name regex:"scan_fwd_kernel|scan_bwd_kernel|selective_scan_fwd_kernel|selective_scan_bwd_kernel" \
  --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section InstructionStats --section SourceCounters --print-details all python3 /tmp/profile_scan_driver.py \
  > "$out/ncu_scan.txt" 2>&1
echo "ncu rc=$?"; grep -E "^  [a-z_]+.*scan|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Stall|Executed Ipc A|Memory Throughput|Compute \(SM\) Th|Shared Memory Configuration Size|One or More Eligible" "$out/ncu_scan.txt" | head -80
ncu --kernel-name regex:"scan_bwd_kernel" --launch-count 1 --section SourceCounters --section InstructionStats \
  --page source --print-source sass --csv python3 /tmp/profile_scan_driver.py > "$out/ncu_scan_bwd_sass.csv" 2>&1
echo "ncu source page rc=$? ($(wc -l < "$out/ncu_scan_bwd_sass.csv") lines)"
