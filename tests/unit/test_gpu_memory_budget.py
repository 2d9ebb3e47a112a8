"""The KV cache budget on a GPU, with torch.cuda's memory queries stood in for (no GPU needed)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.engine.llm_engine import LLMEngine
from kvllm.worker.worker import Worker

GIB = 1 << 30


# A 140 GiB device where another engine of this process holds 28 GiB, and this engine peaks at 1 GiB more.
SECOND_ENGINE = dict(
    total=140 * GIB, free_at_start=112 * GIB, allocated_at_start=28 * GIB, peak_allocated=29 * GIB
)


def _budget(monkeypatch, *, total, free_at_start, allocated_at_start, peak_allocated, utilization):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak_allocated)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, total))
    worker = SimpleNamespace(
        max_num_batched_tokens=2048,
        model_config=SimpleNamespace(max_model_len=1024),
        args=SimpleNamespace(max_num_seqs=8, gpu_memory_utilization=utilization),
        model_runner=SimpleNamespace(profile_run=lambda num_tokens, num_seqs: None),
        free_memory_at_start=free_at_start,
        allocated_at_start=allocated_at_start,
    )
    return Worker._profile_free_gpu_memory(worker)


def test_a_second_engine_in_the_process_gets_its_own_share(monkeypatch):
    """The first engine holds 28 GiB of this process's allocator: the second's peak is its own 1 GiB,
    and its budget is its share (0.2 of the device, as in vLLM) minus that peak."""
    budget = _budget(monkeypatch, **SECOND_ENGINE, utilization=0.2)
    assert budget == int(140 * GIB * 0.2) - 1 * GIB


def test_a_share_larger_than_the_free_memory_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"asks for 126.0 GiB .* only 112.0 GiB were free .*28.0 GiB held"):
        _budget(monkeypatch, **SECOND_ENGINE, utilization=0.9)


def test_a_share_the_model_fills_leaves_no_kv_cache_and_says_so(monkeypatch):
    with pytest.raises(ValueError, match=r"gives 14.0 GiB and the model's peak .* is 15.0 GiB"):
        _budget(
            monkeypatch,
            total=140 * GIB,
            free_at_start=140 * GIB,
            allocated_at_start=0,
            peak_allocated=15 * GIB,
            utilization=0.1,
        )


def test_an_engine_dropped_in_a_reference_cycle_frees_its_memory_before_the_next_one_measures(monkeypatch):
    """The device's free memory is read after the collector ran and the allocator's cache was emptied:
    a first engine that only a reference cycle keeps alive (its cached blocks still reserved) is not
    counted as memory someone else holds."""
    from kvllm.worker.worker import device_memory_at_start

    held = {"engine": 30 * GIB, "cache": 0}

    class Engine:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:  # its tensors go to the allocator's cache, still reserved
            held["cache"] += held.pop("engine")

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: held.update(cache=0))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (140 * GIB - sum(held.values()), 140 * GIB)
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held.get("engine", 0))
    gc.disable()  # the cycle survives until device_memory_at_start collects it
    try:
        Engine()
        assert torch.cuda.mem_get_info()[0] == 110 * GIB
        assert device_memory_at_start(torch.device("cuda")) == (140 * GIB, 0)
    finally:
        gc.enable()
    assert device_memory_at_start(torch.device("cpu")) == (0, 0)


def test_num_gpu_blocks_override_sets_the_cache_size(tiny_qwen3_path) -> None:
    """vLLM's --num-gpu-blocks-override (for testing preemption): the cache size in blocks, still checked."""
    args = {"model": str(tiny_qwen3_path), "dtype": "float32", "max_model_len": 64}
    engine = LLMEngine.from_engine_args(EngineArgs(**args, num_gpu_blocks_override=5))
    assert engine.kv_cache_manager.num_blocks == 5 and engine.stats().num_blocks == 5
    with pytest.raises(ValueError, match="fewer than one request of max_model_len=64"):
        LLMEngine.from_engine_args(EngineArgs(**args, num_gpu_blocks_override=3))
    with pytest.raises(
        ValueError, match="num_gpu_blocks_override=0 is not valid; allowed: a positive integer"
    ):
        EngineArgs(**args, num_gpu_blocks_override=0)
