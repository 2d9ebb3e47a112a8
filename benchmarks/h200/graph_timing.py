"""Kernel timing as the engine replays kernels: calls captured in one CUDA graph, replayed, timed with events.

Shared by the H200 benchmarks (linear_bench.py, quant_bench.py, decode_plan_sweep.py): inside a graph no
Python launch cost lands between the calls, so small kernels are timed by the GPU, not by the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_call_ms(fn: Callable[[int], object], calls: int, replays: int, warmups: int = 2) -> float:
    """Median milliseconds per call of fn(0), ..., fn(calls - 1) captured in one CUDA graph: `warmups` eager
    calls first on a side stream (compiles, allocator warm-up), one untimed replay, then `replays` timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmups):
            fn(i % calls)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)
