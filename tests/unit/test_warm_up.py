"""The start-up warm-up: it runs the eager steps serving will run (prefill alone, decodes beside a
prefill chunk, few and many, every sampler path) and leaves no trace in the engine."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from kvllm.engine.warm_up import REQUEST_ID_PREFIX, warm_up_rounds


def _llm(path, **kwargs) -> LLM:
    return LLM(
        str(path),
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=96,
        enable_prefix_caching=True,
        **kwargs,
    )


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_warm_up_runs_mixed_steps_and_every_sampling_path(tiny_qwen3_path, async_scheduling, monkeypatch):
    llm = _llm(tiny_qwen3_path, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    plans = []
    launch = engine.executor.execute_model_async
    monkeypatch.setattr(
        engine.executor, "execute_model_async", lambda plan: plans.append(plan) or launch(plan)
    )
    stats = engine.warm_up()

    assert stats.num_rounds == len(warm_up_rounds()) and stats.num_steps == len(plans)
    assert all(s.request.request_id.startswith(REQUEST_ID_PREFIX) for p in plans for s in p.scheduled)
    mixed_decodes = {
        sum(s.num_new_tokens == 1 for s in p.scheduled)
        for p in plans
        if any(s.num_new_tokens > 1 for s in p.scheduled) and any(s.num_new_tokens == 1 for s in p.scheduled)
    }
    # One decode beside a prefill chunk, and as many as fit (max_num_seqs - 1 = 5) beside one.
    assert {1, 5} <= mixed_decodes, mixed_decodes
    seen = [s.request.sampling_params for p in plans for s in p.scheduled]
    assert any(p.temperature == 0 for p in seen) and any(0 < p.temperature < 1 for p in seen)
    assert any(p.top_p < 1 and p.top_k > 0 for p in seen) and any(p.repetition_penalty != 1 for p in seen)
    assert any(p.logprobs for p in seen)


def test_warm_up_leaves_no_trace(tiny_qwen3_path):
    llm = _llm(tiny_qwen3_path)
    engine = llm.llm_engine
    prompts = [[5, 9, 13, 200, 7, 1, 44, 3] * 5, [300, 2, 17]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    ]
    assert llm.reset_prefix_cache()
    engine.kv_cache_manager.prefix_cache_queries = engine.kv_cache_manager.prefix_cache_hits = 0

    engine.warm_up()

    cache = engine.kv_cache_manager
    assert (
        not engine.has_unfinished_requests() and not engine.scheduler.running and not engine.scheduler.waiting
    )
    assert cache.num_free_blocks == cache.num_blocks and not cache.cached_blocks and not cache.req_blocks
    assert (
        cache.prefix_cache_queries == cache.prefix_cache_hits == 0 and engine.scheduler.num_preemptions == 0
    )
    after = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    assert after == before
    # Finished rows leave the input batch with the next step's plan: none of the warm-up's remain.
    states = engine.executor.worker.model_runner.input_batch.states
    assert not any(rid.startswith(REQUEST_ID_PREFIX) for rid in states), list(states)


def test_warm_up_refuses_an_engine_with_requests(tiny_qwen3_path):
    llm = _llm(tiny_qwen3_path)
    llm.llm_engine.add_request("mine", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before any request"):
        llm.llm_engine.warm_up()


def test_reset_prefix_cache_waits_for_running_requests(tiny_qwen3_path):
    llm = _llm(tiny_qwen3_path)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(10, 60))}
    llm.generate([prompt], SamplingParams(max_tokens=1))
    engine.add_request("running", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.prefix_cache_hits > 0 and not llm.reset_prefix_cache()
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() and not engine.kv_cache_manager.cached_blocks
    hits = engine.kv_cache_manager.prefix_cache_hits
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert engine.kv_cache_manager.prefix_cache_hits == hits  # nothing left to hit
