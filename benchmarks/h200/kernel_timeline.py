"""Where a whole GPU run's time goes, from its kernel timeline: busy and idle time, kernel time by kind.

    summary = profile_kernels(lambda: llm.generate(...))

The run goes under torch.profiler with CUDA activity only; the kernels come back as (name, start, end).
Programmatic dependent launch lets a kernel start before its predecessor ends and wait inside, so a
kernel's own duration overstates it; here each kernel is charged only the time it extends the timeline
past every kernel before it ("exclusive" time), which adds up to the busy time exactly. Idle time is the
gaps between kernels, counted by length (a few microseconds is launch latency inside a graph, hundreds
is the host not keeping up).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

# Kernel kinds by name fragment, first match wins (lower-case). Anything else is "other".
KINDS = (
    ("attention", ("attention", "flash", "fmha", "reduce_segments")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "linear", "splitk", "split_k")),
    ("rope + kv write", ("rope", "rotary", "reshape_and_cache", "kv_write", "cache")),
    ("norm", ("rms_norm", "layer_norm", "norm")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("sampling", ("gumbel", "sample", "argmax", "topk", "top_k", "softmax", "sort")),
    ("copies", ("memcpy", "memset", "copy", "fill", "index", "gather", "scatter", "cat")),
)
GAP_BUCKETS_US = (5.0, 20.0, 100.0, 1000.0)


def kind_of(name: str) -> str:
    lower = name.lower()
    for kind, fragments in KINDS:
        if any(f in lower for f in fragments):
            return kind
    return "other"


def summarize(kernels: Iterable[tuple[str, float, float]], wall_us: float, top: int = 25) -> dict[str, Any]:
    """kernels: (name, start_us, end_us) in any order. Returns busy/idle time, exclusive time by kind and
    by name (the top `top`), and the idle gaps by length."""
    ordered = sorted(kernels, key=lambda k: k[1])
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # exclusive, own duration, count
    gaps = [0.0] * (len(GAP_BUCKETS_US) + 1)
    gap_counts = [0] * (len(GAP_BUCKETS_US) + 1)
    busy = 0.0
    frontier = None
    for name, start, end in ordered:
        if frontier is not None and start > frontier:
            gap = start - frontier
            bucket = next((i for i, b in enumerate(GAP_BUCKETS_US) if gap < b), len(GAP_BUCKETS_US))
            gaps[bucket] += gap
            gap_counts[bucket] += 1
        exclusive = max(0.0, end - (start if frontier is None else max(start, frontier)))
        frontier = end if frontier is None else max(frontier, end)
        busy += exclusive
        by_kind[kind_of(name)] += exclusive
        entry = by_name[name]
        entry[0] += exclusive
        entry[1] += end - start
        entry[2] += 1
    span = (frontier - ordered[0][1]) if ordered else 0.0
    labels = [f"< {b:g} us" for b in GAP_BUCKETS_US] + [f">= {GAP_BUCKETS_US[-1]:g} us"]
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "wall_ms": round(wall_us / 1e3, 3),
        "kernels": len(ordered),
        "first_to_last_kernel_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "busy_fraction_of_wall": round(busy / wall_us, 4) if wall_us else None,
        "idle_ms_by_gap": {label: round(g / 1e3, 3) for label, g in zip(labels, gaps)},
        "idle_gaps_by_length": dict(zip(labels, gap_counts)),
        "exclusive_ms_by_kind": {
            k: round(v / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"name": n[:140], "exclusive_ms": round(e / 1e3, 3), "own_ms": round(d / 1e3, 3), "count": c}
            for n, (e, d, c) in names
        ],
    }


def _kernel_events(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every CUDA kernel and memory op, from the raw kineto results (building
    torch's FunctionEvent tree for a run of ~10^5 kernels takes minutes)."""
    import torch

    out = []
    results = getattr(prof.profiler, "kineto_results", None)
    if results is not None:
        for e in results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA:
                start = e.start_ns() / 1e3
                out.append((e.name(), start, start + e.duration_ns() / 1e3))
        return out
    for e in prof.events():  # older torch
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def profile_kernels(fn: Callable[[], Any], top: int = 25) -> tuple[Any, dict[str, Any]]:
    """Run fn once under torch.profiler (CUDA activity); returns fn's result and `summarize` of its kernels."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    return result, summarize(_kernel_events(prof), wall_us, top)
