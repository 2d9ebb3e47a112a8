"""POST /v1/responses: OpenAI's Responses API for text in and text out, streamed or not.

`input` (a string, or message items with text content) and `instructions` (a system message put
first) are rendered with the model's chat template, as /v1/chat/completions renders its messages;
"developer" messages are rendered as "system", since chat templates know no developer role.

What the Responses API offers beyond text generation is refused with a 400 that names the field
(`UNSUPPORTED` below): tools, reasoning, background runs, stored and chained responses
(`store`, `previous_response_id`, `conversation`), logprobs, structured output (`text.format`).
Responses are never stored (`store` is false in every response).

A stream is vLLM's sequence of events: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (one per new
text), response.output_text.done, response.content_part.done, response.output_item.done and
response.completed, whose response has status "completed", "incomplete" (max_output_tokens reached,
with incomplete_details) or "cancelled" (aborted at shutdown). As in vLLM, response.completed ends
every stream that was not cut by an error; an error after the first event ends the stream with an
"error" event.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvllm.engine.async_llm import RequestStream
from kvllm.entrypoints.openai.errors import OpenAIError, internal_error, to_openai_error
from kvllm.entrypoints.openai.protocol import ChatMessage
from kvllm.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from kvllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_valid_unicode,
    final_output,
    log_client_left,
    merge_streams,
)
from kvllm.outputs import RequestOutput
from kvllm.sampling_params import SamplingParams

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _is_set(value: Any) -> bool:
    return value not in (None, False, [], {})


# field -> (is the request using it?, why it is refused and what to do instead)
UNSUPPORTED: dict[str, tuple[Callable[[ResponsesRequest], bool], str]] = {
    "tools": (lambda r: _is_set(r.tools), "tools are not supported (no tool calling); omit them"),
    "tool_choice": (
        lambda r: r.tool_choice not in (None, "auto", "none"),
        "tool_choice needs tools, which are not supported; omit it or use 'none'",
    ),
    "max_tool_calls": (
        lambda r: r.max_tool_calls is not None,
        "max_tool_calls needs tools, which are not supported; omit it",
    ),
    "reasoning": (
        lambda r: _is_set(r.reasoning),
        "reasoning options are not supported (no reasoning parser); omit reasoning",
    ),
    "background": (
        lambda r: bool(r.background),
        "background responses are not supported: responses are answered on the request's connection; "
        "omit background or set it to false",
    ),
    "store": (
        lambda r: bool(r.store),
        "store=true is not supported: this server keeps no responses (there is no GET "
        "/v1/responses/{id}); omit store or set it to false",
    ),
    "previous_response_id": (
        lambda r: r.previous_response_id is not None,
        "previous_response_id is not supported: responses are not stored; send the whole conversation "
        "in input",
    ),
    "conversation": (
        lambda r: r.conversation is not None,
        "conversation is not supported: conversations are not stored; send the whole conversation in input",
    ),
    "include": (
        lambda r: _is_set(r.include),
        "include is not supported (no logprobs, tool or reasoning outputs on /v1/responses); omit it",
    ),
    "top_logprobs": (
        lambda r: bool(r.top_logprobs),
        "top_logprobs is not supported on /v1/responses; use /v1/chat/completions with logprobs",
    ),
    "logit_bias": (lambda r: _is_set(r.logit_bias), "logit_bias is not supported by this server; omit it"),
    "prompt": (
        lambda r: r.prompt is not None,
        "prompt templates (prompt) are not supported; send the text in input",
    ),
    "text": (
        lambda r: _is_set(r.text) and r.text != {"format": {"type": "text"}},
        "text options other than format {'type': 'text'} are not supported (no structured output)",
    ),
    "truncation": (
        lambda r: r.truncation not in (None, "disabled"),
        "truncation='auto' is not supported: input longer than the context is refused; omit truncation "
        "or use 'disabled'",
    ),
    "service_tier": (
        lambda r: r.service_tier not in (None, "auto", "default"),
        "service tiers are not supported; omit service_tier or use 'auto'",
    ),
    "stream_options": (
        lambda r: _is_set(r.stream_options) and r.stream_options != {"include_obfuscation": False},
        "stream_options are not supported on /v1/responses (no obfuscation padding); omit them",
    ),
}


class OpenAIServingResponses(OpenAIServing):
    """The responses endpoint: input items to a chat prompt, and OpenAI's Response and event shapes."""

    async def create_response(self, request: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        """A ResponsesResponse, or (stream=True) an iterator of server-sent events."""
        check_valid_unicode(request)
        self.check_model(request.model)
        for name, (used, reason) in UNSUPPORTED.items():
            if used(request):
                raise OpenAIError(f"{reason} (/v1/responses)", param=name)
        messages = self._messages(request)
        template = self.chat_template(None, None)
        prompt_ids = await self.in_tokenizer_thread(self.render_chat, messages, True, None, template)
        self.check_prompt_ids(prompt_ids, "input")
        try:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_output_tokens, None, "input")
        except OpenAIError as exc:
            if exc.param == "max_tokens":
                exc.param = "max_output_tokens"
            raise
        params = self._sampling_params(request, max_tokens)
        self.check_generation_budget([params])
        response_id = f"resp_{uuid.uuid4().hex}"
        streams = await self.add_requests(
            response_id,
            [({"prompt_token_ids": prompt_ids, "cache_salt": request.cache_salt}, params)],
            request.priority,
        )
        skeleton = ResponsesResponse(
            id=response_id,
            status="in_progress",
            model=self.model_name,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            metadata=request.metadata,
            user=request.user,
            parallel_tool_calls=request.parallel_tool_calls,
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.stream:
            return self._stream(skeleton, message_id, streams[0])
        final = await final_output(streams[0])
        return _finished(skeleton, message_id, final)

    def _messages(self, request: ResponsesRequest) -> list[ChatMessage]:
        messages = []
        if request.instructions:
            messages.append(ChatMessage(role="system", content=request.instructions))
        if isinstance(request.input, str):
            messages.append(ChatMessage(role="user", content=request.input))
            return messages
        if not request.input:
            raise OpenAIError("input is empty; send text or at least one message", param="input")
        for i, item in enumerate(request.input):
            if item.type != "message":
                raise OpenAIError(
                    f"input[{i}] is of type {item.type!r}, which is not supported; allowed: message "
                    "(text only: no tool calls or reasoning items)",
                    param="input",
                )
            role = _ROLES.get(item.role or "")
            if role is None:
                raise OpenAIError(
                    f"input[{i}].role {item.role!r} is not valid; allowed: {', '.join(_ROLES)}", param="input"
                )
            messages.append(ChatMessage(role=role, content=_item_text(item.content, i)))
        return messages

    def _sampling_params(self, request: ResponsesRequest, max_tokens: int | None) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": request.seed,
            "skip_special_tokens": request.skip_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
        }
        kwargs.update(self.sampling_knobs(request))
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            error = OpenAIError.bad_request(exc)
            if error.param == "max_tokens":
                error.param = "max_output_tokens"
            raise error from None

    async def _stream(
        self, skeleton: ResponsesResponse, message_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, **payload: Any) -> str:
            nonlocal sequence
            body = {"type": kind, "sequence_number": sequence, **payload}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        in_progress = skeleton.model_dump(mode="json")
        try:
            yield event("response.created", response=in_progress)
            yield event("response.in_progress", response=in_progress)
            item = OutputMessage(id=message_id, status="in_progress", content=[])
            yield event("response.output_item.added", output_index=0, item=item.model_dump(mode="json"))
            yield event(
                "response.content_part.added", **where, part=OutputText(text="").model_dump(mode="json")
            )
            sent = 0
            last: RequestOutput | None = None
            async for _, last in merge_streams([stream]):
                text = last.outputs[0].text
                if len(text) > sent:
                    yield event("response.output_text.delta", **where, delta=text[sent:], logprobs=[])
                    sent = len(text)
            assert last is not None
            done = _finished(skeleton, message_id, last)
            message = done.output[0]
            yield event("response.output_text.done", **where, text=message.content[0].text, logprobs=[])
            yield event(
                "response.content_part.done", **where, part=message.content[0].model_dump(mode="json")
            )
            yield event("response.output_item.done", output_index=0, item=message.model_dump(mode="json"))
            yield event("response.completed", response=done.model_dump(mode="json"))
        except Exception as exc:
            error = to_openai_error(exc)
            if not isinstance(error, OpenAIError):
                error = internal_error(exc)
            yield event("error", code=str(error.status), message=error.message, param=error.param)
        except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
            log_client_left(skeleton.id)
            raise
        finally:
            stream.close()


def _item_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise OpenAIError(
                f"input[{index}] has a content part of type {part.type!r}, which is not supported; allowed: "
                "input_text, output_text",
                param="input",
            )
        parts.append(part.text)
    return "\n".join(parts)


def _finished(skeleton: ResponsesResponse, message_id: str, final: RequestOutput) -> ResponsesResponse:
    """The Response once generation ended: status from the finish reason, the text, and usage."""
    c = final.outputs[0]
    status = {"length": "incomplete", "abort": "cancelled"}.get(c.finish_reason or "", "completed")
    message = OutputMessage(
        id=message_id,
        status="incomplete" if status == "incomplete" else "completed",
        content=[OutputText(text=c.text)],
    )
    num_prompt, num_output = len(final.prompt_token_ids), len(c.token_ids)
    usage = ResponseUsage(
        input_tokens=num_prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=int(final.metrics.get("num_cached_tokens", 0))),
        output_tokens=num_output,
        total_tokens=num_prompt + num_output,
    )
    return skeleton.model_copy(
        update={
            "status": status,
            "output": [message],
            "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
        }
    )
