"""--scheduling-policy priority and the request `priority` (vLLM's), through LLM, LLMEngine and the server."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvllm import LLM, SamplingParams
from kvllm.config.engine import EngineArgs
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.openai.server import build_app
from tests.unit.test_openai_server import assert_openai_error, post


def engine_args(path, policy: str) -> EngineArgs:
    return EngineArgs(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 21,
        scheduling_policy=policy,
        max_num_seqs=1,  # one request at a time: the order they run in is the order they finish in
    )


def finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_priority_orders_requests_lower_first(tiny_qwen3_path) -> None:
    engine = LLMEngine.from_engine_args(engine_args(tiny_qwen3_path, "priority"))
    params = SamplingParams(max_tokens=3, temperature=0)
    for rid, priority in [("p5", 5), ("p-1", -1), ("p0", 0), ("p5b", 5)]:
        engine.add_request(rid, {"prompt_token_ids": [11, 12, 13]}, params, priority=priority)
    assert finish_order(engine) == ["p-1", "p0", "p5", "p5b"]


def test_fcfs_refuses_a_priority_and_leaves_nothing_behind(tiny_qwen3_path) -> None:
    engine = LLMEngine.from_engine_args(engine_args(tiny_qwen3_path, "fcfs"))
    with pytest.raises(ValueError, match="priority=3 is not valid: priority scheduling is not enabled"):
        engine.add_request("r", {"prompt_token_ids": [1, 2]}, SamplingParams(), priority=3)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority=1.5 is not valid; allowed: an integer"):
        engine.add_request("r", {"prompt_token_ids": [1, 2]}, SamplingParams(), priority=1.5)
    engine.add_request("r0", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1), priority=0)
    assert finish_order(engine) == ["r0"]


def test_unknown_policy_is_refused_at_start(tiny_qwen3_path) -> None:
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not valid"):
        engine_args(tiny_qwen3_path, "lifo")


def test_llm_generate_takes_one_priority_per_prompt(tiny_qwen3_path) -> None:
    llm = LLM(**vars(engine_args(tiny_qwen3_path, "priority")))
    prompts = [{"prompt_token_ids": [20 + i, 30, 40]} for i in range(3)]
    params = SamplingParams(max_tokens=2, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
    assert [o.prompt_token_ids[0] for o in outputs] == [20, 21, 22]  # returned in prompt order
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    with pytest.raises(ValueError, match="Got 2 priorities for 3 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_server_priority_field(tiny_qwen3_path, policy) -> None:
    engine = LLMEngine.from_engine_args(engine_args(tiny_qwen3_path, policy))
    app = build_app(engine=engine, served_model_name="tiny", api_key="sk-unit", log_stats_interval=0)
    bodies = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    }
    with TestClient(app) as client:
        for path, body in bodies.items():
            body = {"model": "tiny", **body, "priority": -2}
            response = post(client, path, body)
            if policy == "priority":
                assert response.status_code == 200, response.text
            else:
                assert_openai_error(
                    response, 400, param="priority", text="priority scheduling is not enabled"
                )
            assert post(client, path, {**body, "priority": 0}).status_code == 200


def test_priority_reordering_keeps_every_output_exact(tiny_qwen3_path) -> None:
    """Requests admitted between running ones (and preempted by priority in a small cache) decode the same
    greedy tokens as under fcfs: the reordered batches change no request's output."""
    prompts = [{"prompt_token_ids": [10 + i, 20 + 3 * i, 30, 40 + i, 7]} for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(policy: str, priority: list[int] | None) -> tuple[list[list[int]], int]:
        # 4 blocks of 16 tokens; each request grows to 29 tokens (2 blocks): four at once cannot all fit.
        llm = LLM(
            model=str(tiny_qwen3_path),
            dtype="float32",
            max_model_len=64,
            kv_cache_memory_bytes=1 << 16,
            max_num_seqs=4,
            scheduling_policy=policy,
        )
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks
        return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.scheduler.num_preemptions

    reference, _ = run("fcfs", None)
    reordered, preemptions = run("priority", [3, -1, 2, 0, 5, -4, 1, 0])
    assert reordered == reference
    assert preemptions > 0  # the small cache made the priority order preempt
