"""Worker: one device, its memory budget and KV-cache sizing, and the ModelRunner that computes on it."""

from __future__ import annotations

import gc
import logging

import torch

from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.step_result import GrammarBitmaskFn, PendingStep, StepResult
from kvllm.models.model_config import ModelConfig
from kvllm.platforms import current_device_info
from kvllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30


def device_memory_at_start(device: torch.device) -> tuple[int, int]:
    """(free bytes on the device, bytes this process's allocator holds) for a starting engine. Engines
    this process dropped go first (a reference cycle keeps one until the collector runs) and the
    allocator hands their cached blocks back: otherwise a second engine in one process (tests, notebooks)
    would count the first one's leftovers as memory others hold and refuse to start."""
    if device.type != "cuda":
        return 0, 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device)


DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB


def out_of_memory_error(
    stage: str, exc: BaseException, args: EngineArgs, model_config: ModelConfig
) -> ValueError:
    """A start-up out-of-memory error turned into one that names the settings that change memory use."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(
        f"Out of GPU memory while {stage} ({first_line}). The knobs: gpu_memory_utilization (now "
        f"{args.gpu_memory_utilization}; the fraction of GPU memory kvllm may use: lower it if other processes "
        f"share the GPU), max_model_len (now {model_config.max_model_len}) and max_num_seqs (now "
        f"{args.max_num_seqs}), which bound the KV cache and the profiling batch (with max_num_batched_tokens); "
        "kv_cache_memory_bytes sets the KV cache size directly. If the weights alone do not fit, use a smaller "
        "model or --dtype float16/bfloat16. (swap_space does not help: kvllm never swaps.)"
    )


class Worker:
    """Owns one device and the ModelRunner on it: loads the model, sizes and allocates the KV cache."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, device: torch.device, max_num_batched_tokens: int
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        # Measured before the weights arrive: what other processes (and other engines in this one) hold
        # is not ours to use. What this process's allocator holds already is not this engine's peak.
        self.free_memory_at_start, self.allocated_at_start = device_memory_at_start(device)
        self.model_runner = ModelRunner(
            args, model_config, device, current_device_info(), max_num_batched_tokens
        )
        try:
            self.model_runner.load_model()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error("loading the model weights", exc, args, model_config) from exc

    # ---- KV cache ----------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        runner = self.model_runner
        return (
            runner.kv_cache_spec.page_size_bytes * len(runner.attention_layers)
            + runner.draft_bytes_per_block()
        )

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV-cache memory budget (CPU: a byte count; GPU: what profiling leaves)."""
        per_block = self.bytes_per_block()
        if self.args.kv_cache_memory_bytes is not None:
            budget = self.args.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            try:
                budget = self._profile_free_gpu_memory()
            except torch.OutOfMemoryError as exc:
                raise out_of_memory_error(
                    "profiling a forward pass of max_num_batched_tokens tokens",
                    exc,
                    self.args,
                    self.model_config,
                ) from exc
        else:
            if self.args.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
                logger.info(
                    "gpu_memory_utilization=%s applies to GPUs only; on the CPU the KV cache is sized by "
                    "kv_cache_memory_bytes (default: up to %d GiB)",
                    self.args.gpu_memory_utilization,
                    DEFAULT_CPU_KV_CACHE_BYTES // GiB,
                )
            # No more than every sequence at full length could ever use.
            block_size = self.model_runner.block_size
            needed = self.args.max_num_seqs * -(-self.model_config.max_model_len // block_size) + 1
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, needed * per_block)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget of {budget / GiB:.2f} GiB holds no block of {per_block} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization, or lower max_model_len / max_num_seqs"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(self.max_num_batched_tokens, self.model_config.max_model_len)
        self.model_runner.profile_run(num_tokens, min(self.args.max_num_seqs, num_tokens))
        torch.cuda.synchronize()
        # gpu_memory_utilization is this engine's share of the device, as in vLLM: its weights, peak
        # activations and KV cache together. It must be free when the engine starts; memory that other
        # processes (or other engines in this one) hold is theirs, outside the share. The allocator's
        # peak covers the whole process, so what it held before this engine started is taken out.
        peak = torch.cuda.max_memory_allocated() - self.allocated_at_start
        total = torch.cuda.mem_get_info()[1]
        utilization = self.args.gpu_memory_utilization
        requested = int(total * utilization)
        if requested > self.free_memory_at_start:
            raise ValueError(
                f"gpu_memory_utilization={utilization} asks for {requested / GiB:.1f} GiB of the "
                f"{total / GiB:.1f} GiB GPU, but only {self.free_memory_at_start / GiB:.1f} GiB were free at "
                f"start-up ({(total - self.free_memory_at_start) / GiB:.1f} GiB held by other processes or "
                "engines). Lower gpu_memory_utilization, or free the GPU"
            )
        budget = requested - peak
        if budget <= 0:
            raise ValueError(
                f"No GPU memory left for the KV cache: gpu_memory_utilization={utilization} gives "
                f"{requested / GiB:.1f} GiB and the model's peak at {num_tokens} tokens per step is "
                f"{peak / GiB:.1f} GiB. Raise gpu_memory_utilization, or lower max_model_len / "
                "max_num_seqs / max_num_batched_tokens"
            )
        torch.cuda.empty_cache()
        return budget

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        try:
            self.model_runner.initialize_kv_cache(num_blocks, max_num_reqs)
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error("allocating the KV cache", exc, self.args, self.model_config) from exc

    # ---- sleep mode --------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        self.model_runner.sleep(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Wake what `tags` name ("weights", "kv_cache"), weights first."""
        runner = self.model_runner
        state = runner.sleep_state
        if state is None:
            return
        try:
            if "weights" in tags and state.weights_asleep:
                runner.wake_up_weights()
            if "kv_cache" in tags and state.kv_cache_asleep:
                runner.wake_up_kv_cache()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error("waking up from sleep mode", exc, self.args, self.model_config) from exc

    # ---- execution ---------------------------------------------------------------------------

    def execute_model(self, plan: SchedulerOutput) -> StepResult:
        return self.model_runner.execute_model(plan)

    def execute_model_async(
        self, plan: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStep:
        return self.model_runner.execute_model_async(plan, grammar_bitmask)
