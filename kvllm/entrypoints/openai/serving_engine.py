"""OpenAIServing: what the completion and chat handlers share (model check, limits, sampling, streams)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from kvllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineNotAcceptingError,
    RequestStream,
)
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import ChatMessage, SamplingExtras
from kvllm.outputs import RequestOutput
from kvllm.sampling_params import SamplingParams

# Most top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class OpenAIServing:
    """Base of the OpenAI handlers: validation that turns bad input into 4xx errors before the engine."""

    def __init__(self, llm: AsyncLLM, served_model_names: Sequence[str]) -> None:
        self.llm = llm
        self.served_model_names = list(served_model_names)
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        # Sampling defaults from the model's generation_config.json, for fields a request leaves unset.
        self.default_sampling = llm.engine.model_config.default_sampling

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        # An omitted model means the served one (vLLM accepts that too; OpenAI's client always sends it).
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist. Served model(s): {', '.join(self.served_model_names)}",
                404,
                param="model",
            )

    def check_unsupported(self, request: SamplingExtras) -> None:
        if request.logit_bias:
            raise OpenAIError("logit_bias is not supported by this server; omit it", param="logit_bias")

    def resolve_max_tokens(
        self, num_prompt_tokens: int, requested: int | None, default: int | None, input_name: str
    ) -> int | None:
        """The max_tokens to generate, or an error when the input plus the completion exceed the context.

        `default` applies when the client sent none (None: up to the context); `input_name` is
        "prompt" or "messages", for the error message and its param.
        """
        max_len = self.max_model_len
        if num_prompt_tokens >= max_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, your {input_name} "
                f"{'have' if input_name == 'messages' else 'has'} {num_prompt_tokens} tokens, which leaves no "
                f"room for a completion. Please reduce the length of the {input_name}.",
                param=input_name,
            )
        room = max_len - num_prompt_tokens
        if requested is None:
            return room if default is None else min(default, room)
        if isinstance(requested, int) and requested > room:
            raise OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {input_name}, {requested} "
                f"in the completion). Please reduce the length of the {input_name} or completion.",
                param="max_tokens",
            )
        return requested  # values < 1 are rejected by SamplingParams, naming the field

    def sampling_params(
        self, request: SamplingExtras, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": request.n,
            "max_tokens": max_tokens,
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": request.ignore_eos,
            "min_tokens": request.min_tokens,
            "logprobs": logprobs,
            "skip_special_tokens": request.skip_special_tokens,
            "spaces_between_special_tokens": request.spaces_between_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
        }
        defaults = self.default_sampling
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(request, name) is not None:
                kwargs[name] = getattr(request, name)
            elif name in defaults:
                kwargs[name] = defaults[name]
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name) is not None:
                kwargs[name] = getattr(request, name)
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    def check_logprobs(self, value: int | None, name: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise OpenAIError(f"{name}={value} is not valid; allowed: 0 to {MAX_LOGPROBS}", param=name)

    def check_prompt_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise OpenAIError(f"The {param} is empty: at least one token is needed", param=param)

    def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict[str, Any] | None
    ) -> list[int]:
        """Token ids of the conversation under the tokenizer's chat template (as `LLM.chat` renders it)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(
                "This model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                param="messages",
            )
        if not messages:
            raise OpenAIError("messages is empty; send at least one message", param="messages")
        conversation = [{"role": m.role, "content": _text_content(m)} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **(kwargs or {})
            )
        except Exception as exc:  # template errors (jinja) are the request's fault
            raise OpenAIError(f"The chat template failed on these messages: {exc}", param="messages") from exc
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def add_requests(
        self, request_id: str, prompts: list[tuple[dict[str, Any], SamplingParams]]
    ) -> list[RequestStream]:
        """Add one engine request per prompt (ids `request_id-i`); all or none, with errors mapped to HTTP."""
        arrival = time.monotonic()
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.llm.add_request(rid, prompt, params, arrival))
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, Exception):
                raise to_openai_error(exc) from exc
            raise
        return streams


def _text_content(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(
                f"Content part of type {part.type!r} is not supported; allowed: text", param="messages"
            )
        parts.append(part.text)
    return "\n".join(parts)


def to_openai_error(exc: Exception) -> Exception:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return OpenAIError.bad_request(exc)
    if isinstance(exc, EngineNotAcceptingError):
        return OpenAIError(str(exc), 503)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 500)
    return exc


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event in OpenAI's streaming format."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def stream_error_event(exc: BaseException) -> str:
    """The event that ends a stream whose response has already started (status 200 was sent)."""
    error = to_openai_error(exc) if isinstance(exc, Exception) else exc
    if not isinstance(error, OpenAIError):
        error = OpenAIError(f"Internal error: {exc!r}", 500)
    return sse(error.to_body())
