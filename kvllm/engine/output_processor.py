"""OutputProcessor: a step's sampled tokens become RequestOutputs.

It appends each token, detokenizes incrementally, checks stop tokens, EOS, stop strings,
max_tokens and max_model_len, records logprobs and prompt logprobs, and builds the cumulative
RequestOutput of every request the step touched. It tells the engine which sequences finished;
freeing their KV blocks is the scheduler's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvllm.core.request import Request
from kvllm.engine.detokenizer import IncrementalDetokenizer
from kvllm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestOutput,
    decode_logprobs,
)
from kvllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from kvllm.core.sched_output import SchedulerOutput
    from kvllm.core.step_result import StepResult


@dataclass
class SequenceState:
    """Output-side state of one generated sequence: the request plus its text.

    Text arrives as pieces (O(1) per token); `text` joins them when an output needs it.
    `num_reported_tokens` / `_unreported` serve DELTA outputs: what was not reported yet.
    """

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    # The request's stop conditions, read once (the per-token checks touch only these):
    stop_token_ids: frozenset[int] = frozenset()
    may_stop_ids: frozenset[int] = frozenset()  # stop_token_ids, and the EOS ids unless ignore_eos
    min_tokens: int = 0
    detokenize: bool = True
    # No text, no grammar, no logprobs: a token is appended and checked against the ids and lengths.
    token_only: bool = False
    # Text wanted once, at the end (FINAL_ONLY), and no stop string to watch: the ids are held and
    # detokenized in one pass when the sequence finishes, not one call per token per step.
    final_text_only: bool = False
    held_ids: list[int] = field(default_factory=list)
    _text: str = ""
    _pieces: list[str] = field(default_factory=list)
    _unreported: list[str] = field(default_factory=list)
    num_reported_tokens: int = 0

    def add_text(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._unreported.append(piece)

    def release_held_ids(self, stop_terminated: bool = False, finished: bool = False) -> None:
        """Detokenize the ids `final_text_only` held (the last one a stop or EOS token when
        `stop_terminated`), as the per-token updates would have, in one call; `finished`: the sequence
        ends here, so the detokenizer finishes too (in one decode where it can)."""
        if self.held_ids:
            held, self.held_ids = self.held_ids, []
            if finished:
                self.detokenizer.finish_with(held, stop_terminated=stop_terminated)
            else:
                self.detokenizer.update(held, stop_terminated=stop_terminated)
            self.add_text(self.detokenizer.get_next_delta_text())

    @property
    def text(self) -> str:
        self.release_held_ids()
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    def take_unreported_text(self) -> str:
        text = "".join(self._unreported)
        self._unreported.clear()
        return text


@dataclass
class ParentRequest:
    """A user's request: its n sequences, which share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState] = field(default_factory=list)

    # Whether each step that touches it reports an output (CUMULATIVE, DELTA), or only its end.
    streams: bool = True

    @property
    def finished(self) -> bool:
        if len(self.sequences) == 1:
            return self.sequences[0].request.finish_reason is not None
        return all(s.request.finish_reason is not None for s in self.sequences)

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.sequences[0].request.sampling_params.output_kind


