"""Pydantic models of the OpenAI-compatible API (requests, responses, stream chunks, errors).

Field names follow OpenAI's API, plus vLLM's sampling extras (top_k, min_p, repetition_penalty, ...)
in the request body. Unknown request fields are ignored, as OpenAI clients send optional ones freely, and
each request that has any logs a warning naming them (as vLLM does): a misspelt field is never silently
dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from kvllm.logger import init_logger

logger = init_logger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Base of every API model: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


# ---- errors ------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# ---- shared ------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too (with include_usage)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details and a prefix-cache hit; left out of the JSON otherwise.
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _without_empty_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


# vLLM request fields kvllm does not implement, with the value that means "not used" (vLLM's default).
# A request that sets one to anything else is refused with a 400 naming it, never silently served
# without it; other unknown fields (OpenAI clients send optional ones freely) are ignored.
UNSUPPORTED_VLLM_FIELDS: dict[str, Any] = {
    "prompt_embeds": None,
    "kv_transfer_params": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
    "documents": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_prompt_text": None,
}


class RequestModel(OpenAIBaseModel):
    """Base of the request bodies: fields the model does not declare are ignored with a warning that
    names them (vLLM's fields that kvllm refuses are named by the handlers' 400 instead)."""

    @model_validator(mode="before")
    @classmethod
    def _warn_about_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = cls.model_fields.keys() | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(str(key) for key in data.keys() - known - UNSUPPORTED_VLLM_FIELDS.keys())
            if unknown:
                logger.warning("The following fields were present in the request but ignored: %s", unknown)
        return data


class SamplingExtras(RequestModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras).

    Unknown fields are kept (`model_extra`) so the handlers can refuse vLLM's unsupported ones.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's: token ids of the prompt and of each choice in the response
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: the last max_model_len
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first k instead
    prompt_logprobs: int | None = None
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: SamplingParams.extra_args, for custom processors
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams as an object
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only under the same salt
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:N"
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority
    use_beam_search: bool = False  # vLLM's: the n best beams (beam width n) instead of n samples
    length_penalty: float = 1.0  # vLLM's: beams ranked by cumulative logprob / length**length_penalty


# ---- completions -------------------------------------------------------------------------------


class CompletionRequest(SamplingExtras):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # vLLM's: text, json_object or json_schema


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob in prompt_logprobs: -inf is sent as -9999.0 (JSON has no infinity)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position: token id -> its Logprob; the first position has none (nothing predicts it).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- chat --------------------------------------------------------------------------------------


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, rendered by the template
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(SamplingExtras):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last message (a prefill)
    echo: bool = False  # vLLM's: the reply starts with the last message when it has the reply's role
    chat_template: str | None = None  # vLLM's: refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the response
    parallel_tool_calls: bool | None = True  # false: at most one call per choice


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI's shape, [] as vLLM sends
    reasoning: str | None = None  # vLLM's (--reasoning-parser)
    reasoning_content: str | None = None  # the same, under the name older vLLM and clients read


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its index in the message's calls
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenization ------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # as on /v1/chat/completions (enable_thinking...)
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as vLLM's /tokenize


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
