"""The OpenAI app in-process (Starlette's TestClient): error mapping, endpoints, streams, crash, drain."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.config.engine import EngineArgs
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.openai.server import build_app

API_KEY = "sk-unit"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128


def tiny_engine(path, max_model_len: int = MAX_MODEL_LEN) -> LLMEngine:
    """The server tests' engine: the tiny model in float32 with a small KV cache."""
    args = EngineArgs(
        model=str(path), dtype="float32", max_model_len=max_model_len, kv_cache_memory_bytes=1 << 21
    )
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path)


@pytest.fixture
def own_engine(tiny_qwen3_path) -> LLMEngine:
    """An engine of the test's own, for a test that builds its app while the module's client drives `engine`
    (one AsyncLLM drives an engine at a time)."""
    return tiny_engine(tiny_qwen3_path)


@contextlib.contextmanager
def tiny_client(engine: LLMEngine) -> Iterator[TestClient]:
    """The server over `engine` (model "tiny", key API_KEY, no stats log), started and stopped around it."""
    app = build_app(engine=engine, served_model_name="tiny", api_key=API_KEY, log_stats_interval=0)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with tiny_client(engine) as c:
        yield c


def assert_openai_error(response, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    if text is not None:
        assert text in error["message"]
    return error


def post(client: TestClient, path: str, body: dict | str, headers: dict | None = None):
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers=headers)


def sse_events(response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_engine_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ("{not json", 400, None, "not valid JSON"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
        ({"model": "tiny", "prompt": {"a": 1}}, 400, "prompt", None),
        ({"model": "tiny"}, 400, "prompt", "Field required"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model", "`gpt-4` does not exist"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": 1000},
            400,
            "max_tokens",
            "maximum context length is 128",
        ),
        ({"model": "tiny", "prompt": "a b " * 200}, 400, "prompt", "maximum context length is 128"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "allowed"),
        ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature", ">= 0"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
        ({"model": "tiny", "prompt": "x", "top_k": -3}, 400, "top_k", None),
        ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n", None),
        ({"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs", "0 to 20"),
        ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of", None),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "-100 to 100"),
        ({"model": "tiny", "prompt": []}, 400, "prompt", "empty"),
        ({"model": "tiny", "prompt": [[]]}, 400, "prompt", "empty"),
        ({"model": "tiny", "prompt": [5, 100000]}, 400, None, "out of range"),
    ],
)
def test_completion_bad_input_is_an_openai_error(client, engine, body, status, param, text):
    assert_openai_error(post(client, "/v1/completions", body), status, param, text)
    assert_engine_idle(engine)


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ({"model": "tiny", "messages": []}, 400, "messages", "empty"),
        ({"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages", None),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500},
            400,
            "max_tokens",
            "(16 in the messages, 500 in the completion)",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            400,
            "top_logprobs",
            "logprobs=true",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages",
            "image_url",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function"}],
            },
            400,
            "tools",
            None,
        ),
    ],
)
def test_chat_bad_input_is_an_openai_error(client, engine, body, status, param, text):
    assert_openai_error(post(client, "/v1/chat/completions", body), status, param, text)
    assert_engine_idle(engine)


def test_api_key_and_unknown_routes(client):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert_openai_error(client.post("/v1/completions", json=body), 401, text="Missing API key")
    assert_openai_error(post(client, "/v1/completions", body, {"Authorization": "Bearer nope"}), 401)
    assert_openai_error(client.get("/v1/models"), 401)
    assert_openai_error(client.get("/v1/nothing", headers=AUTH), 404, text="/v1/nothing")
    assert_openai_error(client.get("/v1/completions", headers=AUTH), 405)
    # Outside /v1 no key is needed.
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    assert post(client, "/v1/completions", body).status_code == 200


def test_models_tokenize_detokenize(client):
    models = client.get("/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tokens = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == 16  # the template's tokens around "hi", plus the assistant header
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens", "out of range")
    assert_openai_error(client.post("/tokenize", json={}), 400, "prompt")


def test_completion_shapes_usage_and_token_ids(client, engine):
    body = {
        "model": "tiny",
        "prompt": ["hello", "the cat"],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_token_ids": True,
    }
    result = post(client, "/v1/completions", body).json()
    assert result["object"] == "text_completion" and result["model"] == "tiny"
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    for choice in result["choices"]:
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
        lp = choice["logprobs"]
        assert (
            len(lp["tokens"])
            == len(lp["token_logprobs"])
            == len(lp["top_logprobs"])
            == len(lp["text_offset"])
            == 5
        )
        assert lp["text_offset"][0] == 0 and all(len(top) <= 3 for top in lp["top_logprobs"])
    prompt_tokens = sum(len(c["prompt_token_ids"]) for c in result["choices"][::2])
    assert result["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 20,
        "total_tokens": prompt_tokens + 20,
    }
    echo = post(
        client, "/v1/completions", {**body, "prompt": "hello", "n": 1, "logprobs": None, "echo": True}
    )
    assert echo.json()["choices"][0]["text"].startswith("hello")
    # echo with logprobs: the prompt's tokens lead, the first without a logprob (as OpenAI and vLLM do).
    scored = post(
        client,
        "/v1/completions",
        {**body, "prompt": [5, 6, 7, 8], "n": 1, "logprobs": 2, "echo": True, "max_tokens": 3},
    ).json()["choices"][0]["logprobs"]
    assert len(scored["tokens"]) == len(scored["token_logprobs"]) == len(scored["text_offset"]) == 4 + 3
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in scored["token_logprobs"][1:])
    assert scored["text_offset"] == sorted(scored["text_offset"])
    assert_engine_idle(engine)


