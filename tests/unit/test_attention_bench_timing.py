"""The attention benchmark's queued and graph timings (kvllm/benchmarks/attention/main.py: queued_ms, graph_ms),
on a virtual GPU clock: each call adds its kernel time to the clock, events read it, so nothing depends on
this machine."""

from __future__ import annotations

import random

import pytest

from kvllm.benchmarks.attention.main import _Bench, graph_ms, main, queued_ms


class VirtualGpu:
    def __init__(self, kernel_ms: list[float]) -> None:
        self.clock_ms = 0.0
        self.kernel_ms = kernel_ms
        self.calls = 0

    def call(self) -> None:
        self.clock_ms += self.kernel_ms[self.calls % len(self.kernel_ms)]
        self.calls += 1

    def new_event(self) -> VirtualEvent:
        return VirtualEvent(self)


class VirtualEvent:
    def __init__(self, gpu: VirtualGpu) -> None:
        self.gpu = gpu
        self.at_ms = None

    def record(self) -> None:
        self.at_ms = self.gpu.clock_ms

    def elapsed_time(self, end: VirtualEvent) -> float:
        return end.at_ms - self.at_ms


def test_queued_ms_is_the_kernel_time_per_call_and_fills_the_window() -> None:
    kernel_ms = random.uniform(0.05, 0.5)
    gpu = VirtualGpu([kernel_ms])
    host_log: list[float] = []
    ms = queued_ms(gpu.call, 100.0, host_log, new_event=gpu.new_event, synchronize=lambda: None, repeats=5)
    assert ms == pytest.approx(kernel_ms)
    calls_per_window = int(100.0 / kernel_ms / 5)
    assert gpu.calls == 3 + 1 + 5 * calls_per_window  # warm-up, the sizing call, five windows
    assert len(host_log) == 1 and host_log[0] >= 0.0


def test_queued_ms_takes_the_median_window() -> None:
    # Warm-up and sizing take calls 0-3 (1 ms each), so 9 ms over 3 windows is 3 calls a window: calls 4-6,
    # 7-9 and 10-12. Only the second holds the slow call 8: its mean is 3 ms, the others' 1 ms.
    gpu = VirtualGpu([1.0] * 8 + [7.0] + [1.0] * 8)
    ms = queued_ms(gpu.call, 9.0, [], new_event=gpu.new_event, synchronize=lambda: None, repeats=3)
    assert gpu.calls == 13
    assert ms == pytest.approx(1.0)


def test_an_unknown_timing_mode_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--timing", "nonsense"])
    assert exc.value.code == 2


def test_graph_ms_times_the_replay_not_the_eager_call() -> None:
    gpu = VirtualGpu([random.uniform(0.05, 0.5)])
    eager_calls: list[int] = []

    def eager() -> None:
        eager_calls.append(1)
        gpu.call()

    def capture(fn):
        fn()  # captured once
        return gpu.call

    timed: list[object] = []

    def time_call(fn) -> float:
        timed.append(fn)
        return 0.123

    notes: list[str] = []
    assert graph_ms(eager, time_call, capture, notes) == 0.123
    assert timed == [gpu.call] and len(eager_calls) == 1
    assert notes == ["replayed from a CUDA graph"]


def test_graph_ms_times_a_call_that_cannot_be_captured_as_it_is_and_says_why() -> None:
    def eager() -> None:
        pass

    def capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    timed: list[object] = []
    notes: list[str] = []
    assert graph_ms(eager, lambda fn: timed.append(fn) or 0.5, capture, notes) == 0.5
    assert timed == [eager]
    assert len(notes) == 1 and "not replayable" in notes[0] and "operation not permitted" in notes[0]


@pytest.mark.parametrize("timing", ["bench", "queued", "graph"])
def test_the_copy_rate_is_timed_eagerly_whatever_the_timing(timing) -> None:
    """Captured in a graph the copy ran slower (2.77 against 4.27 TB/s on the H200), so the yardstick of
    every row is one eager copy; the rows themselves follow --timing."""
    import argparse

    import torch

    bench = object.__new__(_Bench)
    bench.args = argparse.Namespace(timing=timing, rep_ms=100.0)
    bench.on_gpu, bench.device = True, torch.device("cpu")  # a GPU as far as the timing goes
    timed = []
    bench._do_bench = lambda fn: timed.append(fn) or 0.5  # 4 GiB moved in 0.5 ms
    bench.time_ms = lambda fn: pytest.fail(f"the copy went through --timing {timing}")
    assert bench.copy_bandwidth() == pytest.approx(4 * 1024**3 / 0.5e-3 / 1e12)
    assert len(timed) == 1
