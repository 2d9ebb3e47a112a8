"""POST /v1/embeddings: texts or token ids (one or many) to embeddings, for a pooling model.

Each input is one engine request with PoolingParams (one prefill, pooled); the response keeps input
order. A model served with --runner generate has no embeddings (404, as vLLM registers no route then).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from kvllm.engine.input_processor import truncate_prompt
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import random_id
from kvllm.entrypoints.openai.protocol_embedding import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EmbeddingUsage,
)
from kvllm.entrypoints.openai.serving_engine import OpenAIServing
from kvllm.outputs import PoolingRequestOutput
from kvllm.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


class OpenAIServingEmbedding(OpenAIServing):
    """The embeddings endpoint: validation, one pooling request per input, OpenAI's response shape."""

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(request.model)
        if not self.llm.engine.model_config.is_pooling:
            raise OpenAIError(
                "The model does not support the Embeddings API: it is served with --runner generate. Serve "
                "an embedding model, or convert this one with --runner pooling (--convert embed)",
                404,
            )
        if request.use_activation is not None and request.normalize is not None:
            raise OpenAIError(
                "use_activation and normalize are the same setting; send one", param="normalize"
            )
        use_activation = request.use_activation if request.use_activation is not None else request.normalize
        try:
            params = PoolingParams(dimensions=request.dimensions, use_activation=use_activation)
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None
        inputs = await self.in_tokenizer_thread(self._tokenize, request)
        if len(inputs) > MAX_INPUTS:
            raise OpenAIError(f"input has {len(inputs)} items; allowed: at most {MAX_INPUTS}", param="input")
        request_id = random_id("embd")
        streams = await self.add_requests(
            request_id, [(prompt, params) for prompt in inputs], request.priority
        )
        try:
            finals = await asyncio.gather(*(_final(stream) for stream in streams))
        finally:
            for stream in streams:
                stream.close()
        data, num_prompt_tokens = [], 0
        for i, final in enumerate(finals):
            vector = final.outputs.data.numpy().astype(np.float32)
            num_prompt_tokens += len(final.prompt_token_ids)
            embedding: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                if request.encoding_format == "base64"
                else vector.tolist()
            )
            data.append(EmbeddingResponseData(index=i, embedding=embedding))
        usage = EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
        return EmbeddingResponse(id=request_id, model=self.model_name, data=data, usage=usage)

    def _tokenize(self, request: EmbeddingRequest) -> list[dict[str, Any]]:
        """One engine prompt (token ids) per input; CPU-heavy, runs in the tokenizer thread."""
        value = request.input
        if isinstance(value, str):
            texts: list[str] | None = [value]
        elif value and all(isinstance(v, str) for v in value):
            texts = list(value)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            id_lists = [
                self.tokenizer(t, add_special_tokens=request.add_special_tokens).input_ids for t in texts
            ]
        elif not value:
            raise OpenAIError(
                "input is empty; allowed: a string, a list of strings or token ids", param="input"
            )
        elif all(isinstance(v, int) for v in value):
            id_lists = [list(value)]  # type: ignore[arg-type]
        else:
            id_lists = [list(v) for v in value]  # type: ignore[union-attr]
        prompts = []
        for i, ids in enumerate(id_lists):
            if not ids:
                raise OpenAIError(f"input[{i}] is empty: at least one token is needed", param="input")
            if request.truncate_prompt_tokens is not None:
                try:
                    ids = truncate_prompt(ids, request.truncate_prompt_tokens, self.max_model_len)
                except ValueError as exc:
                    raise OpenAIError.bad_request(exc) from None
            if len(ids) > self.max_model_len:
                raise OpenAIError(
                    f"input[{i}] is {len(ids)} tokens long, more than this model's maximum context length "
                    f"of {self.max_model_len} tokens; shorten it or set truncate_prompt_tokens",
                    param="input",
                )
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if texts is not None:
                prompt["prompt"] = texts[i]
            prompts.append(prompt)
        return prompts


async def _final(stream: Any) -> PoolingRequestOutput:
    final = None
    async for output in stream:
        final = output
    if not isinstance(final, PoolingRequestOutput):  # aborted: the client left or the server stops
        raise OpenAIError("The request was aborted before its embedding was computed", 503)
    return final
