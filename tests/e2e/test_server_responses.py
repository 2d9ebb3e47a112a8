"""`python -m kvllm.entrypoints.openai.api_server` (vLLM's module entry point) as a real process,
driven by the `openai` client's Responses API, with the SageMaker and cache routes beside it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.test_server_openai import API_KEY, MODEL_NAME, RemoteServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_qwen3_path) -> Iterator[RemoteServer]:
    """The server started as vLLM deployments start theirs: `python -m ...api_server --model M`."""
    srv = RemoteServer(tiny_qwen3_path, api_server_module=True)
    try:
        yield srv
    finally:
        srv.stop()


MESSAGES = [
    {"role": "system", "content": "Be brief"},
    {"role": "user", "content": "What is the capital of Italy?"},
]


def test_responses_create_equals_chat_completion(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    response = client.responses.create(
        model=MODEL_NAME,
        instructions="Be brief",
        input=MESSAGES[1]["content"],
        max_output_tokens=10,
        temperature=0,
    )
    assert response.object == "response" and response.model == MODEL_NAME
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected_status
    # The same conversation as input items.
    items = client.responses.create(model=MODEL_NAME, input=MESSAGES, max_output_tokens=10, temperature=0)
    assert items.output_text == response.output_text


def test_streamed_responses_equal_the_non_streamed_one(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, input="Once upon a time", max_output_tokens=12, temperature=0, top_p=1.0)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text
    assert events[-1].response.output_text == full.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_unsupported_response_fields_are_400s(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="tools are not supported"):
        client.responses.create(
            model=MODEL_NAME,
            input="hi",
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
        )
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_123")
    assert client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2).output_text is not None


def test_sagemaker_and_cache_routes(server):
    assert httpx.post(f"{server.url}/ping").status_code == 200
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/invocations", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(f"{server.url}/invocations", json={"messages": MESSAGES, "max_tokens": 4}, headers=AUTH)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).status_code == 200
    assert "with no API key" not in server.log()
