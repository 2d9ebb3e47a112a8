"""Pydantic models of POST /v1/responses (OpenAI's Responses API, text in and text out).

The request takes every field OpenAI's client may send, so that what kvllm cannot do (tools,
reasoning, background runs, stored or chained responses) is refused by name in `serving_responses.py`
rather than dropped. Response and event shapes follow OpenAI's (and vLLM's) field names.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from kvllm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel


class InputContentPart(OpenAIBaseModel):
    """A part of an input message: text parts ("input_text", or "output_text" of an earlier answer)."""

    type: str
    text: str | None = None


class InputItem(OpenAIBaseModel):
    """One item of `input`: a message (role + content); other item types are refused by name."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContentPart] | None = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only under the same salt
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True
    service_tier: str | None = None
    truncation: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted so they can be refused by name (serving_responses.UNSUPPORTED).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    prompt: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(OpenAIBaseModel):
    """The Response object, as returned and as carried by the stream's response.* events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    service_tier: str = "auto"
