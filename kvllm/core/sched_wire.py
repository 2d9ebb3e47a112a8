"""The scheduler's message on its way to worker processes: SchedulerOutput, sent as what changed.

A worker in another process cannot read the engine's live Request objects, so the driver encodes
each step (`SchedulerOutputEncoder`) and every worker decodes it back into a SchedulerOutput over its
own copies (`SchedulerOutputDecoder`). A request travels whole once, when a worker does not know it
(the first step it is scheduled in, and again after a preemption), stripped of what only the engine
reads (grammar matchers, logprobs, block hashes); later steps carry its id, token count and the
blocks allocated since. The worker reads a known request's tokens and parameters only when it joins
(see SchedulerOutput), so its copy needs no update.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from kvllm.core.request import Request
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput


@dataclass
class WireScheduledRequest:
    """One ScheduledRequest: the whole request when the worker does not know it, else its id."""

    request_id: str
    num_new_tokens: int
    new_block_ids: list[int]  # blocks allocated since the worker last heard of the request
    request: Request | None = None
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class WireSchedulerOutput:
    scheduled: list[WireScheduledRequest]
    preempted_ids: list[str]
    finished_req_ids: set[str]


def _slim_copy(request: Request) -> Request:
    """The request as a worker needs it: tokens, parameters, seed (its generator is made worker-side)."""
    out = copy.copy(request)
    out.all_token_ids = list(request.all_token_ids)
    out.output_token_ids = list(request.output_token_ids)
    out.structured_output_request = None
    out.generator = None
    out.logprobs = []
    out.prompt_logprobs = [None]
    out.block_hashes = []
    out.pooled_data = None
    out.spec_token_ids = []
    return out


class SchedulerOutputEncoder:
    """Driver side: turns each step's SchedulerOutput into a WireSchedulerOutput."""

    def __init__(self) -> None:
        self._blocks_sent: dict[str, int] = {}  # request id -> block ids the workers have

    def encode(self, plan: SchedulerOutput) -> WireSchedulerOutput:
        sent = self._blocks_sent
        preempted = [request.request_id for request in plan.preempted]
        for req_id in (*plan.finished_req_ids, *preempted):
            sent.pop(req_id, None)
        scheduled = []
        for item in plan.scheduled:
            req_id = item.request.request_id
            known = sent.get(req_id)
            scheduled.append(
                WireScheduledRequest(
                    req_id,
                    item.num_new_tokens,
                    item.block_ids[known or 0 :],
                    None if known is not None else _slim_copy(item.request),
                    list(item.spec_token_ids),
                )
            )
            sent[req_id] = len(item.block_ids)
        return WireSchedulerOutput(scheduled, preempted, set(plan.finished_req_ids))


class SchedulerOutputDecoder:
    """Worker side: rebuilds the SchedulerOutput of each step over this process's request copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}
        # Seeded requests' generators live here from their first step to their end, across
        # preemptions (a preempted request continues its random stream where it left it).
        self._generators: dict[str, torch.Generator] = {}

    def decode(self, wire: WireSchedulerOutput) -> SchedulerOutput:
        preempted = []
        for req_id in wire.preempted_ids:
            request = self._requests.pop(req_id, None)
            self._blocks.pop(req_id, None)
            if request is not None:
                preempted.append(request)
        for req_id in wire.finished_req_ids:
            self._requests.pop(req_id, None)
            self._blocks.pop(req_id, None)
            self._generators.pop(req_id, None)
        scheduled = []
        for item in wire.scheduled:
            if item.request is not None:
                request = item.request
                seed = request.sampling_params.seed
                if seed is not None:
                    generator = self._generators.get(item.request_id)
                    if generator is None:
                        generator = torch.Generator(self.device).manual_seed(seed)
                        self._generators[item.request_id] = generator
                    request.generator = generator
                self._requests[item.request_id] = request
                self._blocks[item.request_id] = list(item.new_block_ids)
            else:
                request = self._requests[item.request_id]
                self._blocks[item.request_id] += item.new_block_ids
            scheduled.append(
                ScheduledRequest(
                    request, item.num_new_tokens, self._blocks[item.request_id], item.spec_token_ids
                )
            )
        return SchedulerOutput(
            scheduled=scheduled, preempted=preempted, finished_req_ids=wire.finished_req_ids
        )
