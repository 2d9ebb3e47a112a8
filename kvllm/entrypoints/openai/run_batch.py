"""`kvllm run-batch`: an OpenAI Batch API file (JSONL) answered by the server's own routes, in-process.

Each input line is one request, as OpenAI's Batch API and vLLM's run-batch take it:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Each output line, in input order, is the answer, in vLLM's shape:

    {"id": "batch_req-...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

and for a request the server refused, `response.body` null and `error` the server's error JSON (its
`response.status_code` the HTTP status the server answered with).

The bodies go through the FastAPI app `kvllm serve` builds (httpx's in-process ASGI transport, no socket),
so a batch request is validated, served and refused exactly as the same request sent to the server.
Every line is checked before the model loads: a line that is not a request object (bad JSON, a missing
or mistyped field, a method other than POST, a repeated custom_id) stops the run with the line numbers,
as nothing would be written for it. A request for a route the batch runner does not serve, or with
`stream` set, gets an error line and the run goes on, as vLLM does. The input and the output may be
local paths or http(s) URLs (GET to read, PUT to write, as vLLM's run-batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, TextIO

import httpx
from fastapi import FastAPI
from tqdm import tqdm

from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import random_id
from kvllm.logger import init_logger

logger = init_logger(__name__)

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LISTED_PROBLEMS = 10
UPLOAD_ATTEMPTS = 5


@dataclass(frozen=True)
class BatchRequest:
    """The request one input line holds."""

    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchSummary:
    """What a run answered: requests per HTTP status, and whether the engine stopped during it."""

    statuses: dict[int, int] = field(default_factory=dict)
    engine_failed: bool = False

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def succeeded(self) -> int:
        return self.statuses.get(200, 0)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def parse_line(line: int, text: str) -> BatchRequest:
    """The request on one input line, or a ValueError that says what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line}: a request must be a JSON object, not {type(obj).__name__}")
    missing = [k for k in ("custom_id", "method", "url", "body") if k not in obj]
    if missing:
        raise ValueError(
            f"line {line}: missing {', '.join(missing)}; every line needs custom_id, method, url and body"
        )
    custom_id, method, url, body = obj["custom_id"], obj["method"], obj["url"], obj["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {line}: custom_id must be a non-empty string, not {custom_id!r}")
    if method != "POST":
        raise ValueError(f"line {line}: method {method!r} is not supported; allowed: POST")
    if not isinstance(url, str):
        raise ValueError(f"line {line}: url must be a string such as /v1/chat/completions, not {url!r}")
    if not isinstance(body, dict):
        raise ValueError(f"line {line}: body must be a JSON object, not {type(body).__name__}")
    return BatchRequest(custom_id, url, body)


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of the file's non-blank lines."""
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield number, text


def iter_requests(path: Path) -> Iterator[BatchRequest]:
    """The requests of a JSONL file in order (ValueError at the first bad line)."""
    for number, text in _numbered_lines(path):
        yield parse_line(number, text)


def check_batch_file(path: Path) -> int:
    """The number of requests in the file; a ValueError listing every bad line (the first
    MAX_LISTED_PROBLEMS of them) and every repeated custom_id, before anything is run."""
    problems: list[str] = []
    first_line: dict[str, int] = {}
    count = 0
    try:
        for number, text in _numbered_lines(path):
            try:
                request = parse_line(number, text)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            count += 1
            if request.custom_id in first_line:
                problems.append(
                    f"line {number}: custom_id {request.custom_id!r} was already used on line "
                    f"{first_line[request.custom_id]}; each request needs its own"
                )
            else:
                first_line[request.custom_id] = number
    except UnicodeDecodeError as exc:
        raise ValueError(f"The batch file {path} is not UTF-8 text: {exc}") from None
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
        more = len(problems) - MAX_LISTED_PROBLEMS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"The batch file {path} has {len(problems)} bad line(s), nothing was run:\n  {listed}{tail}"
        )
    if count == 0:
        raise ValueError(f"The batch file {path} has no requests (one JSON request object per line)")
    return count


def refusal(request: BatchRequest) -> OpenAIError | None:
    """The error the runner answers this request with without sending it, or None."""
    if request.url not in BATCH_URLS:
        return OpenAIError(
            f"URL {request.url} is not served in a batch; supported: {', '.join(BATCH_URLS)}", param="url"
        )
    if request.body.get("stream"):
        return OpenAIError(
            "Request must not be sent in stream mode: a batch writes each whole response on one line",
            param="stream",
        )
    return None


def output_line(request: BatchRequest, status: int, body: Any, request_id: str | None = None) -> str:
    """The output line for `request`, answered with HTTP `status` and JSON `body` (the error's body when
    the status is not 200)."""
    ok = status == HTTPStatus.OK
    record = {
        "id": random_id("batch_req"),
        "custom_id": request.custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or random_id("kvllm-batch"),
            "body": body if ok else None,
        },
        "error": None if ok else body,
    }
    return json.dumps(record, ensure_ascii=False)


