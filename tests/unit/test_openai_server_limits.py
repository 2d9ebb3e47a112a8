"""The OpenAI app in-process against hostile but ordinary input: request limits (400 naming the limit and
its flag), the body-size limit (413), request chat templates (refused unless trusted; bounded when
rendered), invalid Unicode, an event loop that tokenizing cannot block, errors without internals, and
an OpenAPI document that says what the server sends."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.config.engine import EngineArgs
from kvllm.config.serving import ServingLimits
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.cli import serve
from kvllm.entrypoints.cli.main import main
from kvllm.entrypoints.openai.server import build_app
from tests.unit.test_openai_server import assert_engine_idle, assert_openai_error

HI = [{"role": "user", "content": "hi"}]


def small_engine(path) -> LLMEngine:
    args = EngineArgs(model=str(path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 21)
    return LLMEngine.from_engine_args(args)


# One AsyncLLM drives an engine at a time: each app that may run beside another has an engine of its own.
@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return small_engine(tiny_qwen3_path)


@pytest.fixture(scope="module")
def strict_engine(tiny_qwen3_path) -> LLMEngine:
    return small_engine(tiny_qwen3_path)


@pytest.fixture
def own_engine(tiny_qwen3_path) -> LLMEngine:
    return small_engine(tiny_qwen3_path)


def make_client(engine: LLMEngine, **limits) -> TestClient:
    app = build_app(
        engine=engine, served_model_name="tiny", log_stats_interval=0, limits=ServingLimits(**limits)
    )
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with make_client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def strict(strict_engine) -> Iterator[TestClient]:
    with make_client(
        strict_engine,
        max_n_sequences=4,
        max_prompts_per_request=3,
        max_stop_strings=2,
        max_generation_tokens_per_request=40,
        max_request_body_bytes=2000,
    ) as c:
        yield c


# ---- limits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "text"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "n": 5, "max_tokens": 1},
            "n",
            "max_n_sequences=4 (--max-n-sequences)",
        ),
        ("/v1/chat/completions", {"messages": HI, "n": 5, "max_tokens": 1}, "n", "(--max-n-sequences)"),
        (
            "/v1/completions",
            {"prompt": ["a", "b", "c", "d"], "max_tokens": 1},
            "prompt",
            "4 prompts, more than this server allows: max_prompts_per_request=3 (--max-prompts-per-request)",
        ),
        (
            "/v1/completions",
            {"prompt": [[5, 6], [7], [8], [9]], "max_tokens": 1},
            "prompt",
            "(--max-prompts-per-request)",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stop": ["a", "b", "c"]},
            "stop",
            "stop has 3 strings, more than this server allows: max_stop_strings=2 (--max-stop-strings)",
        ),
        ("/v1/chat/completions", {"messages": HI, "stop": ["a", "b", "c"]}, "stop", "(--max-stop-strings)"),
        (
            "/v1/completions",
            {"prompt": ["a", "b"], "n": 3, "max_tokens": 7},
            "max_tokens",
            "up to 42 tokens (n=3 x max_tokens=7 x 2 prompts), more than this server allows: "
            "max_generation_tokens_per_request=40 (--max-generation-tokens-per-request)",
        ),
        # Without max_tokens a chat request may fill the context: 2 x (128 - 16) tokens.
        ("/v1/chat/completions", {"messages": HI, "n": 2}, "max_tokens", "up to 224 tokens"),
    ],
)
def test_each_limit_is_a_400_naming_the_limit_and_its_flag(strict, strict_engine, path, body, param, text):
    assert_openai_error(strict.post(path, json=body), 400, param, text)
    assert_engine_idle(strict_engine)


def test_default_limits_refuse_a_huge_n_and_allow_ordinary_requests(client, engine):
    assert_openai_error(
        client.post("/v1/completions", json={"prompt": "x", "n": 200000}), 400, "n", "max_n_sequences=64"
    )
    ok = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2, "ignore_eos": True}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12
    assert_engine_idle(engine)


def test_limits_are_validated_and_become_serve_flags(capsys):
    with pytest.raises(ValueError, match="max_stop_strings=0 is not valid; allowed: a positive integer"):
        ServingLimits(max_stop_strings=0)
    assert main(["serve", "--max-n-sequences", "0"]) == 2
    assert "max_n_sequences=0 is not valid" in capsys.readouterr().err


# ---- body size -------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_declared_or_chunked(strict, strict_engine):
    big = json.dumps({"prompt": "x" * 3000, "max_tokens": 1})
    declared = strict.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert_openai_error(declared, 413, text="larger than 2000 bytes")
    assert "--max-request-body-bytes" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies to the bytes read
        for i in range(0, len(big), 500):
            yield big[i : i + 500].encode()

    chunked = strict.post("/tokenize", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(chunked, 413, text="larger than 2000 bytes")
    small = strict.post("/tokenize", json={"prompt": "x" * 100})
    assert small.status_code == 200
    assert_engine_idle(strict_engine)


# ---- chat templates --------------------------------------------------------------------------------

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_request_chat_templates_are_refused_unless_trusted(client, engine):
    for body in (
        {"messages": HI, "chat_template": "{{ messages[0]['content'] }}"},
        {"messages": HI, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}},
    ):
        assert_openai_error(
            client.post("/v1/chat/completions", json=body),
            400,
            "chat_template",
            "--trust-request-chat-template",
        )
    assert_openai_error(
        client.post("/v1/chat/completions", json={"messages": HI, "chat_template_kwargs": {"messages": []}}),
        400,
        "chat_template_kwargs",
        "set by the server",
    )
    # Template variables are still allowed.
    ok = client.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"x": 1}}
    )
    assert ok.status_code == 200
    assert_engine_idle(engine)


def test_trusted_request_templates_render_sandboxed_and_bounded(own_engine):
    with make_client(own_engine, trust_request_chat_template=True) as c:
        body = {
            "messages": HI,
            "max_tokens": 1,
            "return_token_ids": True,
            "chat_template": "Q: {{ messages[0].content }}",
        }
        out = c.post("/v1/chat/completions", json=body).json()
        assert out["prompt_token_ids"] == own_engine.tokenizer("Q: hi", add_special_tokens=False).input_ids
        for template, text in [
            (NESTED_LOOPS, "range() more than"),
            ("{{ 'a' * 100000000 }}", "more than"),
            ("{{ 'x' | center(1000000000) }}", "the number 1000000000"),
            ("{{ ().__class__ }}{{ raise_exception('no') }}", "no"),
            ("{% for %}", "not valid Jinja"),
        ]:
            response = c.post("/v1/chat/completions", json={"messages": HI, "chat_template": template})
            assert_openai_error(response, 400, "messages", text)
    assert_engine_idle(own_engine)


# ---- invalid Unicode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw_body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"]}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages",
        ),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ],
)
def test_lone_surrogates_are_a_400_without_internals(client, engine, path, raw_body, param):
    response = client.post(path, content=raw_body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400, param, "not valid Unicode: it holds a lone surrogate")
    assert "Traceback" not in error["message"] and "Error(" not in error["message"]
    assert_engine_idle(engine)


# ---- errors ----------------------------------------------------------------------------------------


def test_an_internal_error_fails_one_request_without_its_details(client, engine, monkeypatch):
    from kvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(OpenAIServingCompletion, "_choice", broken)
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
    assert "secret" not in error["message"] and "the server log has the details" in error["message"]
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert client.get("/health").status_code == 200
    assert_engine_idle(engine)


def test_openapi_documents_the_statuses_the_server_sends(own_engine):
    app = build_app(engine=own_engine, served_model_name="tiny", api_key="k", log_stats_interval=0)
    with TestClient(app) as c:
        document = c.get("/openapi.json").json()
        assert '"422"' not in json.dumps(document) and "HTTPValidationError" not in json.dumps(document)
        auth = {"Authorization": "Bearer k"}
        sent = {
            ("/v1/completions", "post"): [
                c.post("/v1/completions", json={"prompt": 5}, headers=auth).status_code,
                c.post("/v1/completions", json={"prompt": "x"}).status_code,
                c.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth).status_code,
            ],
            ("/v1/chat/completions", "post"): [
                c.post("/v1/chat/completions", json={"messages": "x"}, headers=auth).status_code
            ],
            ("/tokenize", "post"): [c.post("/tokenize", json={}).status_code],
        }
        assert sent == {k: v for k, v in sent.items() if all(400 <= s < 500 for s in v)}
        for (path, method), statuses in sent.items():
            documented = document["paths"][path][method]["responses"]
            for status in statuses:
                assert str(status) in documented, (path, status)
                assert documented[str(status)]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse"
                )
        not_allowed = c.get("/v1/completions", headers=auth)
        assert_openai_error(not_allowed, 405, text="Method GET is not allowed")
        assert not_allowed.headers["allow"] == "POST"


# ---- the event loop ------------------------------------------------------------------------------


class _BlockingTokenizer:
    """The engine's tokenizer, except that encoding "block me" waits until the test releases it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, text, *args, **kwargs):
        if text == "block me":
            self.entered.set()
            assert self.release.wait(60), "never released"
        return self._tokenizer(text, *args, **kwargs)


