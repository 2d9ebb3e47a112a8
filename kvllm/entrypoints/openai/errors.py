"""OpenAI-shaped errors: one exception type for the serving code, and the JSON bodies it becomes."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from kvllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

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
