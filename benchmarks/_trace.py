"""One profiled call and where its wall time went (for the benchmarks' ``--trace-dir`` options).

:func:`trace_call` runs ``fn`` once under ``torch.profiler`` (CPU and CUDA), writes the Chrome trace (gzipped; open
it in Perfetto) and returns a summary: the call's wall time, the time the GPU was busy with at least one kernel (the
union of kernel intervals), the kernels' summed durations split into communication (NCCL) and compute, the number
of kernels, and the longest stretches with no compute (non-NCCL) kernel running (where the GPU waited for the host or for a peer).
"""
from __future__ import annotations

import gzip
import os
import shutil
import time


def _union_ms(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def trace_call(fn, path=None, label="", top=0, cpu_top=0):
    """Profile one call of ``fn`` (synchronized before and after); write ``path`` (.json.gz) when given; ``top``:
    also list the ``top`` kernel names with the most summed time (ms, count); ``cpu_top``: the ``cpu_top`` host-side
    operators with the most self time (ms, count) and the count of all host-side operator calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    gaps = []
    if compute:
        ordered, end = sorted(compute), None
        for s, e in ordered:
            if end is not None and s > end:
                gaps.append((s - end) / 1000.0)
            end = e if end is None else max(end, e)
    summary = {
        "label": label, "wall_ms": round(wall, 3), "gpu_busy_ms": round(_union_ms(spans), 3),
        "compute_busy_ms": round(_union_ms(compute), 3),
        "kernel_sum_ms": round(sum(e - s for s, e in spans) / 1000.0, 3),
        "nccl_ms": round(sum(e.time_range.elapsed_us() for e in nccl) / 1000.0, 3),
        "kernels": len(kernels), "nccl_kernels": len(nccl),
        "idle_gaps_over_50us_ms": round(sum(g for g in gaps if g > 0.05), 3),
        "longest_gaps_ms": [round(g, 3) for g in sorted(gaps, reverse=True)[:5]],
    }
    if top:
        by_name = {}
        for e in kernels:
            ms, n = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (ms + e.time_range.elapsed_us() / 1000.0, n + 1)
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        summary["top_kernels"] = [[name[:90], round(ms, 3), n] for name, (ms, n) in ranked]
    if cpu_top:
        host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        ranked = sorted(host, key=lambda e: -e.self_cpu_time_total)[:cpu_top]
        summary["host_ops"] = sum(e.count for e in host)
        summary["top_host_ops"] = [[e.key[:60], round(e.self_cpu_time_total / 1000.0, 3), e.count] for e in ranked]
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        raw = path[:-3] if path.endswith(".gz") else path
        prof.export_chrome_trace(raw)
        if path.endswith(".gz"):
            with open(raw, "rb") as f, gzip.open(path, "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(raw)
    return summary
