"""Overlapped scheduling (async_scheduling, the default) against waiting for every step: the same
greedy ids in every scheduling mode, stop strings and tokens exact, aborts clean, nothing leaked."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from tests.e2e.test_engine_vs_hf import MODES, random_prompts


def _generate(path: str, mode: dict, async_scheduling: bool, prompts, params):
    llm = LLM(path, dtype="float32", seed=0, async_scheduling=async_scheduling, **mode)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], stats


@pytest.mark.parametrize("mode", list(MODES))
def test_overlap_on_and_off_give_the_same_greedy_ids(tiny_qwen3_path, mode):
    prompts = random_prompts(400, [1, 3, 17, 64, 129, 200, 333, 500], seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 3, 12, 1, 7, 10, 5, 8)
    ]
    on, on_stats = _generate(str(tiny_qwen3_path), MODES[mode], True, prompts, params)
    off, _ = _generate(str(tiny_qwen3_path), MODES[mode], False, prompts, params)
    assert on == off
    if mode == "preemption":
        assert on_stats.num_preemptions > 0


def test_stops_are_exact_with_overlap(tiny_qwen3_path):
    """No token past a stop string, a stop token or EOS, though the next step was already launched."""
    path = str(tiny_qwen3_path)
    prompts = random_prompts(400, [5, 40, 90, 12], seed=6)
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference, _ = _generate(path, {}, False, prompts, [free] * len(prompts))
    params = []
    for ids, text, _ in reference:
        # Stop on a token id seen mid-way, or on a piece of text from the middle of the output.
        params.append(
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[ids[10]])
        )
        params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[text[8:11]]))
    doubled = [p for p in prompts for _ in range(2)]
    on, _ = _generate(path, {}, True, doubled, params)
    off, _ = _generate(path, {}, False, doubled, params)
    assert on == off
    for (ids, text, reason), p, (ref_ids, ref_text, _) in zip(
        on, params, [r for r in reference for _ in range(2)]
    ):
        assert reason == "stop"
        if p.stop_token_ids:
            assert ids == ref_ids[: ref_ids.index(p.stop_token_ids[0]) + 1]
        else:
            assert p.stop[0] not in text and ref_text.startswith(text)


def test_aborts_with_a_step_in_flight_leak_nothing(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", {"prompt_token_ids": list(range(3 + i, 40 + i))}, params)
    for _ in range(5):
        engine.step()
    assert engine._in_flight is not None  # a step is running while we abort
    engine.abort_request(["a1", "a3"])
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
    assert set(seen) == {"a0", "a2"} and all(len(o.outputs[0].token_ids) == 50 for o in seen.values())
    engine.step()  # drains whatever is still in flight
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
