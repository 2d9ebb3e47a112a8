"""ASGI middleware of the OpenAI server: API keys, the request-body limit, in-flight request tracking,
X-Request-Id headers and the server load of /load."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvllm.entrypoints.openai.errors import error_response

# Beyond /v1/*: routes that generate or change the engine's state (vLLM guards /v1 only; a key that
# left SageMaker's /invocations open would not protect the model).
GUARDED_PATHS = ("/invocations", "/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping")


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` with one of the server's keys on every /v1/* request and
    on GUARDED_PATHS (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        if not api_keys or not all(api_keys):
            raise ValueError("APIKeyMiddleware needs one or more non-empty keys")
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith("/v1") or path in GUARDED_PATHS
        if scope["type"] == "http" and guarded and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Every key is compared, so the time taken does not tell which one came close.
            matches = [secrets.compare_digest(given, expected) for expected in self.expected]
            if not any(matches):
                message = (
                    "Invalid API key"
                    if given
                    else "Missing API key: send the header Authorization: Bearer <key>"
                )
                await error_response(message, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every HTTP answer carries X-Request-Id, the request's own header
    when it sent a usable one (printable ASCII, at most MAX_REQUEST_ID_CHARS), else a fresh id."""

    MAX_REQUEST_ID_CHARS = 256

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        usable = 0 < len(given) <= self.MAX_REQUEST_ID_CHARS and all(32 < c < 127 for c in given)
        request_id = given if usable else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# The routes whose requests run on the engine (vLLM's load-aware routes that kvllm serves).
LOAD_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/invocations"}
)


class ServerLoadMiddleware:
    """vLLM's --enable-server-load-tracking: `app.state.server_load` counts the requests on LOAD_PATHS
    being served, streams until their last byte; GET /load reports it."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("path") not in LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class RequestBodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, else as soon as the bytes read pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (
            f"The request body is larger than {self.max_bytes} bytes, the most this server accepts "
            "(max_request_body_bytes, --max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._message(), 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body through as is.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)


class InFlightRequests:
    """Counts HTTP requests being served, so the server can wait for them before it exits."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s until no request is in flight; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()


class InFlightMiddleware:
    """Keeps `tracker` (an InFlightRequests) counting the HTTP requests this app is serving."""

    def __init__(self, app: ASGIApp, tracker: InFlightRequests) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.tracker.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.tracker.leave()
