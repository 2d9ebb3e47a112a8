"""SIGTERM during traffic: `kvllm serve` stops taking requests, lets short ones finish, aborts the rest
(they end with finish_reason "abort"), and exits with 0 within SHUTDOWN_BOUND seconds."""

from __future__ import annotations

import signal
import threading
import time

import httpx

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
