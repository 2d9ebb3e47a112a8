"""`python -m kvllm.entrypoints.openai.api_server` (vLLM's module entry point) as a real process,
driven by the `openai` client's Responses API, with the SageMaker and cache routes beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_server_openai import API_KEY, ENGINE_FLAGS, MODEL_NAME, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class ApiServerModule:
    """The server started as vLLM deployments start theirs: `python -m ...api_server --model M`."""

    def __init__(self, model: Path, startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="kvllm-api-server-", suffix=".log")[1])
        cmd = [
            sys.executable,
            "-m",
            "kvllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL_NAME,
            "--api-key",
            API_KEY,
            "--disable-uvicorn-access-log",
            *ENGINE_FLAGS,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"api_server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ping", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"api_server did not answer /ping in {startup_timeout} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_qwen3_path) -> Iterator[ApiServerModule]:
    srv = ApiServerModule(tiny_qwen3_path)
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
