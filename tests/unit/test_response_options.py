"""The server-wide answer options (vLLM's flags): --enable-prompt-tokens-details, --enable-force-include-usage
and --return-tokens-as-token-ids, on /v1/completions and /v1/chat/completions, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.config.serving import ResponseOptions
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.cli import serve
from kvllm.entrypoints.cli.main import build_parser
from kvllm.entrypoints.openai.server import build_app
from tests.unit.attention_fixtures import kvllm_logs  # noqa: F401
from tests.unit.test_openai_server import assert_engine_idle, post, sse_events, tiny_engine

MAX_MODEL_LEN = 128
CHAT_BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0,
}
ALL_ON = ResponseOptions(
    enable_prompt_tokens_details=True, enable_force_include_usage=True, return_tokens_as_token_ids=True
)


# One app per engine at a time: two apps would run two engine threads over one engine.
@pytest.fixture
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


def client_for(engine: LLMEngine, options: ResponseOptions | None) -> TestClient:
    app = build_app(
        engine=engine,
        served_model_name="tiny",
        api_key="sk-unit",
        log_stats_interval=0,
        response_options=options,
    )
    return TestClient(app)


@pytest.fixture
def client_on(tiny_qwen3_path) -> Iterator[TestClient]:
    with client_for(tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN), ALL_ON) as c:
        yield c


@pytest.fixture
def client_off(tiny_qwen3_path) -> Iterator[TestClient]:
    with client_for(tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN), None) as c:
        yield c


def bodies(tag: str) -> dict[str, dict]:
    """A completion and a chat body whose prompts span two full KV blocks and are this test's own."""
    text = tag + " " + " ".join(f"w{i}" for i in range(14))
    return {
        "/v1/completions": {"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0},
        "/v1/chat/completions": {
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 3,
            "temperature": 0,
        },
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_tokens_details_report_the_prefix_cache_hits(client_on, client_off, path) -> None:
    engine = client_on.app.state.llm.engine
    body = bodies(f"details{path}")[path]
    first = post(client_on, path, body).json()["usage"]
    assert "prompt_tokens_details" not in first  # nothing cached yet: left out, as vLLM does
    before = engine.kv_cache_manager.prefix_cache_hits
    second = post(client_on, path, body).json()["usage"]
    hits = engine.kv_cache_manager.prefix_cache_hits - before
    assert hits > 0 and second["prompt_tokens_details"] == {"cached_tokens": hits}
    streamed = sse_events(post(client_on, path, {**body, "stream": True}))
    assert streamed[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": hits}
    assert_engine_idle(engine)
    off_engine = client_off.app.state.llm.engine
    post(client_off, path, body)
    before = off_engine.kv_cache_manager.prefix_cache_hits
    off = post(client_off, path, body).json()["usage"]
    assert off_engine.kv_cache_manager.prefix_cache_hits > before and "prompt_tokens_details" not in off


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_force_include_usage_ends_every_stream_with_usage(client_on, client_off, path) -> None:
    body = {**bodies(f"usage{path}")[path], "stream": True}
    forced = sse_events(post(client_on, path, body))
    assert forced[-1] == "[DONE]" and forced[-2]["choices"] == []
    usage = forced[-2]["usage"]
    assert usage["completion_tokens"] == 3 and usage["total_tokens"] == usage["prompt_tokens"] + 3
    plain = sse_events(post(client_off, path, body))
    assert all(not isinstance(e, dict) or e.get("usage") is None for e in plain)
    # A request that turns usage off explicitly still gets it under the flag (vLLM's rule).
    off = sse_events(post(client_on, path, {**body, "stream_options": {"include_usage": False}}))
    assert off[-2]["usage"]["completion_tokens"] == 3


def test_return_tokens_as_token_ids_by_default(client_on, client_off) -> None:
    body = {**bodies("ids")["/v1/completions"], "logprobs": 1, "return_token_ids": True}
    on = post(client_on, "/v1/completions", body).json()["choices"][0]
    assert on["logprobs"]["tokens"] == [f"token_id:{t}" for t in on["token_ids"]]
    off = post(client_off, "/v1/completions", body).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in off["logprobs"]["tokens"])
    chat = {**bodies("ids")["/v1/chat/completions"], "logprobs": True, "return_token_ids": True}
    on_chat = post(client_on, "/v1/chat/completions", chat).json()["choices"][0]
    assert [e["token"] for e in on_chat["logprobs"]["content"]] == [
        f"token_id:{t}" for t in on_chat["token_ids"]
    ]


def test_serve_flags_map_to_the_options() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-prompt-tokens-details",
            "--enable-force-include-usage",
            "--return-tokens-as-token-ids",
        ]
    )
    assert serve.response_options_from_cli(args) == ALL_ON
    assert serve.response_options_from_cli(build_parser().parse_args(["serve"])) == ResponseOptions()
    batch = build_parser().parse_args(
        ["run-batch", "-i", "in", "-o", "out", "--enable-prompt-tokens-details"]
    )
    assert serve.response_options_from_cli(batch).enable_prompt_tokens_details


