"""Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request, RequestStatus
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """First come, first served. Each step:

    1. running requests, oldest first, each get their remaining tokens up to the step's token
       budget (a decode needs one); when blocks run out, the newest running request is
       preempted (its blocks freed, its tokens recomputed later) until the older one fits;
    2. waiting requests, oldest first, are admitted while budget, `max_num_seqs` and free
       blocks allow, their cached prefix taken from the prefix cache; a prompt longer than the
       budget is chunked over several steps unless chunked prefill is off.

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
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- bookkeeping -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv.free(request)

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        num_new: dict[int, int] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._fail_if_it_can_never_fit(request, out):
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.can_allocate(request, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.kv.allocate(request, n)
                scheduled.append(request)
                num_new[id(request)] = n
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing older is left to shrink for

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            if self._fail_if_it_can_never_fit(request, out):
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
            self.kv.allocate(request, n, cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_new[id(request)] = n
            budget -= n

        # Decodes first, as the attention backends expect; order is otherwise kept.
        scheduled.sort(key=lambda r: num_new[id(r)] != 1)
        out.scheduled = [
            ScheduledRequest(r, num_new[id(r)], self.kv.get_block_ids(r.request_id)) for r in scheduled
        ]
        return out

    def _fail_if_it_can_never_fit(self, request: Request, out: SchedulerOutput) -> bool:
        needed = self.kv.blocks_needed(request.num_tokens)
        if needed <= self.kv.num_blocks:
            return False
        request.finish_reason = "error"
        request.stop_reason = (
            f"The request has {request.num_tokens} tokens, which need {needed} KV blocks, but the whole KV "
            f"cache has {self.kv.num_blocks} blocks ({self.kv.num_blocks * self.kv.block_size} tokens); it "
            "can never run. Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
        )
        self.finish_request(request)
        out.failed.append(request)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, output: SchedulerOutput, finished: Iterable[Request] = ()) -> None:
        """Advance computed-token counts once the step's forward pass has run; free what finished."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for request in finished:
            self.finish_request(request)
