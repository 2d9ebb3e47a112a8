"""One call under torch.profiler: GPU kernel time against wall time, and the op tables, for the H200 benches."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def profile_call(fn: Callable[[], Any], table: Path, title: str = "") -> dict[str, Any]:
    """Run `fn` once under torch.profiler (CPU, and CUDA when present; kernels replayed from CUDA graphs
    are recorded too) and write to `table` the wall and kernel time, then the ops by host time and the
    kernels by device time. Returns wall_ms, kernels, kernel_ms and device_busy (kernel / wall time: the
    share of the call the device was computing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kernels) / 1e3
    averages = prof.key_averages()
    table.parent.mkdir(parents=True, exist_ok=True)
    with open(table, "w") as f:
        prefix = f"{title}: " if title else ""
        f.write(f"{prefix}wall {wall_ms:.1f} ms, {len(kernels)} kernels, kernel time {kernel_ms:.1f} ms\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
        if kernels:
            f.write(averages.table(sort_by="self_device_time_total", row_limit=30))
    return {
        "wall_ms": round(wall_ms, 2),
        "kernels": len(kernels),
        "kernel_ms": round(kernel_ms, 2),
        "device_busy": round(kernel_ms / wall_ms, 3) if wall_ms else None,
    }