def test_request_id_headers(engine) -> None:
    from kvllm.config.serving import HttpOptions
    from kvllm.entrypoints.openai import http_options

    app = build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)
    http_options.apply_to_app(app, HttpOptions(enable_request_id_headers=True))
    with TestClient(app) as client:
        echoed = client.get("/health", headers={"X-Request-Id": "trace-42"})
        assert echoed.headers["x-request-id"] == "trace-42"
        fresh = [client.get("/v1/models").headers["x-request-id"] for _ in range(2)]
        assert fresh[0] != fresh[1] and all(len(f) == 32 for f in fresh)
        too_long = client.get("/health", headers={"X-Request-Id": "x" * 300}).headers["x-request-id"]
        assert too_long != "x" * 300 and len(too_long) == 32
        refused = post(client, "/v1/completions", {"model": "nope", "prompt": "hi"}, {"X-Request-Id": "e-1"})
        assert refused.status_code == 404 and refused.headers["x-request-id"] == "e-1"
    with TestClient(build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)) as plain:
        assert "x-request-id" not in plain.get("/health").headers
    args = build_parser().parse_args(["serve", "--enable-request-id-headers"])
    assert serve.http_options_from_cli(args).enable_request_id_headers


def test_response_role(engine) -> None:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    with client_for(engine, ResponseOptions(response_role="model")) as client:
        assert post(client, "/v1/chat/completions", chat).json()["choices"][0]["message"]["role"] == "model"
        events = sse_events(post(client, "/v1/chat/completions", {**chat, "stream": True}))
        assert events[0]["choices"][0]["delta"]["role"] == "model"
        # Without a generation prompt the reply continues the last message, in its role (vLLM's rule).
        cont = {**chat, "add_generation_prompt": False, "continue_final_message": True}
        cont["messages"] = [*chat["messages"], {"role": "assistant", "content": "Hello"}]
        assert (
            post(client, "/v1/chat/completions", cont).json()["choices"][0]["message"]["role"] == "assistant"
        )
        echoed = post(client, "/v1/chat/completions", {**cont, "echo": True}).json()["choices"][0]["message"]
        assert echoed["content"].startswith("Hello")
    with client_for(engine, None) as client:
        assert (
            post(client, "/v1/chat/completions", chat).json()["choices"][0]["message"]["role"] == "assistant"
        )
    args = build_parser().parse_args(["serve", "--response-role", "model"])
    assert serve.response_options_from_cli(args).response_role == "model"
    with pytest.raises(ValueError, match="--response-role is empty"):
        ResponseOptions(response_role=" ")


def test_server_load_counts_requests_until_their_last_byte(engine) -> None:
    import threading

    from kvllm.config.serving import HttpOptions
    from kvllm.entrypoints.openai import http_options

    app = build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)
    http_options.apply_to_app(app, HttpOptions(enable_server_load_tracking=True))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with TestClient(app) as client:
        assert client.get("/load").json() == {"server_load": 0}
        release, entered = threading.Event(), threading.Event()
        original = engine.step

        def held_step():  # the stream's generation waits here until the load was read
            if not release.is_set():
                entered.set()
                release.wait(30)
            return original()

        engine.step = held_step
        try:
            worker = threading.Thread(target=lambda: post(client, "/v1/completions", body).read())
            worker.start()
            assert entered.wait(30)
            assert client.get("/load").json() == {"server_load": 1}
            release.set()
            worker.join(30)
        finally:
            engine.step = original
        assert client.get("/load").json() == {"server_load": 0}
        assert post(client, "/v1/completions", {**body, "model": "nope"}).status_code == 404
        assert client.get("/load").json() == {"server_load": 0}  # refused requests leave no count
    with TestClient(build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)) as plain:
        assert plain.get("/load").json() == {"server_load": 0}  # untracked: vLLM's 0
    args = build_parser().parse_args(["serve", "--enable-server-load-tracking"])
    assert serve.http_options_from_cli(args).enable_server_load_tracking


def test_request_logs(engine, kvllm_logs) -> None:  # noqa: F811 (the fixture)
    from kvllm.entrypoints.openai.request_logger import RequestLogger

    app = build_app(
        engine=engine,
        served_model_name="tiny",
        log_stats_interval=0,
        request_logger=RequestLogger(log_outputs=True, max_log_len=5),
    )
    body = {"model": "tiny", "prompt": "secret prompt text", "max_tokens": 3, "temperature": 0, "n": 2}
    with TestClient(app) as client:
        answer = post(client, "/v1/completions", body).json()
        streamed = sse_events(post(client, "/v1/chat/completions", {**CHAT_BODY, "stream": True}))
    received = [r.getMessage() for r in kvllm_logs.records if r.getMessage().startswith("Received request")]
    generated = [
        r.getMessage() for r in kvllm_logs.records if r.getMessage().startswith("Generated response")
    ]
    assert len(received) == 2 and "prompt: 'secre'," in received[0] and "max_tokens=3" in received[0]
    assert "secret prompt" not in " ".join(received)  # clipped to --max-log-len characters
    texts = [c["text"] for c in answer["choices"]]
    assert len(generated) == 3  # two sequences of the completion, one chat reply
    assert any(f"output: {texts[0][:5]!r}" in g and "(sequence 0)" in g for g in generated)
    assert any("finish_reason: length" in g for g in generated) and streamed[-1] == "[DONE]"


def test_request_log_flags() -> None:
    assert serve.request_logger_from_cli(build_parser().parse_args(["serve"])) is None
    args = build_parser().parse_args(
        ["serve", "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "9"]
    )
    logger_ = serve.request_logger_from_cli(args)
    assert logger_ is not None and logger_.log_outputs and logger_.max_log_len == 9
    with pytest.raises(ValueError, match="--enable-log-outputs needs --enable-log-requests"):
        serve.request_logger_from_cli(build_parser().parse_args(["serve", "--enable-log-outputs"]))
