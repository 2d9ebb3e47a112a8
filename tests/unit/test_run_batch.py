"""`kvllm run-batch`: OpenAI Batch API files answered through the server's routes, with the tiny model."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.cli.main import main
from kvllm.entrypoints.openai import run_batch as batch
from kvllm.entrypoints.openai.server import build_app
from tests.unit.test_openai_server import tiny_engine

MAX_MODEL_LEN = 128


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
MIXED = [
    line("chat", "/v1/chat/completions", CHAT),
    line("completion", "/v1/completions", COMPLETION),
    line("bad-temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}),
    line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
    line("embeddings", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
    line("score", "/score", {"model": "tiny"}),
    line("responses", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
    line("wrong-model", "/v1/completions", {**COMPLETION, "model": "gpt-4"}),
]
EXPECTED_STATUS = {
    "chat": 200,
    "completion": 200,
    "bad-temperature": 400,
    "stream": 400,
    "embeddings": 404,  # a generate model: the server's own answer
    "score": 400,
    "responses": 200,
    "wrong-model": 404,
}


def engine_flags(path: Path) -> list[str]:
    return [
        "--model",
        str(path),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(1 << 21),
        "--served-model-name",
        "tiny",
        "--disable-progress-bar",
    ]


def read_lines(path: Path) -> list[dict]:
    return [json.loads(t) for t in path.read_text(encoding="utf-8").splitlines()]


# ---- the input file is checked before anything runs ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "line 1: not valid JSON"),
        ("[1, 2]", "line 1: a request must be a JSON object, not list"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {}}', "line 1: missing method"),
        (line("", "/v1/completions", {}), "line 1: custom_id must be a non-empty string"),
        (line("a", "/v1/completions", {}, method="GET"), "method 'GET' is not supported; allowed: POST"),
        ('{"custom_id": "a", "method": "POST", "url": 7, "body": {}}', "url must be a string"),
        (
            '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}',
            "body must be a JSON",
        ),
        (
            line("a", "/v1/completions", {}) + "\n\n" + line("a", "/v1/chat/completions", {}),
            "line 3: custom_id 'a' was already used on line 1",
        ),
        ("\n\n", "has no requests"),
    ],
)
def test_bad_batch_files_are_refused_with_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="nothing was run|has no requests") as err:
        batch.check_batch_file(path)
    assert message in str(err.value)


def test_every_bad_line_is_listed_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    good = line("ok", "/v1/completions", COMPLETION)
    path.write_text("\n".join([good] + ["{"] * (batch.MAX_LISTED_PROBLEMS + 3)), encoding="utf-8")
    with pytest.raises(ValueError) as err:
        batch.check_batch_file(path)
    text = str(err.value)
    assert f"{batch.MAX_LISTED_PROBLEMS + 3} bad line(s)" in text
    assert "line 2:" in text and f"line {batch.MAX_LISTED_PROBLEMS + 1}:" in text
    assert f"line {batch.MAX_LISTED_PROBLEMS + 2}:" not in text and "... and 3 more" in text


def test_a_bad_line_stops_the_command_before_the_model_loads(tmp_path: Path, capsys) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(line("a", "/v1/completions", COMPLETION) + "\n{oops\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc = main(["run-batch", "-i", str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "line 2: not valid JSON" in err and "no-such-model" not in err
    assert not out.exists()


def test_missing_input_and_output_folder_are_clear_errors(tmp_path: Path, capsys) -> None:
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    inp = tmp_path / "in.jsonl"
    inp.write_text(line("a", "/v1/completions", COMPLETION), encoding="utf-8")
    assert main(["run-batch", "-i", str(inp), "-o", str(inp)]) == 2
    assert "--output-file is the input file" in capsys.readouterr().err


def test_ordered_writer_keeps_input_order_whatever_order_answers_come_in() -> None:
    out = io.StringIO()
    writer = batch.OrderedWriter(out)
    for index in (2, 0, 3, 1, 5, 4):
        writer.add(index, str(index))
    assert out.getvalue().split() == ["0", "1", "2", "3", "4", "5"]
    assert not writer.waiting


# ---- end to end, with the tiny model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server_answers(tiny_qwen3_path) -> Iterator[dict[str, dict]]:
    """What `kvllm serve` answers for the same chat and completion bodies (greedy), for comparison."""
    app = build_app(
        engine=tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN), served_model_name="tiny", log_stats_interval=0
    )
    with TestClient(app) as client:
        yield {
            "chat": client.post("/v1/chat/completions", json=CHAT).json(),
            "completion": client.post("/v1/completions", json=COMPLETION).json(),
        }


def test_run_batch_answers_every_line_in_order_as_the_server_does(tiny_qwen3_path, tmp_path, server_answers):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(MIXED[:4]) + "\n\n" + "\n".join(MIXED[4:]) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *engine_flags(tiny_qwen3_path)]) == 0

    answers = read_lines(out)
    assert [a["custom_id"] for a in answers] == [json.loads(t)["custom_id"] for t in MIXED]
    assert len({a["id"] for a in answers}) == len(answers)
    for a in answers:
        status = a["response"]["status_code"]
        assert status == EXPECTED_STATUS[a["custom_id"]], a
        if status == 200:
            assert a["error"] is None and a["response"]["body"]["id"] == a["response"]["request_id"]
        else:
            assert a["response"]["body"] is None
            assert a["error"]["error"]["code"] == status and a["error"]["error"]["message"]
    by_id = {a["custom_id"]: a for a in answers}
    chat = by_id["chat"]["response"]["body"]
    assert chat["choices"][0]["message"] == server_answers["chat"]["choices"][0]["message"]
    assert chat["usage"] == server_answers["chat"]["usage"]
    completion = by_id["completion"]["response"]["body"]
    assert completion["choices"][0]["text"] == server_answers["completion"]["choices"][0]["text"]
    assert by_id["responses"]["response"]["body"]["object"] == "response"
    assert "temperature" in by_id["bad-temperature"]["error"]["error"]["message"]
    assert "stream" in by_id["stream"]["error"]["error"]["message"]
    assert "/v1/chat/completions" in by_id["score"]["error"]["error"]["message"]


def test_more_requests_than_slots_all_answered_in_order(tiny_qwen3_path, tmp_path) -> None:
    bodies = [{**COMPLETION, "prompt": f"Count {i}", "max_tokens": 1 + i % 5} for i in range(9)]
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "\n".join(line(f"r{i}", "/v1/completions", b) for i, b in enumerate(bodies)), encoding="utf-8"
    )
    out = tmp_path / "out.jsonl"
    flags = [*engine_flags(tiny_qwen3_path), "--max-concurrent-requests", "2"]
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    answers = read_lines(out)
    assert [a["custom_id"] for a in answers] == [f"r{i}" for i in range(9)]
    for i, a in enumerate(answers):
        assert a["response"]["body"]["usage"]["completion_tokens"] == 1 + i % 5


def run_three_completions(engine: LLMEngine, max_in_flight: int) -> tuple[batch.BatchSummary, list[dict]]:
    """Three completion requests r0..r2 answered by a server app over `engine`: the summary and the lines."""
    app = build_app(engine=engine, served_model_name="tiny", log_stats_interval=0)
    requests = [batch.parse_line(i + 1, line(f"r{i}", "/v1/completions", COMPLETION)) for i in range(3)]
    out = io.StringIO()

    async def run() -> batch.BatchSummary:
        async with app.router.lifespan_context(app):
            return await batch.run_requests(app, iter(requests), batch.OrderedWriter(out), max_in_flight)

    summary = asyncio.run(run())
    return summary, [json.loads(t) for t in out.getvalue().splitlines()]


def test_engine_failure_mid_batch_answers_the_rest_and_is_reported(tiny_qwen3_path, monkeypatch) -> None:
    engine = tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)

    def crash() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(engine, "step", crash)
    summary, answers = run_three_completions(engine, max_in_flight=1)
    assert summary.engine_failed and summary.total == 3 and summary.succeeded == 0
    assert [a["custom_id"] for a in answers] == ["r0", "r1", "r2"]
    assert all(a["response"]["status_code"] in (500, 503) and a["error"]["error"]["message"] for a in answers)


class _FileHost(BaseHTTPRequestHandler):
    """GET serves `files`, PUT stores into it; the first `fail_puts` PUTs answer 500."""

    files: dict[str, bytes] = {}
    fail_puts = 0

    def do_GET(self) -> None:  # noqa: N802
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).fail_puts > 0:
            type(self).fail_puts -= 1
            self.send_response(500)
        else:
            self.files[self.path] = body
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def file_host() -> Iterator[str]:
    _FileHost.files = {}
    _FileHost.fail_puts = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FileHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_input_and_output_urls(tiny_qwen3_path, tmp_path, file_host, monkeypatch) -> None:
    _FileHost.files["/in.jsonl"] = (MIXED[0] + "\n" + MIXED[1] + "\n").encode()
    _FileHost.fail_puts = 1  # the upload is retried
    monkeypatch.setattr(batch.time, "sleep", lambda s: None)
    flags = [*engine_flags(tiny_qwen3_path), "--output-tmp-dir", str(tmp_path)]
    assert main(["run-batch", "-i", f"{file_host}/in.jsonl", "-o", f"{file_host}/out.jsonl", *flags]) == 0
    answers = [json.loads(t) for t in _FileHost.files["/out.jsonl"].decode().splitlines()]
    assert [(a["custom_id"], a["response"]["status_code"]) for a in answers] == [
        ("chat", 200),
        ("completion", 200),
    ]
    assert list(tmp_path.iterdir()) == []  # the local copy is removed after the upload


def test_unreachable_input_url_is_a_clear_error(file_host, tmp_path, capsys) -> None:
    assert main(["run-batch", "-i", f"{file_host}/missing.jsonl", "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "missing.jsonl: could not be downloaded" in capsys.readouterr().err


def test_a_request_failing_in_the_runner_gets_its_error_line(tiny_qwen3_path, monkeypatch) -> None:
    real_answer = batch.answer

    async def flaky(client, request):
        if request.custom_id == "r1":
            raise ConnectionError("transport broke")
        return await real_answer(client, request)

    monkeypatch.setattr(batch, "answer", flaky)
    summary, answers = run_three_completions(tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN), max_in_flight=2)
    assert [(a["custom_id"], a["response"]["status_code"]) for a in answers] == [
        ("r0", 200),
        ("r1", 500),
        ("r2", 200),
    ]
    assert "transport broke" in answers[1]["error"]["error"]["message"]
    assert summary.statuses == {200: 2, 500: 1} and not summary.engine_failed
