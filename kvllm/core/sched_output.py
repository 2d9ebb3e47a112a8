"""SchedulerOutput: the one message from the scheduler to the worker, once per step.

It carries live Request objects in step order, and tells the worker what changed since the previous
step: requests finished or aborted since then (`finished_req_ids`) and requests preempted now
(`preempted`) lose their state; a scheduled request the worker does not know joins, and the worker
reads its tokens and parameters once; `block_ids` is the request's whole block list (the KV-cache
manager's own list, not a copy), of which the worker takes the new tail. Only the engine, the
scheduler and the worker's input batch know this shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvllm.core.request import Request


@dataclass
class ScheduledRequest:
    """A request's part of the step: its next `num_new_tokens` tokens, over its blocks.

    With speculative decoding a decode's tokens are its last token followed by `spec_token_ids`,
    drafts to verify (num_new_tokens = 1 + len(spec_token_ids)); they are not the request's tokens
    until accepted."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's work: decodes (one new token each) first, then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    # Finished with finish_reason "error": they need more blocks than the whole cache holds.
    failed: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