def error_line(request: BatchRequest, error: OpenAIError) -> str:
    """The output line for a request the runner answers itself with `error`."""
    return output_line(request, error.status, error.to_body().model_dump())


class OrderedWriter:
    """Writes output lines in input order as the answers arrive in any order (holding only those that
    arrived before an earlier one)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.next_index = 0
        self.waiting: dict[int, str] = {}

    def add(self, index: int, line: str) -> None:
        self.waiting[index] = line
        while self.next_index in self.waiting:
            self.out.write(self.waiting.pop(self.next_index) + "\n")
            self.next_index += 1
        if not self.waiting:
            self.out.flush()


async def answer(client: httpx.AsyncClient, request: BatchRequest) -> tuple[int, str]:
    """(HTTP status, output line) for one request, sent to the app as a client would send it."""
    error = refusal(request)
    if error is not None:
        return error.status, error_line(request, error)
    response = await client.post(request.url, json=request.body)
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    request_id = body.get("id") if response.status_code == 200 and isinstance(body, dict) else None
    return response.status_code, output_line(request, response.status_code, body, request_id)


async def run_requests(
    app: FastAPI,
    requests: Iterator[BatchRequest],
    writer: OrderedWriter,
    max_in_flight: int,
    progress: tqdm | None = None,
) -> BatchSummary:
    """Send every request to `app` (its lifespan entered: the engine running), at most `max_in_flight` at
    a time, writing each answer in input order."""
    summary = BatchSummary()
    slots = asyncio.Semaphore(max_in_flight)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://kvllm-batch", timeout=timeout
    ) as client:

        async def one(index: int, request: BatchRequest) -> None:
            try:
                status, line = await answer(client, request)
            except Exception as exc:  # never a lost line: the failure is that request's answer
                logger.exception("Batch request %r failed in the runner", request.custom_id)
                error = OpenAIError(f"The batch runner could not complete the request: {exc!r}", 500)
                status, line = error.status, error_line(request, error)
            finally:
                slots.release()
            summary.count(status)
            writer.add(index, line)
            if progress is not None:
                progress.update()

        async with asyncio.TaskGroup() as group:
            for index, request in enumerate(requests):
                await slots.acquire()
                group.create_task(one(index, request))
    summary.engine_failed = bool(app.state.llm.errored)
    return summary


async def run_batch_app(
    app: FastAPI, input_path: Path, out: TextIO, total: int, max_in_flight: int, show_progress: bool = True
) -> BatchSummary:
    """Start the app's engine, answer every request of `input_path` into `out`, stop the engine."""
    async with app.router.lifespan_context(app):
        with tqdm(total=total, unit="req", desc="Running batch", disable=not show_progress) as progress:
            return await run_requests(
                app, iter_requests(input_path), OrderedWriter(out), max_in_flight, progress
            )


def is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


@contextlib.contextmanager
def local_input(location: str) -> Iterator[Path]:
    """A local path holding the input: the path itself, or the URL's content downloaded to a temporary file."""
    if not is_url(location):
        path = Path(location)
        if not path.is_file():
            raise ValueError(f"--input-file {location}: no such file (a local path or an http(s) URL)")
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvllm-batch-") as tmp:
        path = Path(tmp) / "input.jsonl"
        try:
            with httpx.stream("GET", location, follow_redirects=True, timeout=60.0) as response:
                response.raise_for_status()
                with path.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
        except httpx.HTTPError as exc:
            raise ValueError(f"--input-file {location}: could not be downloaded ({exc})") from None
        yield path


@contextlib.contextmanager
def output_target(location: str, tmp_dir: str | None) -> Iterator[TextIO]:
    """A text file to write the output into: the path itself, or a temporary file (in `tmp_dir`) PUT to
    the URL once complete, retried with back-off (vLLM's upload)."""
    if not is_url(location):
        parent = Path(location).parent
        if not parent.is_dir():
            raise ValueError(f"--output-file {location}: the folder {parent} does not exist")
        with open(location, "w", encoding="utf-8") as out:
            yield out
        return
    fd, tmp_name = tempfile.mkstemp(prefix="kvllm-batch-output-", suffix=".jsonl", dir=tmp_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yield out
        upload(location, Path(tmp_name))
    finally:
        os.unlink(tmp_name)


def upload(url: str, path: Path, attempts: int = UPLOAD_ATTEMPTS, first_delay_s: float = 1.0) -> None:
    """PUT the file's bytes to `url`, retrying failures with doubling delays; raises after the last."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            with path.open("rb") as f:
                response = httpx.put(url, content=f.read(), timeout=1000.0)
            response.raise_for_status()
            logger.info("Uploaded the batch output to %s", url)
            return
        except httpx.HTTPError as exc:
            if attempt == attempts:
                raise RuntimeError(
                    f"Uploading the batch output to {url} failed {attempts} times: {exc}"
                ) from exc
            logger.warning(
                "Uploading the batch output to %s failed (%s); retrying in %.0f s", url, exc, delay
            )
            time.sleep(delay)
            delay *= 2
