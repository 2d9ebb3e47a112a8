"""Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request, RequestStatus
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """First come, first served (policy "fcfs"), or by priority ("priority": vLLM's order, a request's
    priority then its arrival, lower first). Each step:

    1. running requests, first in that order first, each get their remaining tokens up to the step's
       token budget (a decode needs one); when blocks run out, the last running request in that
       order (the newest, or the lowest priority) is preempted (its blocks freed, its tokens
       recomputed later) until the earlier one fits;
    2. waiting requests, in that order, are admitted while budget, `max_num_seqs` and free
       blocks allow, their cached prefix taken from the prefix cache; a prompt longer than the
       budget is chunked over several steps unless chunked prefill is off.

    Under "priority" both queues are kept sorted by (priority, arrival time), so the victims of
    step 1 are always behind the request being scheduled, as under "fcfs".

    No livelock: a request alone always fits the cache once every other request is preempted or
    finished, except one whose tokens need more blocks than the whole cache; that one is failed
    (finish_reason "error") instead of waiting forever in front of the queue. The engine refuses a
    cache smaller than one max_model_len request at start-up, so this only guards the invariant.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy {policy!r} is not valid; allowed: fcfs, priority")
        self.by_priority = policy == "priority"
        self.kv = kv_cache_manager
        # Slots beyond a request's scheduled tokens where a draft model writes its drafts' K/V.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the worker

    # ---- bookkeeping -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.queued_time = time.monotonic()
        self._enqueue(self.waiting, request)

    def _enqueue(self, queue: deque[Request] | list[Request], request: Request, front: bool = False) -> None:
        """Put `request` in `queue`: at the end (`front`: at the start, a preempted request), or under
        "priority" in its (priority, arrival) place, first (`front`) or last among equals."""
        if self.by_priority:
            insort = bisect.insort_left if front else bisect.insort_right
            insort(queue, request, key=_priority_order)
        elif front:
            queue.insert(0, request)
        else:
            queue.append(request)

    def finish_request(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's work. Counts are advanced here, at schedule time: a scheduled chunk counts as
        computed, and a chunk that reaches the request's end leaves a placeholder for the token it
        will sample (`num_output_placeholders`), which the engine fills when the step's result
        arrives. With overlapped scheduling that is after the next step was scheduled: a request
        whose last token is in flight is scheduled again on that token (the worker reads its id on
        the device), except when the in-flight token is certain to end it (`max_tokens`)."""
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        block_size = self.kv.block_size

        # The tokens the whole cache holds: a request with more can never run (see _can_never_fit).
        cache_tokens = self.kv.num_blocks * block_size
        lookahead = self.num_lookahead_tokens
        req_blocks = self.kv.req_blocks
        to_advance: list[ScheduledRequest] = []  # items whose counts the loop at the end advances
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_output_placeholders
            num_tokens = len(request.all_token_ids)
            if num_tokens + pending > cache_tokens:
                if not pending:
                    self._fail(request, out)  # leaves self.running: i is the next request now
                else:
                    i += 1  # failed once its tokens in flight arrive, as without overlap
                continue
            if pending and len(request.output_token_ids) + pending >= request.max_tokens:
                i += 1  # its last token is already being sampled
                continue
            computed = request.num_computed_tokens
            n = min(num_tokens + pending - computed, budget)
            drafts = request.spec_token_ids
            if drafts:  # a decode verifies its drafts as extra query tokens, as the budget allows
                request.spec_token_ids = []
                drafts = drafts[: budget - 1] if n == 1 and not pending else []
                n += len(drafts)
            blocks = req_blocks.get(request.request_id, ())
            end = computed + n
            # Decode fast path: the slot exists and no block becomes full (nothing to allocate or
            # hash), and the step samples its next token (the counts the loop below would advance).
            if n == 1 and end + lookahead <= len(blocks) * block_size and end % block_size:
                decodes.append(ScheduledRequest(request, 1, blocks, drafts))
                request.num_computed_tokens = end
                if end == num_tokens + pending:
                    request.num_output_placeholders = pending + 1
                budget -= 1
                i += 1
                continue
            if drafts and not self.kv.can_allocate(request, n):
                n, drafts = n - len(drafts), []  # drafts are not worth preempting for
            while not self.kv.can_allocate(request, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.kv.allocate(request, n + self._lookahead(request, n))
                item = ScheduledRequest(request, n, self.kv.get_block_ids(request.request_id), drafts)
                (decodes if n == 1 else prefills).append(item)
                to_advance.append(item)
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing older is left to shrink for

        compiling: list[Request] = []  # waiting on their grammar (vLLM's WAITING_FOR_FSM): skipped
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted while its last token was in flight: admitted once the token is known
            grammar = request.structured_output_request
            if grammar is not None and not grammar.is_ready():
                compiling.append(self.waiting.popleft())
                continue
            if grammar is not None and grammar.error is not None:
                self._fail(request, out, f"The request's structured output cannot be used: {grammar.error}")
                continue
            if self._can_never_fit(request):
                self._fail(request, out)
                continue
            # Prompt logprobs need logits at every prompt position, so such prompts are computed whole.
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            request.num_computed_tokens = num_cached_tokens
            if not self.kv.can_allocate(request, n, cached):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached_tokens)
                request.num_cached_prompt_tokens = num_cached_tokens
            self.kv.allocate(request, n + self._lookahead(request, n, cached), cached)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self._enqueue(self.running, request)
            item = ScheduledRequest(request, n, self.kv.get_block_ids(request.request_id))
            (decodes if n == 1 else prefills).append(item)
            to_advance.append(item)
            budget -= n

        self.waiting.extendleft(reversed(compiling))

        # Decodes first, as the attention backends expect; order is otherwise kept.
        out.scheduled = decodes + prefills
        for item in to_advance:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            num_known = request.num_tokens + request.num_output_placeholders + len(item.spec_token_ids)
            if request.num_computed_tokens == num_known:
                request.num_output_placeholders += 1
        if not out.scheduled:
            # An empty step is not run, so the worker hears of these with the next one.
            self.finished_req_ids |= out.finished_req_ids
            self.finished_req_ids.update(r.request_id for r in out.preempted)
        return out

    def has_work_beyond_in_flight(self) -> bool:
        """Whether a step could be scheduled now: a waiting request, or a running one whose tokens in
        flight do not already take it to max_tokens."""
        if self.waiting:
            return True
        return any(
            not r.num_output_placeholders or r.num_output_tokens + r.num_output_placeholders < r.max_tokens
            for r in self.running
        )

    def _lookahead(self, request: Request, n: int, cached: list[int] = ()) -> int:
        """Lookahead slots to allocate with the request's n tokens: all of them when the cache has room
        (never preempting for them), within max_model_len's worth of blocks."""
        extra = self.num_lookahead_tokens
        if extra and self.max_model_len is not None:
            extra = max(0, min(extra, self.max_model_len - request.num_computed_tokens - n))
        if extra and self.kv.can_allocate(request, n + extra, cached):
            return extra
        return 0

    def _can_never_fit(self, request: Request) -> bool:
        """More tokens (counting those in flight) than the whole KV cache holds."""
        return (
            self.kv.blocks_needed(request.num_tokens + request.num_output_placeholders) > self.kv.num_blocks
        )

    def _fail(self, request: Request, out: SchedulerOutput, reason: str | None = None) -> None:
        num_tokens = request.num_tokens
        needed = self.kv.blocks_needed(num_tokens)
        request.finish_reason = "error"
        request.stop_reason = reason or (
            f"The request has {num_tokens} tokens, which need {needed} KV blocks, but the whole KV "
            f"cache has {self.kv.num_blocks} blocks ({self.kv.num_blocks * self.kv.block_size} tokens); it "
            "can never run. Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
        )
        self.finish_request(request)
        out.failed.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, request, front=True)

    def reject_drafts(self, request: Request, num_rejected: int) -> None:
        """Roll back the KV positions of a request's rejected drafts: they count as not computed, so the
        next step's tokens overwrite their slots (the blocks stay with the request, which needs them
        for those tokens; all of them return to the pool when it finishes)."""
        if not request.is_finished:
            request.num_computed_tokens -= num_rejected

    def finish_requests(self, requests: Iterable[Request]) -> None:
        """Free the requests the output side finished (stop, EOS, length) after a step."""
        for request in requests:
            self.finish_request(request)


def _priority_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
