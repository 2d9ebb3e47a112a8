"""OpenAIServing: what the completion and chat handlers share (model check, limits, sampling, streams).

CPU-heavy work on a request's text (tokenizing, rendering the chat template, decoding long token
lists) runs in one tokenizer thread, never on the event loop, so a large request delays only the
requests queued behind it for that thread, not the streams, /health or /metrics. One thread, as in
vLLM: HF tokenizers are not safe to use from several threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel

from kvllm.beam_search import (
    BeamSearchInstance,
    BeamSearchSequence,
    create_sort_beams_key_function,
    step_params,
)
from kvllm.config.serving import ChatTemplateDefaults, ResponseOptions, ServingLimits
from kvllm.engine.async_llm import AsyncLLM, RequestStream
from kvllm.engine.input_processor import truncate_prompt, with_generation_defaults
from kvllm.entrypoints.chat_utils import ChatTemplateError, ChatTemplateRenderer
from kvllm.entrypoints.openai.errors import OpenAIError, internal_error, to_openai_error
from kvllm.entrypoints.openai.protocol import (
    UNSUPPORTED_VLLM_FIELDS,
    ChatMessage,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    SamplingExtras,
    StreamOptions,
    UsageInfo,
)
from kvllm.entrypoints.openai.request_logger import RequestLogger
from kvllm.entrypoints.openai.structured_outputs import structured_outputs_params
from kvllm.entrypoints.openai.tool_calling import template_message
from kvllm.logger import init_logger
from kvllm.outputs import Logprob, PositionLogprobs, RequestOutput
from kvllm.sampling_params import BeamSearchParams, SamplingParams

logger = init_logger(__name__)
T = TypeVar("T")

# Template variables the server sets itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")


def tokenizer_executor() -> ThreadPoolExecutor:
    """The one thread the handlers of an app tokenize, render and decode in."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvllm-tokenizer")


def check_chat_defaults(defaults: ChatTemplateDefaults) -> None:
    """Refuse default template variables the server sets itself (ValueError, before serving)."""
    reserved = sorted(set(defaults.kwargs) & {*_RESERVED_TEMPLATE_VARIABLES, "chat_template"})
    if reserved:
        raise ValueError(
            f"--default-chat-template-kwargs may not set {', '.join(reserved)}: the server sets them "
            "(a template goes in --chat-template)"
        )


class OpenAIServing:
    """Base of the OpenAI handlers: validation that turns bad input into 4xx errors before the engine."""

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_names: Sequence[str],
        limits: ServingLimits | None = None,
        executor: Executor | None = None,
        renderer: ChatTemplateRenderer | None = None,
        chat_defaults: ChatTemplateDefaults | None = None,
        response_options: ResponseOptions | None = None,
        request_logger: RequestLogger | None = None,
    ) -> None:
        self.llm = llm
        self.request_logger = request_logger
        self.chat_defaults = chat_defaults or ChatTemplateDefaults()
        self.response_options = response_options or ResponseOptions()
        self.served_model_names = list(served_model_names)
        self.limits = limits or ServingLimits()
        self.executor = executor or tokenizer_executor()
        self.renderer = renderer or ChatTemplateRenderer()
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        # Sampling defaults from the model's generation_config.json, for fields a request leaves unset.
        self.default_sampling = llm.engine.model_config.default_sampling

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-heavy `fn` in the tokenizer thread; its OpenAIErrors reach the caller as raised."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def stream_usage(self, options: StreamOptions | None) -> tuple[bool, bool]:
        """(usage in a last chunk, usage on every chunk): vLLM's include_usage and continuous_usage_stats,
        with the last chunk's usage always there under --enable-force-include-usage."""
        force = self.response_options.enable_force_include_usage
        if options is None:
            return force, False
        include = options.include_usage or force
        return include, include and options.continuous_usage_stats

    def with_prompt_details(self, usage: UsageInfo, num_cached_tokens: int) -> UsageInfo:
        """`usage` with prompt_tokens_details.cached_tokens under --enable-prompt-tokens-details (vLLM: only
        when some prompt tokens came from the prefix cache)."""
        if self.response_options.enable_prompt_tokens_details and num_cached_tokens:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached_tokens)
        return usage

    def beam_search_params(
        self, request: SamplingExtras, max_tokens: int, route_refused: dict[str, Any]
    ) -> BeamSearchParams:
        """vLLM's use_beam_search: the n best beams of width n. `route_refused` names the route's own fields
        that beam search does not apply (each set one is a 400), beside the shared ones checked here."""
        refused = {
            "stream": request.stream,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "prompt_logprobs": request.prompt_logprobs is not None,
            "structured_outputs": request.structured_outputs,
            "logit_bias": request.logit_bias,
            "allowed_token_ids": request.allowed_token_ids,
            "bad_words": request.bad_words,
            **route_refused,
        }
        for name, value in refused.items():
            if value:
                raise OpenAIError(
                    f"{name} is not supported with use_beam_search; omit one of them", param=name
                )
        try:
            return BeamSearchParams(
                beam_width=request.n,
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                length_penalty=request.length_penalty,
            )
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    async def beam_search(
        self, request_id: str, prompt: dict[str, Any], params: BeamSearchParams, priority: int = 0
    ) -> list[BeamSearchSequence]:
        """The best params.beam_width beams for one prompt, best first (kvllm/beam_search.py's algorithm,
        each step's one-token requests run together on the engine; the prefix cache makes each cost one
        token). Cancelling it aborts the step's requests."""
        eos = self.tokenizer.eos_token_id
        sort_key = create_sort_beams_key_function(eos, params.length_penalty)
        one_token = step_params(params)
        instance = BeamSearchInstance(prompt["prompt_token_ids"])
        for step in range(params.max_tokens):
            instance.retire_full(self.max_model_len)
            if not instance.beams:
                break
            beam_prompts = [
                ({"prompt_token_ids": b.tokens, "cache_salt": prompt.get("cache_salt")}, one_token)
                for b in instance.beams
            ]
            streams = await self.add_requests(f"{request_id}-s{step}", beam_prompts, priority)
            outputs = await asyncio.gather(*(final_output(s) for s in streams))
            instance.advance(outputs, params, eos, sort_key)
        return instance.best(params.beam_width, sort_key)

    def reply_role(self, request: Any) -> str:
        """A chat reply's role (vLLM's rule): --response-role ("assistant") after a generation prompt, else
        the role of the last message, which the reply continues."""
        if request.add_generation_prompt or not request.messages:
            return self.response_options.response_role
        return request.messages[-1].role

    def as_token_ids(self, request: Any) -> bool:
        """Whether logprob tokens go out as "token_id:N": the request's field, or the server's flag."""
        return bool(request.return_tokens_as_token_ids or self.response_options.return_tokens_as_token_ids)

    def check_model(self, model: str | None) -> None:
        # An omitted model means the served one (vLLM accepts that too; OpenAI's client always sends it).
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist. Served model(s): {', '.join(self.served_model_names)}",
                404,
                param="model",
            )

    def check_unsupported(self, request: SamplingExtras) -> None:
        """Fields and combinations refused before any work (vLLM's rules), with a 400 naming the field."""
        for name, value in (request.model_extra or {}).items():
            if name in UNSUPPORTED_VLLM_FIELDS and value != UNSUPPORTED_VLLM_FIELDS[name]:
                raise OpenAIError(
                    f"{name} is not supported by this server; omit it (or send vLLM's default, "
                    f"{json.dumps(UNSUPPORTED_VLLM_FIELDS[name])})",
                    param=name,
                )
        if request.prompt_logprobs is not None:
            if request.stream and request.prompt_logprobs != 0:
                raise OpenAIError(
                    "prompt_logprobs are not available when stream=true; omit one of them",
                    param="prompt_logprobs",
                )
            self.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.truncation_side is not None and request.truncate_prompt_tokens is None:
            raise OpenAIError("truncation_side needs truncate_prompt_tokens", param="truncation_side")

    def truncate(self, token_ids: list[int], request: SamplingExtras) -> list[int]:
        """The prompt as truncate_prompt_tokens / truncation_side keep it (400 naming the field)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return token_ids
        if not (k == -1 or k >= 1):
            raise OpenAIError(
                f"truncate_prompt_tokens={k} is not valid; allowed: -1 (the last max_model_len tokens) or an "
                "integer >= 1 (the last k tokens)",
                param="truncate_prompt_tokens",
            )
        try:
            return truncate_prompt(token_ids, k, self.max_model_len, request.truncation_side or "left")
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    def check_limits(self, request: SamplingExtras, num_prompts: int = 1) -> None:
        """The per-request limits that need no tokenizing: n, prompts, stop strings (400 naming each)."""
        limits = self.limits
        if isinstance(request.n, int) and request.n > limits.max_n_sequences:
            raise OpenAIError(
                f"n={request.n} is more than this server allows: {limits.describe('max_n_sequences')} "
                "completions per prompt",
                param="n",
            )
        if num_prompts > limits.max_prompts_per_request:
            raise OpenAIError(
                f"The request has {num_prompts} prompts, more than this server allows: "
                f"{limits.describe('max_prompts_per_request')}; send them in several requests",
                param="prompt",
            )
        num_stops = 0 if request.stop is None else 1 if isinstance(request.stop, str) else len(request.stop)
        if num_stops > limits.max_stop_strings:
            raise OpenAIError(
                f"stop has {num_stops} strings, more than this server allows: "
                f"{limits.describe('max_stop_strings')}",
                param="stop",
            )

    def check_generation_budget(self, params: Sequence[SamplingParams]) -> None:
        """n x max_tokens, summed over the request's prompts, within max_generation_tokens_per_request."""
        total = sum(p.n * (p.max_tokens or self.max_model_len) for p in params)
        limit = self.limits.max_generation_tokens_per_request
        if total > limit:
            first = params[0]
            parts = f"n={first.n} x max_tokens={first.max_tokens}" + (
                f" x {len(params)} prompts" if len(params) > 1 else ""
            )
            raise OpenAIError(
                f"The request may generate up to {total} tokens ({parts}), more than this server allows: "
                f"{self.limits.describe('max_generation_tokens_per_request')}; lower n or max_tokens",
                param="max_tokens",
            )

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
            "logit_bias": _logit_bias(request.logit_bias),
            "allowed_token_ids": request.allowed_token_ids,
            "bad_words": request.bad_words,
            "prompt_logprobs": request.prompt_logprobs,
            "extra_args": request.vllm_xargs,
            "structured_outputs": structured_outputs_params(
                request.structured_outputs, getattr(request, "response_format", None)
            ),
        }
        kwargs.update(self.sampling_knobs(request))
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    def sampling_knobs(self, request: Any) -> dict[str, Any]:
        """The request's temperature, top-p/k, min-p and penalties, unset ones from the model's
        generation_config (as vLLM's --generation-config auto)."""
        fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        knobs = with_generation_defaults({n: getattr(request, n) for n in fields}, self.default_sampling)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name) is not None:
                knobs[name] = getattr(request, name)
        return knobs

    def check_logprobs(self, value: int | None, name: str) -> None:
        most = self.llm.engine.args.max_logprobs  # --max-logprobs
        if value is not None and not 0 <= value <= most:
            raise OpenAIError(
                f"{name}={value} is not valid; allowed: 0 to {most} (--max-logprobs)", param=name
            )

    def check_prompt_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise OpenAIError(f"The {param} is empty: at least one token is needed", param=param)

    def chat_template(self, request_template: str | None, kwargs: dict[str, Any] | None) -> str:
        """The template to render: the request's (with --trust-request-chat-template), else the server's
        --chat-template, else the model's."""
        given = request_template if request_template is not None else (kwargs or {}).get("chat_template")
        if given is not None:
            if not self.limits.trust_request_chat_template:
                raise OpenAIError(
                    "The request carries a chat template, which this server does not render: it uses its "
                    "model's template only. Omit chat_template (and chat_template_kwargs.chat_template), or "
                    "start the server with --trust-request-chat-template",
                    param="chat_template",
                )
            if not isinstance(given, str):
                raise OpenAIError("chat_template must be a string (a Jinja template)", param="chat_template")
            return given
        template = self.chat_defaults.template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise OpenAIError(
                "This model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                param="messages",
            )
        return template

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        kwargs: dict[str, Any] | None,
        template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the conversation under the chat template (the text `LLM.chat` renders).

        CPU-heavy: call it through `in_tokenizer_thread`.
        """
        template = template or self.chat_template(None, kwargs)
        if not messages:
            raise OpenAIError("messages is empty; send at least one message", param="messages")
        variables = dict(kwargs or {})
        variables.pop("chat_template", None)
        for name in _RESERVED_TEMPLATE_VARIABLES:
            if name in variables:
                raise OpenAIError(
                    f"chat_template_kwargs.{name} is set by the server; use the request field instead",
                    param="chat_template_kwargs",
                )
        variables = {**self.chat_defaults.kwargs, **variables}  # the request's values win
        if continue_final_message and add_generation_prompt:
            raise OpenAIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        as_parts = content_format(template, self.chat_defaults.content_format) == "openai"
        conversation = [
            template_message(
                m.role,
                message_parts(m) if as_parts else message_text(m),
                m.tool_calls,
                m.tool_call_id,
                m.name,
            )
            for m in messages
        ]
        try:
            text = self.renderer.render(
                template,
                conversation,
                add_generation_prompt,
                {**self.tokenizer.special_tokens_map, **variables},
                tools,
            )
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        if continue_final_message:
            text = cut_after_final_message(text, message_text(messages[-1]))
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def add_requests(
        self, request_id: str, prompts: list[tuple[dict[str, Any], SamplingParams]], priority: int = 0
    ) -> list[RequestStream]:
        """Add one engine request per prompt (ids `request_id-i`); all or none, with errors mapped to HTTP."""
        arrival = time.monotonic()
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await self.llm.add_request(rid, prompt, params, arrival, priority)
                if self.request_logger is not None:
                    self.request_logger.log_inputs(rid, prompt, params)
                    stream = self.request_logger.watch(stream)  # type: ignore[assignment]
                streams.append(stream)
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, Exception):
                raise to_openai_error(exc) from exc
            raise
        return streams


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON string keys) with integer keys; values checked later."""
    if logit_bias is None:
        return None
    biases: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            biases[int(key)] = bias
        except ValueError:
            raise OpenAIError(
                f'logit_bias key {key!r} is not valid; allowed: token ids (integers as strings, e.g. "50256")',
                param="logit_bias",
            ) from None
    return biases


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def logprob_token(token_id: int, logprob: Logprob, as_token_id: bool) -> str:
    """A logprob entry's token as the response shows it: its text, or "token_id:N" (vLLM's
    return_tokens_as_token_ids, for tokens whose text cannot stand alone, e.g. part of a UTF-8 character)."""
    return f"token_id:{token_id}" if as_token_id else logprob.decoded_token or ""


