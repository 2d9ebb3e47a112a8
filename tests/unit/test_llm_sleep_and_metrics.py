"""LLM.sleep / wake_up (on the CPU: the KV cache is freed, the weights detached, both restored) and
LLM.get_metrics (vLLM's reader objects over the engine's counters)."""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.engine.llm_engine import EngineSleepingError
from kvllm.engine.metrics_reader import Counter, Gauge, Histogram, build_1_2_5_buckets

PROMPTS = ["The capital of France is", "Once upon a time, there was"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path) -> LLM:
    return LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 21)


def greedy_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def runner(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner


@pytest.mark.parametrize("level", [1, 2])
def test_generate_after_wake_up_gives_the_same_greedy_ids(llm, level):
    expected = greedy_ids(llm)
    llm.sleep(level=level)
    assert llm.is_sleeping()
    model_runner = runner(llm)
    assert all(layer.kv_cache.numel() == 0 for layer in model_runner.attention_layers)
    if level == 1:
        assert all(p.numel() == 0 for p in model_runner.model.parameters())
    else:
        assert model_runner.model is None
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert all(layer.kv_cache.numel() > 0 for layer in runner(llm).attention_layers)
    assert greedy_ids(llm) == expected


def test_wake_up_by_tags_weights_first(llm):
    expected = greedy_ids(llm)
    llm.sleep()
    with pytest.raises(ValueError, match="wake 'weights' first"):
        llm.wake_up(tags=["kv_cache"])
    with pytest.raises(ValueError, match="allowed: weights, kv_cache"):
        llm.wake_up(tags=["weights", "lora"])
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps
    assert all(p.numel() > 0 for p in runner(llm).model.parameters())
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert greedy_ids(llm) == expected
    llm.wake_up()  # awake: nothing to do


def test_sleep_refuses_bad_levels_twice_and_running_requests(llm):
    with pytest.raises(ValueError, match="allowed: 1, 2"):
        llm.sleep(level=3)
    llm.llm_engine.add_request("busy", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="1 request"):
        llm.sleep()
    llm.llm_engine.abort_request("busy")
    llm.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    llm.wake_up()


def test_sleep_forgets_cached_prefixes(llm):
    greedy_ids(llm)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.cached_blocks
    llm.sleep()
    # The new cache is zeroed: a prefix hit on the old hashes would read zeros.
    assert not engine.kv_cache_manager.cached_blocks
    llm.wake_up()


def by_name(metrics, name: str, **labels: str):
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_get_metrics_counts_what_generate_did(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 21)
    outputs = llm.generate(
        PROMPTS, [GREEDY, SamplingParams(temperature=0, max_tokens=3, n=2)], use_tqdm=False
    )
    metrics = llm.get_metrics()
    labels = {"model_name": str(tiny_qwen3_path), "engine": "0"}
    assert all({"model_name", "engine"} <= set(m.labels) and m.name.startswith("vllm:") for m in metrics)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert by_name(metrics, "vllm:prompt_tokens") == Counter("vllm:prompt_tokens", labels, num_prompt)
    assert by_name(metrics, "vllm:generation_tokens").value == num_generated == 8 + 2 * 3
    assert by_name(metrics, "vllm:request_success", finished_reason="length").value == 3
    assert by_name(metrics, "vllm:request_success", finished_reason="stop").value == 0
    assert by_name(metrics, "vllm:num_requests_running") == Gauge("vllm:num_requests_running", labels, 0.0)
    assert by_name(metrics, "vllm:engine_sleep_state", sleep_state="awake").value == 1.0
    hist = by_name(metrics, "vllm:request_generation_tokens")
    assert isinstance(hist, Histogram)
    assert hist.count == 2 and hist.sum == num_generated
    assert list(hist.buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    # One request generated 6 tokens (n=2 x 3), the other 8: both in the "10.0" bucket, none at "5.0".
    assert hist.buckets["5.0"] == 0 and hist.buckets["10.0"] == 2 and hist.buckets["+Inf"] == 2
    llm.sleep()
    asleep = llm.get_metrics()
    assert by_name(asleep, "vllm:engine_sleep_state", sleep_state="weights_offloaded").value == 1.0
    assert by_name(asleep, "vllm:engine_sleep_state", sleep_state="awake").value == 0.0
    llm.wake_up()


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]


def test_offload_keeps_tied_weights_tied(llm):
    model = runner(llm).model
    before = {id(p) for p in model.parameters()}
    llm.sleep()
    llm.wake_up()
    assert {id(p) for p in runner(llm).model.parameters()} == before
    assert all(p.device == torch.device("cpu") for p in runner(llm).model.parameters())
