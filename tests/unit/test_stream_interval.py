"""--stream-interval (vLLM's): streamed outputs every N new tokens, the first and the last at once, with the
same text and usage as a stream of every token."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from kvllm.config.engine import EngineArgs
from kvllm.engine.async_llm import AsyncLLM, _RequestState
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.openai.server import build_app
from kvllm.outputs import CompletionOutput, RequestOutput
from tests.unit.test_openai_server import assert_engine_idle, post, sse_events


def streamed(path, interval: int) -> tuple[list[str], dict]:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(path),
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=1 << 21,
            stream_interval=interval,
        )
    )
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with TestClient(build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)) as client:
        events = sse_events(post(client, "/v1/completions", body))
        assert_engine_idle(engine)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
    return texts, events[-2]["usage"]


def test_stream_interval_batches_chunks_without_changing_the_output(tiny_qwen3_path) -> None:
    every, usage_every = streamed(tiny_qwen3_path, 1)
    batched, usage_batched = streamed(tiny_qwen3_path, 4)
    assert "".join(batched) == "".join(every) and usage_batched == usage_every
    assert len(batched) <= 4  # at most: the first token, then every 4 new tokens, then the last


def test_outputs_are_queued_every_interval_first_and_last_at_once(tiny_qwen3_path) -> None:
    """The queueing rule itself, on synthetic steps of one request (deterministic: no consumer races)."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_qwen3_path), dtype="float32", max_model_len=128, stream_interval=4)
    )
    llm = AsyncLLM(engine)
    state = _RequestState(asyncio.Queue(), None, [1, 2], 1, 0.0)
    llm._states["r"] = state
    for k in range(1, 11):
        output = CompletionOutput(0, "x" * k, list(range(k)), None, None, "length" if k == 10 else None)
        llm._on_step([RequestOutput("r", None, [1, 2], [output], finished=k == 10)], engine.stats())
    queued = []
    while not state.queue.empty():
        queued.append(state.queue.get_nowait().num_output_tokens)
    assert queued == [1, 5, 9, 10]


def test_bad_stream_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval=0 is not valid; allowed: an integer >= 1"):
        EngineArgs(stream_interval=0)
