"""SIGTERM during traffic: `kvllm serve` stops taking requests, lets short ones finish, aborts the rest
(they end with finish_reason "abort"), and exits with 0 within SHUTDOWN_BOUND seconds. An engine fault:
in-flight requests get an error, /health turns 503, and the process exits with code 1."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

from tests.e2e.test_server_openai import API_KEY, MODEL_NAME, RemoteServer

GRACE = 1.0  # --shutdown-timeout
# The stated bound: grace + 2 s for aborted streams to flush + 3 s of uvicorn's own graceful close
# + interpreter exit (torch teardown), with slack for a loaded CI machine.
SHUTDOWN_BOUND = 15.0
LONG = 2000  # max_tokens of the requests that must be aborted


def test_sigterm_during_traffic_drains_and_exits(tiny_qwen3_path):
    # Long requests of 2000 tokens cannot finish within the grace period on any machine (one step per token).
    server = RemoteServer(
        tiny_qwen3_path,
        *("--shutdown-timeout", str(GRACE), "--log-stats-interval", "0"),
        *("--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 24)),
    )
    try:
        client = server.client()
        results: dict[str, object] = {}

        def stream(name: str, max_tokens: int) -> None:
            try:
                reason = None
                for chunk in client.completions.create(
                    model=MODEL_NAME,
                    prompt=f"{name} goes",
                    max_tokens=max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    reason = chunk.choices[0].finish_reason or reason if chunk.choices else reason
                results[name] = reason
            except Exception as exc:  # recorded, so the assertion below shows it
                results[name] = repr(exc)

        def complete(name: str, max_tokens: int) -> None:
            try:
                out = client.completions.create(
                    model=MODEL_NAME,
                    prompt=f"{name} goes",
                    max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                )
                results[name] = out.choices[0].finish_reason
            except Exception as exc:
                results[name] = repr(exc)

        jobs = [(stream, f"short-stream-{i}", 4) for i in range(4)]
        jobs += [(stream, f"long-stream-{i}", LONG) for i in range(4)]
        jobs += [(complete, "short-full", 4), (complete, "long-full", LONG)]
        threads = [threading.Thread(target=fn, args=(name, n)) for fn, name, n in jobs]
        for t in threads:
            t.start()
        time.sleep(0.5)  # all requests are in flight; the short ones are done or nearly
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:
            late = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "late"},
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=10,
            )
            assert late.status_code == 503 and late.json()["error"]["code"] == 503
        except httpx.ConnectError:
            pass  # already closed: also a refusal
        for t in threads:
            t.join(SHUTDOWN_BOUND)
        returncode = server.proc.wait(SHUTDOWN_BOUND)
        elapsed = time.monotonic() - signalled
    finally:
        server.stop()
    print(f"exited {elapsed:.1f} s after SIGTERM (bound {SHUTDOWN_BOUND} s)")
    assert returncode == 0, server.log()[-3000:]
    assert elapsed < SHUTDOWN_BOUND
    assert not any(t.is_alive() for t in threads)
    assert results == {name: ("length" if name.startswith("short") else "abort") for _, name, _ in jobs}, (
        server.log()[-3000:]
    )
    log = server.log()
    assert "Received SIGTERM" in log and "Aborting 5 request(s)" in log


# Makes the engine step raise once a request with this prompt is running.
FAULT_PROMPT = "inject an engine fault"
FAULTY_STEP = f"""
from kvllm.engine.llm_engine import LLMEngine
_step = LLMEngine.step
def _faulty_step(self):
    if any(parent.prompt == {FAULT_PROMPT!r} for parent in self.output_processor.parents.values()):
        raise RuntimeError("injected engine fault")
    return _step(self)
LLMEngine.step = _faulty_step
"""


def hold_a_request_in_flight(server: RemoteServer) -> socket.socket:
    """A request whose body never completes, so it stays in flight until the socket closes.

    uvicorn runs the app for a request once its headers are parsed; a request sent after it on
    another connection and answered shows the server has taken it.
    """
    holder = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    holder.sendall(
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    assert httpx.get(f"{server.url}/version", timeout=10).status_code == 200
    return holder


def stream_until_done(server: RemoteServer, prompt: str) -> list[str]:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 50, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("keep_alive", [False, True])
def test_an_engine_fault_fails_requests_turns_health_503_and_exits_non_zero(tiny_qwen3_path, keep_alive):
    flags = ["--shutdown-timeout", "60", "--log-stats-interval", "0"]
    if keep_alive:
        flags.append("--keep-alive-on-engine-death")
    server = RemoteServer(tiny_qwen3_path, *flags, prelude=FAULTY_STEP)
    holder = None
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        holder = hold_a_request_in_flight(server)
        events = stream_until_done(server, FAULT_PROMPT)
        assert events[-1] == "data: [DONE]" and "injected engine fault" in events[-2]
        assert '"code":500' in events[-2].replace(" ", "")
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "injected engine fault" in health.json()["error"]["message"]
        late = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "after the fault"},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=10,
        )
        assert late.status_code == 503
        assert server.proc.poll() is None  # still up while a request is in flight
        holder.close()
        if keep_alive:  # up until told to stop, and then still not a clean exit
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
            server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(SHUTDOWN_BOUND) == 1, server.log()[-3000:]
        assert "Server stopped after its engine failed: exit code 1" in server.log()
    finally:
        if holder is not None:
            holder.close()
        server.stop()
