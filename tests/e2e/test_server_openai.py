"""`kvllm serve` as a real process on 127.0.0.1, driven by the `openai` client: correctness under load,
disconnects and bad input, with /metrics checked against the traffic sent.

`RemoteServer` is shared with test_server_shutdown.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvllm import LLM, SamplingParams

API_KEY = "sk-e2e"
MODEL_NAME = "tiny"
# 256 blocks of 16 tokens: room for 64 concurrent requests of ~40 tokens, and for 20 of ~160.
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 22)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """A `kvllm serve` subprocess on 127.0.0.1 and a free port; its log goes to a file.

    `prelude` is Python run in the server process before `kvllm serve` starts (to inject faults);
    `api_server_module` starts it as vLLM deployments do, `python -m ...api_server --model M`.
    """

    def __init__(
        self,
        model: Path,
        *flags: str,
        startup_timeout: float = 180.0,
        prelude: str | None = None,
        api_server_module: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="kvllm-serve-", suffix=".log")[1])
        if api_server_module:
            launcher = ["-m", "kvllm.entrypoints.openai.api_server", "--model"]
        elif prelude is None:
            launcher = ["-m", "kvllm.entrypoints.cli.main", "serve"]
        else:
            main = "import sys\nfrom kvllm.entrypoints.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
            launcher = ["-c", f"{prelude}\n{main}", "serve"]
        cmd = [
            sys.executable,
            *launcher,
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
            *flags,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvllm serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(
            f"kvllm serve did not become healthy in {startup_timeout} s:\n{self.log()[-3000:]}"
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """`vllm:` series as {"name{labels}": value}, labels as the server prints them."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        series = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                key, value = line.rsplit(" ", 1)
                series[key] = float(value)
        return series

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def series(name: str, **labels: str) -> str:
    labels = {**labels, "model_name": MODEL_NAME, "engine": "0"}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


RUNNING = series("vllm:num_requests_running")
KV_USAGE = series("vllm:kv_cache_usage_perc")


def wait_until_idle(server: RemoteServer, timeout: float = 10.0) -> dict[str, float]:
    """Metrics once no request runs and no KV block is in use (the gauges follow each engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if (
            metrics[RUNNING] == 0
            and metrics[KV_USAGE] == 0
            and metrics[series("vllm:num_requests_waiting")] == 0
        ):
            return metrics
        assert time.monotonic() < deadline, (
            f"server not idle after {timeout} s: running={metrics[RUNNING]}, kv usage={metrics[KV_USAGE]}"
        )
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_qwen3_path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_qwen3_path, "--log-stats-interval", "1")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path) -> LLM:
    return LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)


PROMPTS = ["The capital of France is", "Once upon a time, there was"]


def test_greedy_completions_and_chat_equal_llm_generate(server, llm):
    client = server.client()
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    for choice, ref in zip(result.choices, expected, strict=True):
        assert choice.token_ids == ref.outputs[0].token_ids
        assert choice.prompt_token_ids == ref.prompt_token_ids
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
    assert result.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in expected)
    assert result.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)

    messages = [{"role": "user", "content": "What is the capital of Germany?"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].token_ids == ref.outputs[0].token_ids
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_equals_non_streamed_with_n_and_logprobs(server):
    client = server.client()
    kwargs = dict(
        model=MODEL_NAME,
        prompt=PROMPTS,
        max_tokens=10,
        temperature=0,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert len(full.choices) == 4 and full.usage.completion_tokens == 40
    texts, tokens, finish = {}, {}, {}
    usage = None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert texts == {c.index: c.text for c in full.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in full.choices}
    assert finish == {c.index: "length" for c in full.choices}
    assert usage.completion_tokens == 40 and usage.prompt_tokens == full.usage.prompt_tokens

    messages = [{"role": "user", "content": "Tell me a story."}]
    kwargs = dict(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    full = client.chat.completions.create(**kwargs)
    texts, logprob_tokens, usage = {}, {}, None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            logprob_tokens.setdefault(c.index, []).extend(
                x.token for x in (c.logprobs.content if c.logprobs else [])
            )
    assert texts == {c.index: c.message.content for c in full.choices}
    assert logprob_tokens == {c.index: [x.token for x in c.logprobs.content] for c in full.choices}
    assert all(len(x.top_logprobs) == 3 for c in full.choices for x in c.logprobs.content)
    assert usage.completion_tokens == full.usage.completion_tokens


def test_64_concurrent_streams_complete_and_free_every_block(server):
    num_tokens = 24

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Request {i}: the quick brown fox",
            max_tokens=num_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        streamed, usage, reason = 0, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                streamed += len(c.token_ids or [])
                reason = c.finish_reason or reason
        return streamed, usage.completion_tokens, reason

    async def main() -> list[tuple[int, int, str | None]]:
        async with server.async_client() as client:
            return await asyncio.wait_for(asyncio.gather(*[one(client, i) for i in range(64)]), 120)

    results = asyncio.run(main())
    assert results == [(num_tokens, num_tokens, "length")] * 64
    wait_until_idle(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.fixture(scope="module")
def long_server(tiny_qwen3_path) -> Iterator[RemoteServer]:
    """Room for 2000-token requests, which no machine finishes before its client can leave."""
    srv = RemoteServer(
        tiny_qwen3_path,
        *("--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 25), "--log-stats-interval", "0"),
    )
    try:
        yield srv
    finally:
        srv.stop()


LONG = 2000  # tokens: thousands of engine steps, against the milliseconds a disconnect takes


def open_raw_completion(server: RemoteServer, body: dict) -> socket.socket:
    """A non-streaming completion sent on a raw connection that nobody reads."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head.encode() + payload)
    return sock


