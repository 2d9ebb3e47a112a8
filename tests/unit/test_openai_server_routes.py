"""The routes beside OpenAI's (/ping, /invocations, /reset_prefix_cache) and /v1/responses, in-process."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.config.engine import EngineArgs
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.openai.server import build_app
from tests.unit.test_openai_server import (
    AUTH,
    assert_engine_idle,
    assert_openai_error,
    post,
    sse_events,
    tiny_client,
    tiny_engine,
)

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with tiny_client(engine) as c:
        yield c


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}


# ---- /ping ---------------------------------------------------------------------------------------


def test_ping_answers_get_and_post_without_a_key(client):
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_ping_is_503_once_the_engine_is_dead(tiny_qwen3_path, monkeypatch):
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_qwen3_path), dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20
        )
    )
    app = build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)

    def crash() -> None:
        raise RuntimeError("injected")

    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/ping").status_code == 200
        monkeypatch.setattr(engine, "step", crash)
        assert_openai_error(post(c, "/v1/completions", COMPLETION), 500, text="injected")
        for method in (c.get, c.post):
            assert_openai_error(method("/ping"), 503, text="injected")
        assert_openai_error(post(c, "/reset_prefix_cache", ""), 503)
        assert_openai_error(post(c, "/invocations", COMPLETION), 503)


# ---- /invocations --------------------------------------------------------------------------------


def test_invocations_dispatches_chat_and_completion_bodies(client, engine):
    chat = post(client, "/v1/chat/completions", CHAT).json()
    via_chat = post(client, "/invocations", CHAT)
    assert via_chat.status_code == 200, via_chat.text
    assert via_chat.json()["object"] == "chat.completion"
    assert via_chat.json()["choices"][0]["message"] == chat["choices"][0]["message"]

    completion = post(client, "/v1/completions", COMPLETION).json()
    via_completion = post(client, "/invocations", COMPLETION).json()
    assert via_completion["object"] == "text_completion"
    assert via_completion["choices"][0]["text"] == completion["choices"][0]["text"]

    # vLLM's order: a body with both is a chat request.
    assert post(client, "/invocations", {**COMPLETION, **CHAT}).json()["object"] == "chat.completion"

    events = sse_events(post(client, "/invocations", {**CHAT, "stream": True}))
    assert events[-1] == "[DONE]" and events[0]["object"] == "chat.completion.chunk"
    assert_engine_idle(engine)


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ("{not json", None, "not valid JSON"),
        ("[1, 2]", None, "must be a JSON object"),
        ({"model": "tiny", "input": "hi"}, None, "neither (its fields: input, model)"),
        ({**CHAT, "max_tokens": "many"}, "max_tokens", "valid integer"),
        ({**COMPLETION, "n": 0}, "n", None),
    ],
)
def test_invocations_bad_bodies_are_400s(client, engine, body, param, text):
    assert_openai_error(post(client, "/invocations", body), 400, param, text)
    assert_engine_idle(engine)


def test_invocations_and_reset_need_the_api_key(client):
    for path, body in (("/invocations", COMPLETION), ("/reset_prefix_cache", "")):
        r = client.post(path, content=json.dumps(body))
        assert_openai_error(r, 401, text="Missing API key")


# ---- /reset_prefix_cache -------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_cached_blocks(client, engine):
    post(client, "/v1/completions", {**COMPLETION, "prompt": "a b c d " * 10})
    assert engine.kv_cache_manager.cached_blocks
    r = post(client, "/reset_prefix_cache", "")
    assert r.status_code == 200, r.text
    assert not engine.kv_cache_manager.cached_blocks


def test_reset_prefix_cache_is_409_while_a_request_holds_blocks(client, engine):
    """A stream is held open at its first event, so its request holds blocks during the reset."""
    body = {**COMPLETION, "max_tokens": 100, "stream": True, "ignore_eos": True}
    headers = {**AUTH, "Content-Type": "application/json"}
    with client.stream("POST", "/v1/completions", content=json.dumps(body), headers=headers) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert_openai_error(post(client, "/reset_prefix_cache", ""), 409, text="hold KV blocks")
        for _ in lines:
            pass
    assert post(client, "/reset_prefix_cache", "").status_code == 200


@pytest.mark.parametrize("flag", ["reset_running_requests", "reset_external"])
def test_reset_prefix_cache_refuses_what_kvllm_lacks(client, flag):
    assert_openai_error(post(client, f"/reset_prefix_cache?{flag}=true", ""), 400, flag, "not supported")
    assert post(client, f"/reset_prefix_cache?{flag}=false", "").status_code == 200


def test_async_llm_reset_runs_on_the_engine_thread(tiny_qwen3_path):
    from kvllm.engine.async_llm import AsyncLLM, EngineNotAcceptingError

    async def run() -> None:
        llm = AsyncLLM(tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN))  # its own: the server drives `engine`
        with pytest.raises(EngineNotAcceptingError, match="not running"):
            await llm.reset_prefix_cache()
        await llm.start()
        try:
            assert await llm.call_engine(lambda e: threading.current_thread().name) == "kvllm-engine"
            assert await llm.reset_prefix_cache() is True
            with pytest.raises(ZeroDivisionError):
                await llm.call_engine(lambda e: 1 / 0)
        finally:
            await llm.shutdown()
        with pytest.raises(EngineNotAcceptingError):
            await llm.reset_prefix_cache()

    asyncio.run(run())


# ---- /v1/responses -------------------------------------------------------------------------------

RESPONSE = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 6, "temperature": 0}


def test_response_equals_chat_completion_of_the_same_messages(client, engine):
    r = post(client, "/v1/responses", {**RESPONSE, "instructions": "Be brief", "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Tell me a story"}]
    chat = post(client, "/v1/chat/completions", {**CHAT, "messages": messages, "max_tokens": 6}).json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert (
        body["usage"]["output_tokens"] == 6 == body["usage"]["total_tokens"] - body["usage"]["input_tokens"]
    )
    assert body["instructions"] == "Be brief" and body["metadata"] == {"k": "v"} and body["store"] is False
    assert body["temperature"] == 0
    assert_engine_idle(engine)


def test_response_input_items_render_like_chat_messages(client):
    items = [
        {"type": "message", "role": "developer", "content": "Be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Again"},
    ]
    body = post(client, "/v1/responses", {**RESPONSE, "input": items}).json()
    messages = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    chat = post(client, "/v1/chat/completions", {**CHAT, "messages": messages, "max_tokens": 6}).json()
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_streamed_response_events_add_up_to_the_response(client, engine):
    full = post(client, "/v1/responses", RESPONSE).json()
    r = post(client, "/v1/responses", {**RESPONSE, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names, events = [], []
    for line in r.iter_lines():
        if line.startswith("event: "):
            names.append(line[len("event: ") :])
        elif line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    others = [n for n in names if n != "response.output_text.delta"]
    assert others == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert names.index("response.content_part.added") < names.index("response.output_text.delta")
    text = full["output"][0]["content"][0]["text"]
    assert "".join(d["delta"] for d in deltas) == text
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    completed = events[-1]["response"]
    assert completed["output"][0]["content"][0]["text"] == text
    assert completed["status"] == "incomplete"
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert completed["usage"][key] == full["usage"][key]
    # The same prompt again: its full blocks come from the prefix cache, and usage says so.
    assert completed["usage"]["input_tokens_details"]["cached_tokens"] >= 16
    assert len({e.get("item_id") for e in deltas}) == 1
    assert_engine_idle(engine)


def test_response_that_stops_is_completed(client):
    body = post(client, "/v1/responses", {**RESPONSE, "max_output_tokens": 40}).json()
    # The tiny random model may run to the limit; either way status follows the finish reason.
    if body["usage"]["output_tokens"] < 40:
        assert body["status"] == "completed" and body["incomplete_details"] is None
        assert body["output"][0]["status"] == "completed"
    else:
        assert body["status"] == "incomplete"


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"tools": [{"type": "function", "name": "f"}]}, "tools", "tools are not supported"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
        ({"background": True}, "background", "background"),
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
        ({"conversation": "conv_1"}, "conversation", "not stored"),
        ({"include": ["message.output_text.logprobs"]}, "include", None),
        ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", None),
        ({"text": {"format": {"type": "json_object"}}}, "text", "structured output"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"service_tier": "flex"}, "service_tier", None),
        ({"model": "gpt-4"}, "model", "does not exist"),
        ({"input": []}, "input", "empty"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "message"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "allowed: user"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input_image"),
        ({"max_output_tokens": 1000}, "max_output_tokens", "maximum context length"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"temperature": -1}, "temperature", None),
        ({"input": {"a": 1}}, "input", None),
    ],
)
def test_response_refuses_what_it_cannot_do_by_name(client, engine, extra, param, text):
    assert_openai_error(
        post(client, "/v1/responses", {**RESPONSE, **extra}), 400 if param != "model" else 404, param, text
    )
    assert_engine_idle(engine)


def test_response_accepts_the_defaults_a_client_may_send(client):
    defaults = {
        "store": False,
        "background": False,
        "tools": [],
        "tool_choice": "auto",
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "parallel_tool_calls": True,
        "service_tier": "auto",
    }
    r = post(client, "/v1/responses", {**RESPONSE, **defaults})
    assert r.status_code == 200, r.text
