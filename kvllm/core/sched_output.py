"""SchedulerOutput: the one message from the scheduler to the worker, once per step.

It carries live Request objects and each request's whole block list every step; the worker
reads token ids and computed-token counts from the requests. Only the engine, the scheduler and
the worker's input preparation know this shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvllm.core.request import Request


@dataclass
class ScheduledRequest:
    """A request's part of the step: its next `num_new_tokens` tokens, over its blocks."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    """One step's work: decodes (one new token each) first, then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Finished with finish_reason "error": they need more blocks than the whole cache holds.
    failed: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
