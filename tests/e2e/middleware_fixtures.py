"""ASGI middleware that tests pass to `kvllm serve --middleware` by import path."""

from __future__ import annotations

from typing import Any


class StampMiddleware:
    """A pure ASGI middleware class: adds `x-stamp: class` to every HTTP response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-stamp", b"class"))
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_function(request: Any, call_next: Any) -> Any:
    """An HTTP middleware function: adds `x-stamp-function: <path>`."""
    response = await call_next(request)
    response.headers["x-stamp-function"] = request.url.path
    return response


NOT_MIDDLEWARE = 42
