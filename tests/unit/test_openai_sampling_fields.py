"""vLLM's request fields on /v1/completions and /v1/chat/completions: logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens, prompt_logprobs, chat echo, continuous_usage_stats, vllm_xargs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.engine.input_processor import bad_words_token_ids
from kvllm.engine.llm_engine import LLMEngine
from tests.unit.attention_fixtures import kvllm_logs  # noqa: F401
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
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with tiny_client(engine) as c:
        yield c


def completion(client, **fields) -> dict:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    response = post(client, "/v1/completions", {**body, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, **fields) -> dict:
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    response = post(client, "/v1/chat/completions", {**body, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_logit_bias_allowed_token_ids_and_bad_words_shape_the_output(client, engine, endpoint):
    call = completion if endpoint == "completion" else chat
    choices = call(client, temperature=1.0, n=2, logit_bias={"123": 100})["choices"]
    assert all(c["token_ids"] == [123] * 8 for c in choices)
    allowed = [17, 58, 101, 230]
    choices = call(client, temperature=1.5, n=3, allowed_token_ids=allowed)["choices"]
    assert all(set(c["token_ids"]) <= set(allowed) for c in choices)
    plain = call(client, temperature=0)["choices"][0]["token_ids"]
    # A word the greedy reply says as one token (some tokens are parts of a UTF-8 character).
    tokenizer = engine.tokenizer
    word = None
    for t in plain:
        w = tokenizer.decode([t])
        if w.strip() and [t] in bad_words_token_ids(tokenizer, [w]):
            word = w
            break
    assert word is not None, plain
    banned = bad_words_token_ids(tokenizer, [word])
    tokens = call(client, temperature=0, bad_words=[word])["choices"][0]["token_ids"]
    assert tokens != plain
    assert not any(tokens[i : i + len(s)] == s for s in banned for i in range(len(tokens)))
    assert_engine_idle(engine)


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"logit_bias": {"5": 101}}, "logit_bias", "-100 to 100"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "'five'"),
        ({"logit_bias": {"512": 1}}, "logit_bias", "< 512"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", ">= 0"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [5, 450]}, "allowed_token_ids", "< 400"),
        ({"bad_words": [""]}, "bad_words", "empty"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ({"truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "max_model_len (128)"),
        ({"truncation_side": "right"}, "truncation_side", "truncate_prompt_tokens"),
        ({"prompt_logprobs": 30}, "prompt_logprobs", "0 to 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "0 to 20"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
        ({"vllm_xargs": 3}, "vllm_xargs", None),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_a_400_naming_the_field(client, engine, endpoint, fields, param, text):
    body = {"model": "tiny", "max_tokens": 4, **fields}
    body.update({"prompt": "hello"} if endpoint == "/v1/completions" else {"messages": USER})
    assert_openai_error(post(client, endpoint, body), 400, param, text)
    assert_engine_idle(engine)


def test_truncate_prompt_tokens(client, engine):
    ids = list(range(5, 205))  # longer than the context: refused unless truncated
    assert_openai_error(post(client, "/v1/completions", {"model": "tiny", "prompt": ids}), 400, "prompt")
    left = completion(client, prompt=ids, truncate_prompt_tokens=20, temperature=0)["choices"][0]
    assert left["prompt_token_ids"] == ids[-20:]
    same = completion(client, prompt=ids[-20:], temperature=0)["choices"][0]
    assert left["token_ids"] == same["token_ids"]
    right = completion(client, prompt=ids, truncate_prompt_tokens=20, truncation_side="right")["choices"][0]
    assert right["prompt_token_ids"] == ids[:20]
    # Echoed text is the prompt the model saw.
    tokenizer = engine.tokenizer
    text = "the cat sat on the mat " * 4
    echo = completion(client, prompt=text, truncate_prompt_tokens=5, echo=True, max_tokens=1)["choices"][0]
    kept = tokenizer(text).input_ids[-5:]
    assert echo["prompt_token_ids"] == kept and echo["text"].startswith(tokenizer.decode(kept))
    usage = chat(client, truncate_prompt_tokens=3)["usage"]
    assert usage["prompt_tokens"] == 3
    assert_engine_idle(engine)


def test_prompt_logprobs(client, engine):
    result = completion(client, prompt=[5, 6, 7, 8], prompt_logprobs=2, max_tokens=2)
    positions = result["choices"][0]["prompt_logprobs"]
    assert len(positions) == 4 and positions[0] is None
    for token, entry in zip([6, 7, 8], positions[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(token)])
    reply = chat(client, prompt_logprobs=1, max_tokens=2)
    num_prompt = reply["usage"]["prompt_tokens"]
    assert len(reply["prompt_logprobs"]) == num_prompt and reply["prompt_logprobs"][0] is None
    assert all(1 <= len(e) <= 2 for e in reply["prompt_logprobs"][1:])
    assert chat(client)["prompt_logprobs"] is None
    assert_engine_idle(engine)


def test_chat_echo_prefixes_the_last_message_of_the_reply_role(client, engine):
    draft = [*USER, {"role": "assistant", "content": "Once upon"}]
    plain = chat(client, messages=draft, temperature=0, add_generation_prompt=False)["choices"][0]
    echoed = chat(client, messages=draft, temperature=0, add_generation_prompt=False, echo=True)["choices"][0]
    assert echoed["message"]["content"] == "Once upon" + plain["message"]["content"]
    assert echoed["token_ids"] == plain["token_ids"]
    # With a generation prompt the reply is the assistant's: a last user message is not echoed.
    assert (
        chat(client, temperature=0, echo=True)["choices"][0]["message"]["content"]
        == (chat(client, temperature=0)["choices"][0]["message"]["content"])
    )
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": draft,
            "add_generation_prompt": False,
            "echo": True,
            "stream": True,
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0,
        },
        headers=AUTH,
    ) as response:
        events = sse_events(response)
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text == echoed["message"]["content"]
    assert_engine_idle(engine)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_on_every_chunk(client, engine, endpoint):
    body = {"model": "tiny", "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
    body.update({"prompt": "hello"} if endpoint == "/v1/completions" else {"messages": USER})

    def stream(options: dict) -> list:
        with client.stream(
            "POST", endpoint, json={**body, "stream_options": options}, headers=AUTH
        ) as response:
            return sse_events(response)[:-1]

    events = stream({"include_usage": True, "continuous_usage_stats": True})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert chunks and all(e["usage"] is not None for e in chunks)
    prompt_tokens = final["usage"]["prompt_tokens"]
    completion_tokens = [e["usage"]["completion_tokens"] for e in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 6
    for e in chunks:
        usage = e["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
    # Without it (or without include_usage, as in vLLM) only the last chunk carries usage.
    assert all(e["usage"] is None for e in stream({"include_usage": True})[:-1])
    assert all(e["usage"] is None for e in stream({"continuous_usage_stats": True}))
    assert_engine_idle(engine)


def test_vllm_xargs_reach_extra_args(client, engine, monkeypatch):
    seen = []
    add = engine.add_request

    def spy(request_id, prompt, params=None, *args, **kwargs):
        seen.append(params)
        return add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    completion(client, vllm_xargs={"my_processor": 3}, max_tokens=2)
    assert seen and seen[0].extra_args == {"my_processor": 3}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prompt_embeds", "AAAA"),
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("thinking_token_budget", 64),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_vllm_fields_are_refused_unless_default(client, engine, endpoint, name, value):
    body = {"model": "tiny", "max_tokens": 2}
    body.update({"prompt": "hello"} if endpoint == "/v1/completions" else {"messages": USER})
    assert_openai_error(post(client, endpoint, {**body, name: value}), 400, name, "not supported")
    default = {"prompt_embeds": None, "kv_transfer_params": None, "thinking_token_budget": None}[name]
    assert post(client, endpoint, {**body, name: default, "some_client_field": 1}).status_code == 200
    assert_engine_idle(engine)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("/v1/embeddings", {"input": "hello"}),
        ("/v1/responses", {"input": "hello", "max_output_tokens": 2}),
        ("/tokenize", {"prompt": "hello"}),
        ("/detokenize", {"tokens": [1, 2]}),
    ],
)
def test_unknown_request_fields_are_ignored_with_a_warning_naming_them(
    client,
    engine,
    kvllm_logs,  # noqa: F811 (the fixture)
    endpoint,
    body,
):
    """As vLLM logs them: a misspelt field (max_token) is named in a warning, never dropped silently;
    a request with only known fields (and vLLM's refusable ones at their defaults) warns about nothing."""
    body = {"model": "tiny", **body}
    kvllm_logs.clear()
    post(client, endpoint, {**body, "priority": 0} if endpoint.startswith("/v1/c") else body)
    assert not [r for r in kvllm_logs.records if "ignored" in r.getMessage()]
    post(client, endpoint, {**body, "max_token": 5, "frobnicate": {"a": 1}})
    warnings = [
        r.getMessage() for r in kvllm_logs.records if r.levelname == "WARNING" and "ignored" in r.getMessage()
    ]
    assert warnings == [
        "The following fields were present in the request but ignored: ['frobnicate', 'max_token']"
    ]
    assert_engine_idle(engine)


def test_return_tokens_as_token_ids_names_the_ids(client):
    """vLLM's return_tokens_as_token_ids: every logprob token, sampled and top-k, as "token_id:N" for the
    ids the response also returns; the same request without it shows text."""
    plain = completion(client, temperature=0, logprobs=2)["choices"][0]
    as_ids = completion(client, temperature=0, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]
    assert as_ids["token_ids"] == plain["token_ids"]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in as_ids["token_ids"]]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top, sampled in zip(as_ids["logprobs"]["top_logprobs"], as_ids["token_ids"]):
        assert f"token_id:{sampled}" in top and all(k.startswith("token_id:") for k in top)
    assert not any(t.startswith("token_id:") for t in plain["logprobs"]["tokens"])

    echoed = completion(
        client, prompt=[5, 6, 7], echo=True, max_tokens=2, logprobs=1, return_tokens_as_token_ids=True
    )
    assert echoed["choices"][0]["logprobs"]["tokens"][:3] == ["token_id:5", "token_id:6", "token_id:7"]

    c = chat(client, temperature=0, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)[
        "choices"
    ][0]
    content = c["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    assert all(
        len(entry["top_logprobs"]) == 2
        and all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
        for entry in content
    )