class OutputProcessor:
    """Keeps the unfinished requests (`parents`, by the user's request id) and their outputs."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], requests: list[Request]
    ) -> None:
        parent = ParentRequest(request_id, prompt, prompt_token_ids)
        for request in requests:
            params = request.sampling_params
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            stop_ids = frozenset(params.stop_token_ids or ())
            may_stop = stop_ids if params.ignore_eos else stop_ids | frozenset(request.eos_token_ids)
            parent.sequences.append(
                SequenceState(
                    request.index,
                    request,
                    detokenizer,
                    stop_token_ids=stop_ids,
                    may_stop_ids=may_stop,
                    min_tokens=params.min_tokens,
                    detokenize=params.detokenize,
                    token_only=(
                        not params.detokenize
                        and params.logprobs is None
                        and request.structured_output_request is None
                    ),
                    final_text_only=(
                        params.detokenize
                        and not params.stop
                        and params.output_kind is RequestOutputKind.FINAL_ONLY
                    ),
                )
            )
        parent.streams = parent.output_kind is not RequestOutputKind.FINAL_ONLY
        self.parents[request_id] = parent

    def process_failed(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Outputs for the requests the scheduler failed (finish_reason "error"), reported at once."""
        return self._collect_outputs({r.parent_id: self.parents[r.parent_id] for r in plan.failed})

    def accept_grammar_tokens(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Advance the grammars of a finished step's constrained rows by their tokens, ahead of
        `process_step(..., grammar_accepted=True)`: the next step's masks need only this, so the rest
        of the step's output work (text, stops, outputs) can wait until that step is launched. The
        tokens accepted are those process_step appends (rows of requests not already finished); steps
        with verified drafts take the whole of process_step instead."""
        sampled = result.sampler_output
        if sampled is None:
            return
        scheduled = plan.scheduled
        for index, token_id in zip(result.request_indices, sampled.token_ids, strict=True):
            request = scheduled[index].request
            grammar = request.structured_output_request
            if grammar is not None and request.finish_reason is None:
                grammar.accept_token(token_id)

    def process_step(
        self, plan: SchedulerOutput, result: StepResult, grammar_accepted: bool = False
    ) -> tuple[list[RequestOutput], list[Request]]:
        """The outputs of the requests a finished step touched, and the sequences that finished in it.

        The step may have been launched before an earlier step's tokens ended some of its requests
        (overlapped scheduling): their tokens are dropped, and every sampled request's placeholder
        (see Scheduler.schedule) is resolved either way. `grammar_accepted`: accept_grammar_tokens
        already advanced the grammars by this step's tokens.
        """
        for index, (first_position, entries) in result.prompt_logprobs.items():
            self._record_prompt_logprobs(plan.scheduled[index].request, first_position, entries)
        if result.pooled:
            return self._process_pooled(plan, result.pooled)
        if result.sampler_output is None:
            return [], []
        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        finished: list[Request] = []
        sampled = result.sampler_output
        logprobs = sampled.sampled_logprobs
        top_logprobs = sampled.logprobs
        spec_runs = result.spec_token_ids
        scheduled = plan.scheduled
        parents = self.parents
        # One pass over the step's requests: this loop is the engine's per-request cost of a step.
        for row, (index, token_id) in enumerate(zip(result.request_indices, sampled.token_ids, strict=True)):
            request = scheduled[index].request
            request.num_output_placeholders -= 1  # its token arrived (appended, or dropped below)
            assert request.num_output_placeholders >= 0, f"{request.request_id}: no token was in flight"
            if request.finish_reason is not None:
                continue  # stopped or aborted after this step was launched
            parent = parents[request.parent_id]
            seq = parent.sequences[request.index]
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            run = spec_runs.get(index) if spec_runs else None
            if run is None and seq.token_only and top_logprobs[row] is None:
                # _append_token for a request that needs no text, grammar or logprobs, inlined: the
                # common case of a throughput run, where this loop is most of the engine's step.
                out_ids = request.output_token_ids
                out_ids.append(token_id)
                request.all_token_ids.append(token_id)
                if logprobs is not None and logprobs[row] is not None:
                    request.cumulative_logprob += logprobs[row]
                num_out = len(out_ids)
                if token_id in seq.may_stop_ids and num_out >= seq.min_tokens:
                    request.finish_reason = "stop"
                    request.stop_reason = token_id if token_id in seq.stop_token_ids else None
                elif num_out >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
                    request.finish_reason = "length"
                    request.stop_reason = None
            elif run is None:
                self._append_token(
                    seq,
                    token_id,
                    None if logprobs is None else logprobs[row],
                    top_logprobs[row],
                    accept_grammar=not grammar_accepted,
                )
            else:  # verified drafts (no logprobs: requests asking for them do not speculate)
                for draft_id in run:
                    self._append_token(seq, draft_id, None, None)
                    if request.finish_reason is not None:
                        break  # a stop inside the run: nothing after it is emitted
            if request.finish_reason is not None:
                finished.append(request)
                touched[parent.request_id] = parent
            elif parent.streams:
                touched[parent.request_id] = parent
        return self._collect_outputs(touched), finished

    def _process_pooled(
        self, plan: SchedulerOutput, pooled: dict[int, Any]
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[Request]]:
        """Pooling requests whose prompt ended in the step: their embedding ends them."""
        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        finished: list[Request] = []
        for index, vector in pooled.items():
            request = plan.scheduled[index].request
            request.resolve_placeholder()
            if request.finish_reason is not None:
                continue  # aborted after this step was launched
            request.pooled_data = vector
            request.first_token_time = request.last_token_time = now
            request.finish_reason = "stop"
            finished.append(request)
            touched[request.parent_id] = self.parents[request.parent_id]
        return self._collect_outputs(touched), finished

    def _collect_outputs(self, touched: dict[str, ParentRequest]) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            if parent.finished:
                outputs.append(self._make_output(parent, True))
                del self.parents[parent.request_id]
            elif parent.streams:
                outputs.append(self._make_output(parent, False))
        return outputs

    def _record_prompt_logprobs(
        self, request: Request, first_position: int, entries: list[PositionLogprobs]
    ) -> None:
        """Keep prompt logprobs in position order; a recompute after preemption repeats none."""
        recorded = request.prompt_logprobs
        for position, entry in enumerate(entries, start=first_position):
            if position == len(recorded):
                recorded.append(decode_logprobs(self.tokenizer, entry))

    def _append_token(
        self,
        seq: SequenceState,
        token_id: int,
        logprob: float | None,
        top_logprobs: PositionLogprobs | None,
        accept_grammar: bool = True,
    ) -> None:
        request = seq.request
        request.output_token_ids.append(token_id)  # Request.append_output_token, inlined
        request.all_token_ids.append(token_id)
        if accept_grammar and request.structured_output_request is not None:
            request.structured_output_request.accept_token(token_id)
        if logprob is not None:  # computed only for requests that report logprobs
            request.cumulative_logprob += logprob
        if top_logprobs is not None:
            request.logprobs.append(decode_logprobs(self.tokenizer, top_logprobs))
        num_out = len(request.output_token_ids)
        # A stop token ends the request without appearing in its text; it wins over EOS.
        stop_token = eos = False
        if token_id in seq.may_stop_ids and num_out >= seq.min_tokens:
            stop_token = token_id in seq.stop_token_ids
            eos = not stop_token
        stop_string = None
        if seq.final_text_only:
            seq.held_ids.append(token_id)
        elif seq.detokenize:
            stop_string = seq.detokenizer.update([token_id], stop_terminated=stop_token or eos)
        if stop_token:
            self._finish(seq, "stop", token_id)
        elif eos:
            self._finish(seq, "stop", None)
        elif stop_string is not None:
            self._finish(seq, "stop", stop_string)
        elif num_out >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)
        if seq.detokenize and not (seq.final_text_only and request.finish_reason is None):
            seq.add_text(seq.detokenizer.get_next_delta_text())

    def _finish(self, seq: SequenceState, reason: str, stop_reason: int | str | None) -> None:
        seq.request.finish_reason = reason
        seq.request.stop_reason = stop_reason
        if seq.request.sampling_params.detokenize:
            # Held ids end with the token that finished the sequence: a stop token or EOS when the reason
            # is "stop" (a sequence that holds its ids has no stop strings).
            seq.release_held_ids(stop_terminated=reason == "stop", finished=True)
            seq.detokenizer.finish()

    def _make_output(self, parent: ParentRequest, finished: bool) -> RequestOutput | PoolingRequestOutput:
        first = parent.sequences[0].request
        if first.pooling_params is not None:
            return PoolingRequestOutput(
                parent.request_id,
                PoolingOutput(first.pooled_data),
                parent.prompt_token_ids,
                first.num_cached_prompt_tokens,
                finished,
                _request_metrics(parent),
                prompt=parent.prompt,
            )
        delta = parent.output_kind is RequestOutputKind.DELTA
        outputs = []
        for seq in parent.sequences:
            r = seq.request
            wants_logprobs = r.sampling_params.logprobs is not None
            if delta:
                start = seq.num_reported_tokens
                seq.num_reported_tokens = r.num_output_tokens
                text, token_ids = seq.take_unreported_text(), r.output_token_ids[start:]
                logprobs = r.logprobs[start:] if wants_logprobs else None
            else:
                text, token_ids = seq.text, list(r.output_token_ids)
                logprobs = list(r.logprobs) if wants_logprobs else None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=r.cumulative_logprob if wants_logprobs else None,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        prompt_logprobs = first.prompt_logprobs if first.sampling_params.prompt_logprobs is not None else None
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            finished,
            _request_metrics(parent),
            prompt_logprobs=prompt_logprobs,
        )


def _request_metrics(parent: ParentRequest) -> dict[str, float]:
    """RequestOutput.metrics: the request's timestamps and token counts over its n sequences.

    Built for every request every step, so one sequence (the common case) takes a direct path.
    """
    first = parent.sequences[0].request
    if len(parent.sequences) == 1:
        total = longest = first.num_output_tokens
        queued, scheduled = first.queued_time, first.first_scheduled_time
        first_token, last_token = first.first_token_time, first.last_token_time
    else:
        requests = [seq.request for seq in parent.sequences]
        generated = [r.num_output_tokens for r in requests]
        total, longest = sum(generated), max(generated)
        queued = _known(min, [r.queued_time for r in requests])
        scheduled = _known(min, [r.first_scheduled_time for r in requests])
        first_token = _known(min, [r.first_token_time for r in requests])
        last_token = _known(max, [r.last_token_time for r in requests])
    metrics: dict[str, float] = {
        "arrival_time": first.arrival_time,
        "num_cached_tokens": first.num_cached_prompt_tokens,
        "num_generation_tokens": total,
        "max_num_generation_tokens": longest,
        "max_tokens": first.max_tokens,
    }
    if queued is not None:
        metrics["queued_time"] = queued
    if scheduled is not None:
        metrics["first_scheduled_time"] = scheduled
    if first_token is not None:
        metrics["first_token_time"] = first_token
    if last_token is not None:
        metrics["last_token_time"] = last_token
    return metrics


def _known(pick: Callable[[list[float]], float], values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return pick(known) if known else None
