"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvllm.engine.async_llm import RequestStream
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from kvllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningStream
from kvllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_valid_unicode,
    final_output,
    log_client_left,
    logprob_token,
    merge_streams,
    message_text,
    prompt_logprobs_body,
    sse,
    stream_error_event,
    usage_info,
)
from kvllm.entrypoints.openai.tool_calling import ToolCallStream, ToolPlan, extract, plan_tools
from kvllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint: chat template, validation, and OpenAI's chat response and chunk shapes."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A ChatCompletionResponse, or (stream=True) an iterator of server-sent events ending in [DONE]."""
        check_valid_unicode(request)
        self.check_model(request.model)
        self.check_unsupported(request)
        self.check_limits(request)
        tools = plan_tools(
            request.tools,
            request.tool_choice,
            self.chat_defaults,
            self.tokenizer,
            has_other_constraint=request.structured_outputs is not None
            or (request.response_format or {}).get("type", "text") != "text",
            parallel_tool_calls=request.parallel_tool_calls is not False,
        )
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_logprobs(request.top_logprobs, "top_logprobs")
        template = self.chat_template(request.chat_template, request.chat_template_kwargs)
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:  # vLLM's mapping onto the template's variables
            template_kwargs.setdefault("reasoning_effort", request.reasoning_effort)
            template_kwargs.setdefault("enable_thinking", request.reasoning_effort != "none")
        prompt_ids = await self.in_tokenizer_thread(
            self.render_chat,
            request.messages,
            request.add_generation_prompt,
            template_kwargs,
            template,
            tools.template_tools,
            request.continue_final_message,
        )
        prompt_ids = self.truncate(prompt_ids, request)
        self.check_prompt_ids(prompt_ids, "messages")
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested, None, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        if tools.constraint is not None:
            params = params.replace(structured_outputs=tools.constraint)
        if tools.parser is not None and not tools.parser.skip_special_tokens:
            params = params.replace(skip_special_tokens=False)  # the parser's markers are special tokens
        if request.echo and request.prompt_logprobs is None and request.top_logprobs is not None:
            if not request.stream:  # vLLM's rule: an echoed prompt gets top_logprobs prompt logprobs
                params = params.replace(prompt_logprobs=request.top_logprobs)
        self.check_generation_budget([params])
        request_id = random_id("chatcmpl")
        role = self.reply_role(request)
        if request.use_beam_search:
            return await self._beam_search(request, request_id, prompt_ids, max_tokens, tools, role)
        streams = await self.add_requests(
            request_id,
            [({"prompt_token_ids": prompt_ids, "cache_salt": request.cache_salt}, params)],
            request.priority,
        )
        echoed = _echoed(request, role)
        if request.stream:
            return self._stream(request, request_id, streams[0], echoed, len(prompt_ids), tools, role)
        final = await final_output(streams[0])
        choices = []
        parser = self._reasoning_parser()
        for c in final.outputs:
            reasoning, text = parser.split(c.text, True) if parser is not None else ("", c.text)
            called = extract(tools, text)
            content = echoed + text if not called.tools_called else called.content
            shown = reasoning if reasoning and request.include_reasoning else None
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        role=role,
                        content=content if content or not reasoning else None,
                        tool_calls=[t.to_openai() for t in called.tool_calls],
                        reasoning=shown,
                        reasoning_content=shown,
                    ),
                    logprobs=self._logprobs(request, c, 0, len(c.token_ids)),
                    finish_reason="tool_calls" if called.tools_called else c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=self.with_prompt_details(_usage(final), final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
        )

    async def _beam_search(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        tools: ToolPlan,
        role: str,
    ) -> ChatCompletionResponse:
        """use_beam_search: the n best beams as n choices, best first (the reasoning parser applies)."""
        refused = {
            "echo": request.echo,
            "logprobs": request.logprobs,
            "tools": tools.constraint is not None or tools.parses_output,
            "response_format": (request.response_format or {}).get("type", "text") != "text",
        }
        params = self.beam_search_params(request, max_tokens, refused)
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": request.cache_salt}
        beams = await self.beam_search(request_id, prompt, params, request.priority)
        parser = self._reasoning_parser()
        choices, completion_tokens = [], 0
        for j, beam in enumerate(beams):
            generated = beam.tokens[len(prompt_ids) :]
            completion_tokens += len(generated)
            text = await self.in_tokenizer_thread(
                self.tokenizer.decode, generated, skip_special_tokens=request.skip_special_tokens
            )
            reasoning, text = parser.split(text, True) if parser is not None else ("", text)
            shown = reasoning if reasoning and request.include_reasoning else None
            choices.append(
                ChatCompletionChoice(
                    index=j,
                    message=ChatResponseMessage(
                        role=role, content=text, reasoning=shown, reasoning_content=shown
                    ),
                    finish_reason=beam.finish_reason,
                    token_ids=generated if request.return_token_ids else None,
                )
            )
        usage = usage_info(len(prompt_ids), completion_tokens)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
        )

    def _reasoning_parser(self) -> ReasoningParser | None:
        name = self.chat_defaults.reasoning_parser
        return REASONING_PARSERS[name]() if name else None

    def _logprobs(
        self, request: ChatCompletionRequest, c: CompletionOutput, start: int, end: int
    ) -> ChatChoiceLogProbs | None:
        if not request.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(
            c.token_ids[start:end],
            c.logprobs[start:end],
            request.top_logprobs or 0,
            self.as_token_ids(request),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: RequestStream,
        echoed: str,
        num_prompt_tokens: int,
        tools: ToolPlan,
        role: str,
    ) -> AsyncIterator[str]:
        include_usage, continuous_usage = self.stream_usage(request.stream_options)

        def chunk(
            choices: list[ChatCompletionStreamChoice],
            usage: UsageInfo | None = None,
            completion_tokens: int = 0,
        ) -> str:
            if usage is None and continuous_usage and choices:
                usage = usage_info(num_prompt_tokens, completion_tokens)
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, model=self.model_name, choices=choices, usage=usage
                )
            )

        n = request.n
        sent_text, sent_tokens, finished = [0] * n, [0] * n, [False] * n
        tool_streams = [ToolCallStream(tools) for _ in range(n)] if tools.parses_output else None
        parser = self._reasoning_parser()
        reasoning_streams = [ReasoningStream(parser) for _ in range(n)] if parser is not None else None
        sent_content = [0] * n
        last: RequestOutput | None = None
        try:
            for i in range(n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))])
            if echoed:
                for i in range(n):
                    yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echoed))])
            async for _, last in merge_streams([stream]):
                for c in last.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    done = c.finish_reason is not None
                    reasoning, full = "", c.text
                    if reasoning_streams is not None:
                        reasoning, full = reasoning_streams[i].feed(c.text, done)
                        reasoning = reasoning if request.include_reasoning else ""
                    text = full[sent_content[i] :]
                    sent_content[i] = max(sent_content[i], len(full))
                    finish_reason = c.finish_reason
                    tool_deltas = None
                    if tool_streams is not None:
                        text, tool_deltas = tool_streams[i].delta(full, done)
                        if tool_deltas:
                            finish_reason = "tool_calls"
                    new_tokens = len(c.token_ids) > sent_tokens[i]
                    wants_tokens = request.logprobs or request.return_token_ids
                    if not text and not reasoning and not done and not (wants_tokens and new_tokens):
                        continue
                    choice = ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(
                            content=text or None,
                            tool_calls=tool_deltas,
                            reasoning=reasoning or None,
                            reasoning_content=reasoning or None,
                        ),
                        logprobs=self._logprobs(request, c, sent_tokens[i], len(c.token_ids)),
                        finish_reason=finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids[sent_tokens[i] :] if request.return_token_ids else None,
                    )
                    sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    finished[i] = c.finish_reason is not None
                    yield chunk([choice], completion_tokens=sent_tokens[i])
            if last is not None and include_usage:
                yield chunk([], self.with_prompt_details(_usage(last), last.num_cached_tokens))
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield stream_error_event(exc)
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
            log_client_left(request_id)
            raise
        finally:
            stream.close()


def _echoed(request: ChatCompletionRequest, role: str) -> str:
    """What echo=true puts before each reply: the last message, when it has the reply's `role`."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    return message_text(last) if last.role == role else ""


def _usage(output: RequestOutput) -> UsageInfo:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], k: int, as_token_ids: bool = False
) -> ChatChoiceLogProbs:
    """OpenAI's chat logprobs: per token, its logprob and the k most likely alternatives by rank (tokens
    as "token_id:N" with vLLM's return_tokens_as_token_ids, bytes those of the string sent, as vLLM)."""
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = logprob_token(token_id, position[token_id], as_token_ids)
        top = sorted(
            ((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k),
            key=lambda item: item[1].rank or 0,
        )
        content.append(
            ChatLogProbsContent(
                token=sampled,
                logprob=position[token_id].logprob,
                bytes=list(sampled.encode()),
                top_logprobs=[
                    ChatLogProb(
                        token=(token := logprob_token(tid, lp, as_token_ids)),
                        logprob=lp.logprob,
                        bytes=list(token.encode()),
                    )
                    for tid, lp in top
                ],
            )
        )
    return ChatChoiceLogProbs(content=content)