def wait_for_metric(server: RemoteServer, name: str, value: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (current := server.metrics()[name]) != value:
        assert time.monotonic() < deadline, f"{name} is {current}, not {value}, after {timeout} s"
        time.sleep(0.02)


def test_disconnecting_clients_are_aborted_and_free_their_blocks(long_server):
    server = long_server
    before = wait_until_idle(server)
    aborted = series("vllm:request_success_total", finished_reason="abort")

    async def disconnect_after_first_token(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Client {i} says", "max_tokens": LONG, "stream": True}
        async with client.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    break  # leaving the block closes the connection mid-stream

    async def concurrent() -> None:
        await asyncio.wait_for(
            asyncio.gather(*[_own_client(server, disconnect_after_first_token, i) for i in range(20)]), 120
        )

    asyncio.run(concurrent())
    wait_until_idle(server, timeout=60)
    # Non-streaming clients that give up: once the server runs both, their connections close.
    sockets = [
        open_raw_completion(
            server, {"model": MODEL_NAME, "prompt": f"Impatient {i}", "max_tokens": LONG, "ignore_eos": True}
        )
        for i in range(2)
    ]
    wait_for_metric(server, RUNNING, 2)
    for sock in sockets:
        sock.close()
    after = wait_until_idle(server, timeout=60)
    assert after[aborted] - before[aborted] == 22
    # One INFO line per disconnect, and no traceback.
    deadline = time.monotonic() + 30
    while server.log().count("Client disconnected") < 22 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log()
    assert log.count("Client disconnected") == 22 and "Traceback" not in log and "ERROR" not in log
    assert httpx.get(f"{server.url}/health").status_code == 200
    out = server.client().completions.create(
        model=MODEL_NAME, prompt="still serving", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4


async def _own_client(server: RemoteServer, fn, i: int) -> None:
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        await fn(client, i)


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server):
    client = server.client()
    too_long = "The quick brown fox jumps over the lazy dog. " * 40
    cases = [
        (
            openai.BadRequestError,
            "maximum context length is 256",
            dict(model=MODEL_NAME, prompt=too_long, max_tokens=4),
        ),
        (
            openai.BadRequestError,
            "you requested 1002 tokens (2 in the prompt, 1000 in the completion)",
            dict(model=MODEL_NAME, prompt="Hi", max_tokens=1000),
        ),
        (openai.BadRequestError, "temperature", dict(model=MODEL_NAME, prompt="Hi", temperature=-1.0)),
        (openai.BadRequestError, "top_p", dict(model=MODEL_NAME, prompt="Hi", top_p=1.5)),
        (openai.NotFoundError, "does not exist", dict(model="gpt-5", prompt="Hi")),
    ]
    for error, text, kwargs in cases:
        with pytest.raises(error) as info:
            client.completions.create(**kwargs)
        body = info.value.body
        assert text in body["message"] and body["code"] == info.value.status_code
        assert set(body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=300
        )
    with pytest.raises(openai.AuthenticationError):
        server.client(default_headers={"Authorization": "Bearer wrong"}).models.list()
    # A generative model has no embeddings (vLLM mounts no /v1/embeddings for it).
    with pytest.raises(openai.NotFoundError, match="does not support the Embeddings API"):
        client.embeddings.create(model=MODEL_NAME, input="hi")
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for content, status in [
        ("{oops", 400),
        ('{"model": "tiny", "prompt": "x", "n": "two"}', 400),
        ('{"model": "tiny", "prompt": 12.5}', 400),
        ("[1, 2]", 400),
    ]:
        response = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers)
        assert response.status_code == status and set(response.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    assert httpx.get(f"{server.url}/v1/nope", headers=headers).status_code == 404
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=2).usage.completion_tokens >= 1
    wait_until_idle(server)


def test_metrics_counters_equal_the_traffic(server):
    before = wait_until_idle(server)
    client = server.client()
    prompt_tokens = completion_tokens = 0
    for i in range(3):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=f"count {i} " * (i + 1),
            max_tokens=5 + i,
            n=2,
            extra_body={"ignore_eos": True},
        )
        prompt_tokens += out.usage.prompt_tokens
        completion_tokens += out.usage.completion_tokens
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    prompt_tokens += out.usage.prompt_tokens
    completion_tokens += out.usage.completion_tokens
    usage = None
    for chunk in client.completions.create(
        model=MODEL_NAME,
        prompt="stream me",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        usage = chunk.usage or usage
    prompt_tokens += usage.prompt_tokens
    completion_tokens += usage.completion_tokens
    after = wait_until_idle(server)

    def delta(name: str, **labels: str) -> float:
        return after[series(name, **labels)] - before[series(name, **labels)]

    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == completion_tokens == 2 * (5 + 6 + 7) + 7 + 6
    assert delta("vllm:request_success_total", finished_reason="length") == 3 * 2 + 1 + 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:e2e_request_latency_seconds_count") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 5
    assert delta("vllm:request_generation_tokens_sum") == completion_tokens
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_params_n_sum") == 3 * 2 + 1 + 1
    for interval in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{interval}_time_seconds_count") == 5
    assert delta("vllm:prefix_cache_queries_total") > 0


def test_models_and_startup_log_lines(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    deadline = time.monotonic() + 5
    while "Avg prompt throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log()
    assert f"Starting kvllm API server on http://127.0.0.1:{server.port}" in log
    assert f"as '{MODEL_NAME}'" in log and "KV cache:" in log
    assert "Avg prompt throughput:" in log and "Prefix cache hit rate:" in log
