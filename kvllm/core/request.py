"""A request (one sequence) as the scheduler and KV-cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    """One sequence to generate. Requests with n > 1 are fanned out into n of these.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the tokens still to run
    are `all_token_ids[num_computed_tokens:]` (the whole prompt after a preemption, since
    preemption recomputes).

    The `*_time` fields are time.monotonic() stamps of the request's life, from which the serving
    metrics take vLLM's intervals: queue (queued -> first scheduled), prefill (first scheduled ->
    first token), decode (first token -> last token), inference (first scheduled -> last token).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here
    eos_token_ids: tuple[int, ...]
    parent_id: str = ""  # the user's request id (several sequences share it when n > 1)
    index: int = 0  # which of the parent's n sequences this is
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose ids have not reached the host yet (see Scheduler.schedule).
    num_output_placeholders: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the first schedule
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, see KVCacheManager
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's): blocks are shared only under equal salts
    priority: int = 0  # with the priority scheduling policy: lower runs first (vLLM's)
    generator: torch.Generator | None = None
    # Draft tokens proposed for the next step (speculative decoding); the scheduler consumes them.
    spec_token_ids: list[int] = field(default_factory=list)
    queued_time: float | None = None  # when the scheduler took it
    first_scheduled_time: float | None = None  # kept across preemptions, as in vLLM
    first_token_time: float | None = None  # when the step that sampled its first token finished
    last_token_time: float | None = None  # when the step that sampled its latest token finished
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    # Entry i: logprobs of prompt token i given the tokens before it (entry 0 is None).
    prompt_logprobs: list = field(default_factory=lambda: [None])
    # Pooling runner: the request's PoolingParams, and its embedding once the prompt has run.
    pooling_params: Any = None
    pooled_data: Any = None
    # The grammar of params.structured_outputs (one per sequence: each has its own matcher).
    structured_output_request: StructuredOutputRequest | None = None
    all_token_ids: list[int] = field(init=False)  # prompt + output, kept in step with output_token_ids

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def resolve_placeholder(self) -> None:
        """A sampled token of this request reached the host (appended, or dropped after a stop)."""
        assert self.num_output_placeholders > 0, f"{self.request_id}: no token was in flight"
        self.num_output_placeholders -= 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
