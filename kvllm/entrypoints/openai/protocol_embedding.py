"""Pydantic models of POST /v1/embeddings (OpenAI's shapes, plus vLLM's extras)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from kvllm.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request; vLLM's extras: truncate_prompt_tokens, add_special_tokens,
    use_activation (normalize; `normalize` is its older name)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority
    use_activation: bool | None = None
    normalize: bool | None = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI's encoding_format


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage
