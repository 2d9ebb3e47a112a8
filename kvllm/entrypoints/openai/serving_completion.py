"""POST /v1/completions: prompts (text or token ids, one or many) to completions, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvllm.engine.async_llm import RequestStream
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from kvllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_valid_unicode,
    log_client_left,
    logprob_token,
    merge_streams,
    prompt_logprobs_body,
    sse,
    stream_error_event,
    usage_info,
)
from kvllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvllm.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint: validation, fan-out over prompts, and OpenAI's response shapes."""

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A CompletionResponse, or (stream=True) an iterator of server-sent events ending in [DONE]."""
        check_valid_unicode(request)
        self.check_model(request.model)
        self.check_unsupported(request)
        self.check_limits(request, _num_prompts(request.prompt))
        if request.suffix:
            raise OpenAIError("suffix is not supported by this server; omit it", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(
                f"best_of={request.best_of} is not supported; allowed: omitted or equal to n ({request.n})",
                param="best_of",
            )
        self.check_logprobs(request.logprobs, "logprobs")
        requested = request.max_tokens if "max_tokens" in request.model_fields_set else None
        texts, prompts = [], []
        if request.echo or _has_text(request.prompt):
            parsed = await self.in_tokenizer_thread(self._parse_prompts, request)
        else:  # token ids only: nothing to wait for the tokenizer thread for
            parsed = self._parse_prompts(request)
        for text, ids in parsed:
            self.check_prompt_ids(ids, "prompt")
            max_tokens = self.resolve_max_tokens(len(ids), requested, DEFAULT_MAX_TOKENS, "prompt")
            params = self.sampling_params(request, max_tokens, request.logprobs)
            if request.echo and request.logprobs is not None and request.prompt_logprobs is None:
                params = params.replace(prompt_logprobs=request.logprobs)  # the echoed prompt's logprobs
            engine_prompt: dict[str, Any] = {"prompt_token_ids": ids, "cache_salt": request.cache_salt}
            if text is not None:
                engine_prompt["prompt"] = text
            texts.append(text)
            prompts.append((engine_prompt, params))
        self.check_generation_budget([params for _, params in prompts])
        request_id = random_id("cmpl")
        if request.use_beam_search:
            return await self._beam_search(request, request_id, prompts)
        streams = await self.add_requests(request_id, prompts, request.priority)
        if request.stream:
            return self._stream(request, request_id, streams, texts)
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in merge_streams(streams):
                finals[i] = output
        finally:
            for stream in streams:
                stream.close()
        choices, usage = [], UsageInfo()
        for i, final in enumerate(finals):
            assert final is not None  # every stream ends with a finished output
            usage.prompt_tokens += len(final.prompt_token_ids)
            for c in final.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(
                    self._choice(
                        request,
                        i,
                        final.prompt_token_ids,
                        c,
                        self._echo_text(request, texts[i]),
                        0,
                        len(c.token_ids),
                        prompt_logprobs=final.prompt_logprobs,
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        usage = self.with_prompt_details(usage, sum(f.num_cached_tokens for f in finals if f is not None))
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def _beam_search(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[tuple[dict[str, Any], SamplingParams]],
    ) -> CompletionResponse:
        """use_beam_search: per prompt, its n best beams as n choices, best first."""
        refused = {"echo": request.echo, "logprobs": request.logprobs is not None}
        searches = [
            self.beam_search(
                f"{request_id}-{i}",
                prompt,
                self.beam_search_params(request, params.max_tokens, refused),
                request.priority,
            )
            for i, (prompt, params) in enumerate(prompts)
        ]
        results = await asyncio.gather(*searches)
        choices, usage = [], UsageInfo()
        for i, ((prompt, _), beams) in enumerate(zip(prompts, results)):
            num_prompt = len(prompt["prompt_token_ids"])
            usage.prompt_tokens += num_prompt
            for j, beam in enumerate(beams):
                generated = beam.tokens[num_prompt:]
                usage.completion_tokens += len(generated)
                text = await self.in_tokenizer_thread(
                    self.tokenizer.decode, generated, skip_special_tokens=request.skip_special_tokens
                )
                choice = CompletionChoice(
                    index=i * request.n + j, text=text, finish_reason=beam.finish_reason
                )
                if request.return_token_ids:
                    choice.token_ids = generated
                    choice.prompt_token_ids = prompt["prompt_token_ids"] if j == 0 else None
                choices.append(choice)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    def _parse_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt, truncated as the request asks; token-id prompts (and truncated
        ones) get their text decoded when echoed.

        CPU-heavy: runs in the tokenizer thread.
        """
        parsed = self._tokenize_prompts(request.prompt, request.echo)
        if request.truncate_prompt_tokens is None:
            return parsed
        truncated = []
        for text, ids in parsed:
            kept = self.truncate(ids, request)
            if len(kept) < len(ids):
                text = self.tokenizer.decode(kept) if request.echo else None
            truncated.append((text, kept))
        return truncated

    def _tokenize_prompts(self, prompt: Any, echo: bool) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            return [(prompt, self.tokenizer(prompt).input_ids)]
        if not prompt:
            raise OpenAIError(
                "prompt is an empty list; allowed: a string, a list of strings, token ids, "
                "or a list of token-id lists",
                param="prompt",
            )
        if all(isinstance(p, str) for p in prompt):
            return [(p, self.tokenizer(p).input_ids) for p in prompt]
        id_lists = [list(prompt)] if all(isinstance(p, int) for p in prompt) else [list(p) for p in prompt]
        if not echo:
            return [(None, ids) for ids in id_lists]
        # Ids the tokenizer lacks decode to nothing (as in the detokenizer); the engine rejects bad ones.
        vocab_size = len(self.tokenizer)
        return [(self.tokenizer.decode([t for t in ids if 0 <= t < vocab_size]), ids) for ids in id_lists]

    def _echo_text(self, request: CompletionRequest, text: str | None) -> str:
        return (text or "") if request.echo else ""

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        prompt_token_ids: list[int],
        c: CompletionOutput,
        prefix: str,
        start: int,
        end: int,
        text_start: int = 0,
        offset: int = 0,
        prompt_logprobs: list[PositionLogprobs | None] | None = None,
    ) -> CompletionChoice:
        logprobs = None
        if request.logprobs is not None and c.logprobs is not None:
            echoed = None
            if prefix and prompt_logprobs is not None:
                echoed = self._prompt_part(
                    prompt_token_ids,
                    prompt_logprobs,
                    request.logprobs,
                    self.as_token_ids(request),
                )
                offset = len(prefix)
            logprobs = completion_logprobs(
                c.token_ids[start:end],
                c.logprobs[start:end],
                request.logprobs,
                offset,
                self.as_token_ids(request),
            )
            if echoed is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(echoed, name).extend(getattr(logprobs, name))
                logprobs = echoed
        choice = CompletionChoice(
            index=prompt_index * request.n + c.index,
            text=prefix + c.text[text_start:],
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=None if request.stream else prompt_logprobs_body(prompt_logprobs),
        )
        if request.return_token_ids:
            choice.token_ids = c.token_ids[start:end]
            if start == 0:
                choice.prompt_token_ids = prompt_token_ids
        return choice

    def _prompt_part(
        self, token_ids: list[int], positions: list[PositionLogprobs | None], k: int, as_token_ids: bool
    ) -> CompletionLogProbs:
        """The echoed prompt's logprobs; the first token has none (nothing predicts it)."""
        first = f"token_id:{token_ids[0]}" if as_token_ids else self.tokenizer.decode([token_ids[0]])
        out = completion_logprobs(token_ids[1:], positions[1:], k, len(first), as_token_ids)
        out.tokens.insert(0, first)
        out.token_logprobs.insert(0, None)
        out.top_logprobs.insert(0, None)
        out.text_offset.insert(0, 0)
        return out

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        streams: list[RequestStream],
        texts: list[str | None],
    ) -> AsyncIterator[str]:
        n = request.n
        include_usage, continuous_usage = self.stream_usage(request.stream_options)
        sent_text = [0] * (len(streams) * n)
        sent_tokens = [0] * (len(streams) * n)
        offsets = [0] * (len(streams) * n)
        finished = [False] * (len(streams) * n)
        last: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, output in merge_streams(streams):
                first = last[i] is None
                last[i] = output
                for c in output.outputs:
                    idx = i * n + c.index
                    prefix = self._echo_text(request, texts[i]) if first else ""
                    if finished[idx] or (
                        len(c.text) == sent_text[idx]
                        and len(c.token_ids) == sent_tokens[idx]
                        and c.finish_reason is None
                        and not prefix
                    ):
                        continue
                    choice = self._choice(
                        request,
                        i,
                        output.prompt_token_ids,
                        c,
                        prefix,
                        sent_tokens[idx],
                        len(c.token_ids),
                        sent_text[idx],
                        offsets[idx],
                        prompt_logprobs=output.prompt_logprobs,
                    )
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        offsets[idx] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                    sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
                    finished[idx] = c.finish_reason is not None
                    chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[choice])
                    if continuous_usage:
                        chunk.usage = usage_info(len(output.prompt_token_ids), len(c.token_ids))
                    yield sse(chunk)
            if include_usage:
                usage = self.with_prompt_details(
                    usage_info(
                        sum(len(o.prompt_token_ids) for o in last if o is not None),
                        sum(len(c.token_ids) for o in last if o is not None for c in o.outputs),
                    ),
                    sum(o.num_cached_tokens for o in last if o is not None),
                )
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage))
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield stream_error_event(exc)
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
            log_client_left(request_id)
            raise
        finally:
            for stream in streams:
                stream.close()


def _has_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], k: int, offset: int, as_token_ids: bool = False
) -> CompletionLogProbs:
    """OpenAI's completions logprobs: tokens, their logprobs, the top-k per position and text offsets
    (tokens as "token_id:N" with vLLM's return_tokens_as_token_ids, offsets then counted as vLLM does)."""
    out = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        token = logprob_token(token_id, position[token_id], as_token_ids)
        out.tokens.append(token)
        out.token_logprobs.append(position[token_id].logprob)
        out.top_logprobs.append(
            {
                logprob_token(tid, lp, as_token_ids): lp.logprob
                for tid, lp in position.items()
                if tid == token_id or (lp.rank is not None and lp.rank <= k)
            }
        )
        out.text_offset.append(offset)
        offset += len(token)
    return out
