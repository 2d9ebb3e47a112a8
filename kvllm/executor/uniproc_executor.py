"""UniProcExecutor: one worker, in the engine's own process."""

from __future__ import annotations

import torch

from kvllm.attention.metadata import KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.step_result import GrammarBitmaskFn, PendingStep, StepResult
from kvllm.executor.executor import Executor
from kvllm.models.model_config import ModelConfig
from kvllm.worker.sleep_mode import SleepState
from kvllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls its one Worker directly."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, device: torch.device, max_num_batched_tokens: int
    ) -> None:
        self.worker = Worker(args, model_config, device, max_num_batched_tokens)

    @property
    def block_size(self) -> int:
        return self.worker.model_runner.block_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.worker.model_runner.kv_cache_spec

    @property
    def attention_backend_name(self) -> str:
        return self.worker.model_runner.attn_backend.name

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        self.worker.initialize_kv_cache(num_blocks, max_num_reqs)

    @property
    def sleep_state(self) -> SleepState | None:
        return self.worker.model_runner.sleep_state

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self.worker.wake_up(tags)

    def execute_model(self, plan: SchedulerOutput) -> StepResult:
        return self.worker.execute_model(plan)

    def execute_model_async(
        self, plan: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStep:
        return self.worker.execute_model_async(plan, grammar_bitmask)