def prompt_logprobs_body(positions: list[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """RequestOutput.prompt_logprobs as vLLM's response field: -inf becomes -9999.0 (as vLLM sends it)."""
    if positions is None:
        return None
    return [
        None
        if entry is None
        else {
            token_id: PromptLogprob(
                logprob=max(lp.logprob, -9999.0), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in positions
    ]


_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def content_format(template: str, option: str) -> str:
    """ "string" or "openai" (a list of {"type": "text", "text": ...} parts) for --chat-template-content-format
    OPTION; "auto" chooses "openai" when the template loops over a message's content, as vLLM detects."""
    if option != "auto":
        return option
    return "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"


def message_parts(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's content as OpenAI's list of text parts (a string content is one part)."""
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [{"type": "text", "text": message.content}]
    message_text(message)  # refuses parts other than text
    return [{"type": "text", "text": part.text} for part in message.content]


def cut_after_final_message(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's content (continue_final_message: what
    comes after it, the end-of-turn tokens, is cut), as transformers does."""
    for needle in (final, final.strip()):
        if needle and needle in text:
            return text[: text.rindex(needle) + len(needle)]
    raise OpenAIError(
        "continue_final_message is set but the final message does not appear in the chat after applying "
        "the chat template; send a final message with text content",
        param="continue_final_message",
    )


def message_text(message: ChatMessage) -> str:
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


def check_valid_unicode(request: BaseModel) -> None:
    """Reject text holding a lone surrogate ("\\ud800" in the JSON), which no tokenizer can encode."""
    for path, text in _strings(request, ""):
        if text.isascii():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(
                f"{path} is not valid Unicode: it holds a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                f"character {exc.start}; send text that can be encoded as UTF-8",
                param=path.split(".")[0].split("[")[0].split(" ")[0],
            ) from None


def _strings(value: Any, path: str) -> Any:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _strings(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{path} (a key)")
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")


async def final_output(stream: RequestStream) -> RequestOutput:
    """The last output of one request's stream (its finished result); the stream is closed after."""
    final: RequestOutput | None = None
    try:
        async for _, output in merge_streams([stream]):
            final = output
    finally:
        stream.close()
    assert final is not None
    return final


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, tagged with the stream's index.

    A sequence the engine could not run (finish_reason "error") raises a 500 with the engine's reason.
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, _checked(output)
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
                yield i, _checked(output)
    finally:
        for task in pending:
            task.cancel()


def _checked(output: RequestOutput) -> RequestOutput:
    for c in output.outputs:
        if c.finish_reason == "error":
            raise OpenAIError(f"The engine could not finish this request: {c.stop_reason}", 500)
    return output


def log_client_left(request_id: str) -> None:
    """The one line an ordinary disconnect logs (its engine requests are aborted)."""
    logger.info("Client disconnected before request %s finished; aborted it", request_id)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event in OpenAI's streaming format."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def stream_error_event(exc: BaseException) -> str:
    """The event that ends a stream whose response has already started (status 200 was sent)."""
    error = to_openai_error(exc) if isinstance(exc, Exception) else exc
    if not isinstance(error, OpenAIError):
        error = internal_error(exc)
    return sse(error.to_body())
