"""Executor: what the engine asks of its workers, whatever process or device they run in."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvllm.attention.metadata import KVCacheSpec
    from kvllm.core.sched_output import SchedulerOutput
    from kvllm.core.step_result import GrammarBitmaskFn, PendingStep, StepResult
    from kvllm.worker.sleep_mode import SleepState


class Executor(ABC):
    """Sizes and allocates the KV cache on every worker and runs each step on them.

    The engine talks to this seam only: an executor with one worker per GPU (tensor parallel)
    answers the same calls, sending the step's SchedulerOutput to every worker and returning the
    sampled tokens of one of them.
    """

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Tokens per KV-cache block, as the attention backend chose it."""

    @property
    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """One layer's KV-cache page on a worker."""

    @property
    @abstractmethod
    def attention_backend_name(self) -> str: ...

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one KV block takes on a worker, all layers together."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker has room for."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        """Allocate `num_blocks` blocks of KV cache on every worker."""

    @property
    @abstractmethod
    def sleep_state(self) -> SleepState | None:
        """What is asleep (the same on every worker), or None while awake."""

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Free every worker's KV cache and (level 1) move the weights to host memory or (level 2)
        drop them; no step may be in flight."""

    @abstractmethod
    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Bring back what `tags` name ("weights", "kv_cache"; weights first) on every worker."""

    @abstractmethod
    def execute_model(self, plan: SchedulerOutput) -> StepResult:
        """Run one step; the sampled tokens of the requests that reached their last token."""

    @abstractmethod
    def execute_model_async(
        self, plan: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStep:
        """Launch one step and return at once; its `result()` waits for the sampled tokens.

        `grammar_bitmask` (structured outputs) is called with the positions in `plan.scheduled` of
        the rows that sample, after the forward pass is launched and before sampling: what it
        returns constrains those rows (see `kvllm.structured_output`)."""

    def shutdown(self) -> None:
        """Release the workers (processes, actors); nothing to do for an in-process worker."""
        return None