@pytest.mark.parametrize("echo", [False, True])
def test_streams_equal_full_responses(client, engine, echo):
    body = {
        "model": "tiny",
        "prompt": ["hello", "the cat"],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "logprobs": 1,
        "echo": echo,
    }
    full = post(client, "/v1/completions", body).json()
    with client.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == full["usage"] and events[-2]["choices"] == []
    texts, tokens = {}, {}
    for event in events[:-2]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["logprobs"]:
                tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert tokens == {c["index"]: c["logprobs"]["tokens"] for c in full["choices"]}

    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = post(client, "/v1/chat/completions", chat).json()
    assert full["object"] == "chat.completion"
    with client.stream(
        "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH
    ) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert {e["choices"][0]["delta"].get("role") for e in events[:2]} == {"assistant"}
    texts, finish = {}, {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    assert texts == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in full["choices"]}
    for choice in full["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == full["usage"]["completion_tokens"] // 2
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert_engine_idle(engine)


def test_metrics_are_per_app_and_count_requests(own_engine):
    # Two apps in one process: each has its own Prometheus registry (no duplicate-series errors).
    for _ in range(2):
        app = build_app(engine=own_engine, served_model_name="m", log_stats_interval=0)
        with TestClient(app) as c:
            out = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
            text = c.get("/metrics").text
    assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 3.0' in text
    assert (
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {float(out["usage"]["prompt_tokens"])}'
        in text
    )
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 0.0' in text
    assert 'vllm:request_generation_tokens_sum{engine="0",model_name="m"} 3.0' in text
    assert (
        "vllm:time_to_first_token_seconds_count" in text and "vllm:e2e_request_latency_seconds_bucket" in text
    )


@pytest.mark.parametrize("stream", [False, True])
def test_engine_crash_fails_requests_and_marks_unhealthy(own_engine, monkeypatch, stream):
    engine = own_engine
    app = build_app(engine=engine, served_model_name="m", log_stats_interval=0)

    def broken_step():
        raise RuntimeError("simulated device failure")

    body = {"prompt": "hi", "max_tokens": 3, "stream": stream}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200
        monkeypatch.setattr(engine, "step", broken_step)
        if stream:
            # The 200 and the headers are sent before the crash: the stream ends with an error event.
            with c.stream("POST", "/v1/completions", json=body) as response:
                events = sse_events(response)
            assert response.status_code == 200 and events[-1] == "[DONE]"
            assert (
                events[-2]["error"]["code"] == 500
                and "simulated device failure" in events[-2]["error"]["message"]
            )
        else:
            assert_openai_error(c.post("/v1/completions", json=body), 500, text="simulated device failure")
        assert_openai_error(c.get("/health"), 503, text="simulated device failure")
        assert_openai_error(c.post("/v1/completions", json=body), 503, text="restart the server")
    monkeypatch.undo()
    engine.abort_request(
        list(engine.output_processor.parents)
    )  # the crashed step left its request in the engine
    assert_engine_idle(engine)


def test_generation_config_defaults_fill_unset_fields():
    """Fields a request leaves unset take the model's generation_config.json defaults; set ones win."""
    from types import SimpleNamespace

    from kvllm.entrypoints.openai.protocol import CompletionRequest
    from kvllm.entrypoints.openai.serving_engine import OpenAIServing

    model_config = SimpleNamespace(default_sampling={"temperature": 0.25, "top_k": 7})
    llm = SimpleNamespace(
        tokenizer=None, max_model_len=128, engine=SimpleNamespace(model_config=model_config)
    )
    serving = OpenAIServing(llm, ["tiny"])
    unset = serving.sampling_params(CompletionRequest(model="tiny", prompt="x"), 4, None)
    assert (unset.temperature, unset.top_k) == (0.25, 7)
    explicit = serving.sampling_params(CompletionRequest(model="tiny", prompt="x", temperature=0.9), 4, None)
    assert (explicit.temperature, explicit.top_k) == (0.9, 7)
