"""`kvllm bench serve` against a stub OpenAI-compatible streaming server, and a real `kvllm serve`."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvllm.entrypoints.cli.main import main

STUB_MODEL = "stub-model"
TOKEN_DELAY_S = 0.002


class _StubHandler(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-word chunks, then a usage chunk and [DONE] (OpenAI's SSE format)."""

    received: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
            return
        self._send_json({"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append(body)
        if self.path not in ("/v1/completions", "/v1/chat/completions") or body.get("model") != STUB_MODEL:
            self.send_error(404)
            return
        chat = self.path.endswith("chat/completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        for i in range(body["max_tokens"]):
            time.sleep(TOKEN_DELAY_S)
            choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
            self._event({"id": "x", "choices": [choice]})
        usage = {"prompt_tokens": num_prompt, "completion_tokens": body["max_tokens"]}
        self._event({"id": "x", "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _send_json(self, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SERVE_FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "ttfts",
    "itls",
    "input_lens",
    "output_lens",
    "env",
)


def _check_serve_result(path: Path, num_prompts: int, output_len: int) -> dict:
    result = json.loads(path.read_text())
    for name in SERVE_FIELDS:
        assert name in result, name
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["output_lens"] == [output_len] * num_prompts
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    assert all(len(itl) == output_len - 1 for itl in result["itls"])
    assert result["request_throughput"] > 0
    return result


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_stub(stub_url, tmp_path, capsys, endpoint):
    _StubHandler.received.clear()
    argv = [
        "bench",
        "serve",
        "--base-url",
        stub_url,
        "--endpoint",
        endpoint,
        "--model",
        STUB_MODEL,
        "--num-prompts",
        "6",
        "--random-input-len",
        "12",
        "--random-output-len",
        "5",
        "--request-rate",
        "200",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "serve.json",
        "--metric-percentiles",
        "50,99",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    for line in (
        "Successful requests:",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "Mean E2EL (ms):",
        "Output token throughput (tok/s):",
    ):
        assert line in out
    result = _check_serve_result(tmp_path / "serve.json", num_prompts=6, output_len=5)
    assert "p50_ttft_ms" in result
    # No tokenizer for a model name that is not a folder: prompts go as token ids of the asked length.
    bodies = [b for b in _StubHandler.received if b["max_tokens"] == 5]
    assert len(bodies) == 6 and all(b["stream"] and b["ignore_eos"] for b in bodies)
    prompts = [b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in bodies]
    assert all(isinstance(p, list) and len(p) == 12 for p in prompts)


def test_bench_serve_asks_the_server_for_its_model(stub_url, tmp_path):
    argv = [
        "bench",
        "serve",
        "--base-url",
        stub_url,
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--random-output-len",
        "3",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "r.json",
    ]
    assert main(argv) == 0
    assert json.loads((tmp_path / "r.json").read_text())["model_id"] == STUB_MODEL


def test_bench_serve_unreachable_server_is_a_clear_error(capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1"]
    assert main(argv) == 2
    assert "first test request" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("kvllm.entrypoints.cli.serve") is None,
    reason="this build has no `kvllm serve` yet",
)
def test_bench_serve_launches_a_real_kvllm_server(tiny_qwen3_path, tmp_path):
    argv = [
        "bench",
        "serve",
        str(tiny_qwen3_path),
        "--launch-server",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        str(1 << 22),
        "--attention-backend",
        "CPU_ATTN",
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--ignore-eos",
        "--max-concurrency",
        "2",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "real.json",
    ]
    assert main(argv) == 0
    result = json.loads((tmp_path / "real.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 16