def test_tokenizing_does_not_block_the_event_loop(own_engine, monkeypatch):
    """While one request is being tokenized, /health and a streaming completion are served."""
    blocking = _BlockingTokenizer(own_engine.tokenizer)
    monkeypatch.setattr(own_engine, "tokenizer", blocking)
    results: dict[str, int] = {}
    with make_client(own_engine) as c:
        slow = threading.Thread(
            target=lambda: results.setdefault(
                "slow", c.post("/tokenize", json={"prompt": "block me"}).status_code
            )
        )
        slow.start()
        try:
            assert blocking.entered.wait(60)
            served = threading.Thread(
                target=lambda: results.setdefault("health", c.get("/health").status_code)
            )
            served.start()
            served.join(30)  # on a blocked event loop this never returns
            assert results.get("health") == 200, "the event loop was blocked by tokenization"
            with c.stream(
                "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
            ) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
        finally:
            blocking.release.set()
            slow.join(60)
        assert results["slow"] == 200
    assert_engine_idle(own_engine)


# ---- API key ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        (None, {"VLLM_API_KEY": "v"}, ("v",)),
        (None, {"KVLLM_API_KEY": "k", "VLLM_API_KEY": "v"}, ("k",)),
        (["f"], {"KVLLM_API_KEY": "k", "VLLM_API_KEY": "v"}, ("f",)),
        (["f", "g"], {}, ("f", "g")),  # vLLM's --api-key takes several
        (None, {}, None),
    ],
)
def test_serve_reads_vllm_api_key_beside_kvllm_api_key(flag, environ, expected, monkeypatch):
    seen = {}
    monkeypatch.setattr("kvllm.entrypoints.openai.server.run_server", lambda *a, **kw: seen.update(kw) or 0)
    for name in ("KVLLM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    argv = ["serve", "--dtype", "float32"] + (["--api-key", *flag] if flag else [])
    assert main(argv) == 0
    assert seen["api_key"] == expected
    assert serve.resolve_api_key(flag, environ) == expected


def test_any_of_several_api_keys_is_accepted(own_engine):
    app = build_app(
        engine=own_engine, served_model_name="tiny", api_key=["key-a", "key-b"], log_stats_interval=0
    )
    with TestClient(app) as c:
        for key, status in (("key-a", 200), ("key-b", 200), ("key-c", 401), ("key-a key-b", 401)):
            response = c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status, (key, response.text)
        assert c.get("/v1/models").status_code == 401
    with pytest.raises(ValueError, match="empty key"):
        serve.resolve_api_key(["ok", ""], {})
