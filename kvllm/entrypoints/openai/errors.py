"""OpenAI-shaped errors: one exception type for the serving code, the JSON bodies it becomes, the
app's exception handlers, and an OpenAPI document that lists the error statuses as they are sent.

Bad input is a 4xx whose message says what was wrong; an unexpected fault is a 500 that names an
error id found in the log, never the exception's text.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvllm.engine.async_llm import EngineDeadError, EngineNotAcceptingError
from kvllm.engine.llm_engine import EngineSleepingError
from kvllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_id
from kvllm.logger import init_logger

logger = init_logger(__name__)

# The error `type` per status, as vLLM names them (OpenAI's clients map the status, not the type).
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# SamplingParams and EngineArgs messages start with "name=value ..."; that name is the offending param.
_PARAM_RE = re.compile(r"^(\w+)=")


class OpenAIError(Exception):
    """An error to send to the client with its HTTP status, in OpenAI's error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type_: str | None = None):
        # Messages may quote the request; a lone surrogate in it could not be sent as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")

    @classmethod
    def bad_request(cls, exc: ValueError | str) -> OpenAIError:
        """A 400 from a ValueError of the engine or SamplingParams, naming the param when it can."""
        message = str(exc)
        match = _PARAM_RE.match(message)
        return cls(message, 400, param=match.group(1) if match else None)

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        )

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body().model_dump(), status_code=self.status)


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return OpenAIError(message, status, param).to_response()


def to_openai_error(exc: Exception) -> Exception:
    """The OpenAIError an engine or validation error means; other exceptions unchanged."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return OpenAIError.bad_request(exc)
    if isinstance(exc, EngineNotAcceptingError):
        return OpenAIError(str(exc), 503)
    if isinstance(exc, EngineSleepingError):
        return OpenAIError(f"{exc} (POST /wake_up)", 503)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 500)
    return exc


def internal_error(exc: BaseException) -> OpenAIError:
    """A 500 that tells the client where to look, not what broke: the traceback goes to the log."""
    error_id = random_id("err")
    logger.error("Internal error %s while serving a request", error_id, exc_info=exc)
    return OpenAIError(f"Internal server error ({error_id}); the server log has the details", 500)


_STATUS_TEXT = {
    400: "Bad request: the body does not fit the schema or a value is not allowed",
    401: "Missing or invalid API key",
    404: "Unknown model",
    413: "The request body is larger than --max-request-body-bytes",
    500: "Internal error, or a request the engine could not finish",
    503: "The server is shutting down, or its engine has stopped",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=` for the OpenAPI document: these statuses, each with an ErrorResponse body."""
    return {s: {"model": ErrorResponse, "description": _STATUS_TEXT[s]} for s in statuses}


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app sends in OpenAI's shape, and an OpenAPI document without FastAPI's 422s."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Like vLLM: a body that does not fit the schema is a 400 in OpenAI's shape, not FastAPI's 422.
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = errors[0].get("ctx", {}).get("error", "")
            return error_response(f"The request body is not valid JSON: {detail}".rstrip(": "), 400)
        parts, param = [], None
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            name = ".".join(loc)
            param = param or (loc[0] if loc else None)
            parts.append(
                f"{name or 'body'}: {e.get('msg')} (got {_shown(e.get('input'))})"
                if loc
                else str(e.get("msg"))
            )
        return error_response("; ".join(parts), 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(f"Not found: {request.method} {request.url.path}", 404)
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(message, exc.status_code)
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineNotAcceptingError)
    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        assert isinstance(error, OpenAIError)
        return error.to_response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).to_response()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)  # sent as 400 (above)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _shown(value: Any, limit: int = 200) -> str:
    """A rejected input as an error message quotes it: repr (escapes lone surrogates), cut to `limit`."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
