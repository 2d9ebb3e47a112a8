"""LLMEngine: the engine core (add_request / step / abort_request), stepped by its caller."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvllm.config.engine import EngineArgs
from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.scheduler import Scheduler
from kvllm.core.step_result import GrammarBitmaskFn, PendingMask, PendingStep, ResolvedStep
from kvllm.engine.input_processor import InputProcessor, PromptType, truncate_prompt
from kvllm.engine.output_processor import OutputProcessor
from kvllm.engine.pooling import check_pooling_params, pooling_request, pooling_scheduler_settings
from kvllm.engine.warm_up import WarmUpStats, warm_up
from kvllm.executor.select import make_executor
from kvllm.models.model_config import ModelConfig
from kvllm.models.tokenizer import load_tokenizer
from kvllm.outputs import RequestOutput
from kvllm.platforms import resolve_device
from kvllm.pooling_params import PoolingParams
from kvllm.sampling_params import SamplingParams
from kvllm.spec_decode.coordinator import SpecDecodeCoordinator, SpecDecodeCounts
from kvllm.structured_output import StructuredOutputManager
from kvllm.structured_output.manager import GrammarProcessSettings
from kvllm.worker.sleep_mode import SLEEP_LEVELS, WAKE_UP_TAGS

logger = logging.getLogger(__name__)

__all__ = ["EngineSleepingError", "EngineStats", "LLMEngine", "PromptType"]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class EngineSleepingError(RuntimeError):
    """A request reached an engine that is asleep (`sleep()`); `wake_up()` first."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    spec_decoding: SpecDecodeCounts | None = None  # with speculative decoding: acceptance counts


class LLMEngine:
    """Continuous-batching engine. Public API (the server builds on it):
    `add_request`, `step`, `abort_request`, `has_unfinished_requests`."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.model_config = ModelConfig.from_engine_args(args, self.device)
        chunked_prefill, prefix_caching = pooling_scheduler_settings(args, self.model_config)
        if args.max_num_batched_tokens is not None:
            max_batched = args.max_num_batched_tokens
        elif chunked_prefill:
            max_batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
        else:
            max_batched = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.model_config.max_model_len)
        if not chunked_prefill and max_batched < self.model_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
                f"{self.model_config.max_model_len} with chunked prefill off, so long prompts could never "
                "be scheduled; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
            )
        self.max_num_batched_tokens = max_batched
        self.tokenizer = load_tokenizer(self.model_config.tokenizer_path)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.model_config.max_model_len)
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            # In-process GPU workers only: other executors send the masks to their workers by value.
            pin_memory=self.device.type == "cuda"
            and args.tensor_parallel_size == 1
            and args.distributed_executor_backend in (None, "uni"),
            process=GrammarProcessSettings(self.model_config.tokenizer_path, args.max_num_seqs)
            if args.grammar_process
            else None,
        )
        self.executor = make_executor(args, self.model_config, self.device, max_batched)
        num_blocks = self.executor.determine_num_blocks()
        if args.num_gpu_blocks_override is not None:
            logger.info(
                "KV cache: %d blocks as num_gpu_blocks_override asks (the memory settings gave %d)",
                args.num_gpu_blocks_override,
                num_blocks,
            )
            num_blocks = args.num_gpu_blocks_override
        _check_kv_cache_holds_one_request(
            num_blocks,
            self.executor.block_size,
            self.executor.bytes_per_block(),
            self.model_config.max_model_len,
        )
        self.executor.initialize_kv_cache(num_blocks, args.max_num_seqs)
        self.block_size = self.executor.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, prefix_caching)
        spec = args.speculative_config
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            args.max_num_seqs,
            max_batched,
            chunked_prefill,
            num_lookahead_tokens=spec.num_speculative_tokens if spec and spec.uses_draft_kv_cache else 0,
            max_model_len=self.model_config.max_model_len,
            policy=args.scheduling_policy,
        )
        self.async_scheduling = args.async_scheduling
        self.spec_decode: SpecDecodeCoordinator | None = None
        if args.speculative_config is not None:
            self.spec_decode = SpecDecodeCoordinator(args.speculative_config, self.model_config.max_model_len)
            if self.async_scheduling:
                logger.info(
                    "Overlapped (async) scheduling is off with speculative decoding: how many tokens a "
                    "step emits is known only after its verification, and the next step's drafts and "
                    "KV positions depend on it"
                )
                self.async_scheduling = False
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        self._grammar_requests: list[Request] = []  # with structured outputs, until they finish
        # During step(): the step launched by the previous call, until its tokens are taken.
        self._previous: tuple[SchedulerOutput, PendingStep] | None = None
        # During step(): that step once the grammar masks took its tokens, until its outputs are made.
        self._grammar_taken: tuple[SchedulerOutput, PendingStep] | None = None
        self.sleep_level = 0  # 0: awake; else the level of the last sleep() until wake_up() ends it
        self.async_driver: Any = None  # the AsyncLLM whose engine thread steps this engine (async_llm.py)
        self._log_cache_size(num_blocks)
        if self.device.type == "cuda" and not self.model_config.is_pooling:
            self.warm_up()  # generate steps; a pooling engine's prefill-only steps need no warm-up
        if self.device.type == "cuda":
            # The start-up objects (modules, graphs, buffers) live as long as the engine: moved out of
            # the collector's generations, a collection while serving scans only the requests' objects
            # (vLLM freezes them after start-up too). Not on the CPU, where test processes build and
            # drop many engines whose reference cycles must stay collectable.
            gc.collect()
            gc.freeze()
        if self.model_config.default_sampling:
            logger.info(
                "Sampling defaults from the model's generation_config.json: %s (used where a request does "
                "not set them; --generation-config vllm ignores the file)",
                self.model_config.default_sampling,
            )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _log_cache_size(self, num_blocks: int) -> None:
        tokens = num_blocks * self.block_size
        gib = num_blocks * self.executor.bytes_per_block() / (1 << 30)
        concurrency = tokens / self.model_config.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s); maximum concurrency for %d tokens "
            "per request: %.2fx",
            num_blocks,
            self.block_size,
            tokens,
            gib,
            self.executor.kv_cache_spec.dtype,
            self.model_config.max_model_len,
            concurrency,
        )

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (PoolingParams for a pooling model). Raises ValueError for input
        the engine cannot serve. `priority` orders requests under the priority scheduling policy (lower
        first); it must stay 0 under fcfs."""
        self._check_priority(priority)
        if self.model_config.is_pooling or isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params or PoolingParams(), arrival_time, priority)
            return
        params = params or SamplingParams()
        self._check_not_sleeping()
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use")
        cache_salt = self.input_processor.cache_salt(prompt)
        text, token_ids = self.input_processor.tokenize_prompt(prompt)
        token_ids = self.input_processor.truncate_prompt(token_ids, params)
        self.input_processor.validate_prompt(token_ids)
        params = self.input_processor.process_params(params)
        if params.structured_outputs is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        self._check_fits_cache(token_ids)
        max_tokens = self.input_processor.max_tokens(params, len(token_ids))
        requests = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.replace(seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:  # the prompt is shared: score it once
                child_params = child_params.replace(prompt_logprobs=None)
            generator = None
            if child_params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(child_params.seed)
            request = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(token_ids),
                sampling_params=child_params,
                max_tokens=max_tokens,
                parent_id=request_id,
                index=i,
                eos_token_ids=self.model_config.eos_token_ids,
                generator=generator,
                cache_salt=cache_salt,
                priority=priority,
            )
            if params.structured_outputs is not None:
                request.structured_output_request = self.structured_output_manager.make_request(
                    params.structured_outputs
                )
                self._grammar_requests.append(request)
            if arrival_time is not None:
                request.arrival_time = arrival_time
            requests.append(request)
        self.output_processor.add_request(request_id, text, token_ids, requests)
        for request in requests:
            self.scheduler.add_request(request)

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} is not valid; allowed: an integer (lower runs first)")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} is not valid: priority scheduling is not enabled (start the engine with "
                "scheduling_policy='priority', --scheduling-policy priority); allowed: 0"
            )

    def _check_not_sleeping(self) -> None:
        if self.sleep_level:
            raise EngineSleepingError(
                f"The engine is asleep (sleep level {self.sleep_level}): its weights and KV cache are off the "
                "device. Call wake_up() before adding requests"
            )

    def _add_pooling_request(
        self, request_id: str, prompt: PromptType, params: Any, arrival_time: float | None, priority: int = 0
    ) -> None:
        """One prefill whose hidden states are pooled (no token is sampled, no decode is scheduled)."""
        if not self.model_config.is_pooling:
            raise ValueError(
                "Embedding (pooling) requests are not supported by this model: it runs with --runner "
                "generate. Try converting the model using `--convert embed` (or `--runner pooling`)"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(
                "LLM.generate() is only supported for generative models; this one runs with --runner "
                "pooling. Use LLM.embed() (or /v1/embeddings), or pass `--runner generate`"
            )
        self._check_not_sleeping()
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use")
        check_pooling_params(params, self.model_config)
        cache_salt = self.input_processor.cache_salt(prompt)
        text, token_ids = self.input_processor.tokenize_prompt(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
        self.input_processor.validate_prompt(token_ids, room_to_generate=False)
        self._check_fits_cache(token_ids)
        request = pooling_request(request_id, token_ids, params, arrival_time)
        request.cache_salt = cache_salt
        request.priority = priority
        self.output_processor.add_request(request_id, text, token_ids, [request])
        self.scheduler.add_request(request)

    def _check_fits_cache(self, token_ids: list[int]) -> None:
        needed = self.kv_cache_manager.blocks_needed(len(token_ids) + 1)
        if needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV blocks but the whole cache has "
                f"{self.kv_cache_manager.num_blocks}; raise kv_cache_memory_bytes / gpu_memory_utilization"
            )

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests (unknown or finished ids are ignored) and free their KV blocks."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self.output_processor.parents.pop(rid, None)
            if parent is None:
                continue
            for seq in parent.sequences:
                if not seq.request.is_finished:
                    seq.request.finish_reason = "abort"
                    self.scheduler.finish_request(seq.request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def shutdown(self) -> None:
        """Stop the executor's worker processes and the grammar process, if there are any (also done
        when the engine is collected and at interpreter exit)."""
        self.executor.shutdown()
        self.structured_output_manager.shutdown()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching: schedule, execute, update the outputs.

        With async_scheduling (the default, as in vLLM) the step launched here is not waited for:
        the outputs returned are those of the step launched by the previous call, processed on the
        host while this one runs on the device. The scheduler counts in-flight tokens as
        placeholders, so no request is ever given a token past its stop: a step launched before a
        stop was seen still computes that request, but its token is dropped.
        """
        plan = self.scheduler.schedule()
        # Requests the scheduler failed (finish_reason "error") report that at once, like a finish.
        outputs = self.output_processor.process_failed(plan)
        self._previous, self._in_flight = self._in_flight, None
        pending = None
        if plan.is_empty and self._previous is None:
            self._wait_for_grammar()
        if not plan.is_empty:
            if self._has_grammar_requests() and any(
                item.request.structured_output_request is not None for item in plan.scheduled
            ):
                pending = self.executor.execute_model_async(plan, self._grammar_bitmask_fn(plan, outputs))
            else:
                pending = self.executor.execute_model_async(plan)
        if self._grammar_taken is not None:  # the masks are filled and the step launched: now its outputs
            outputs += self._update(*self._grammar_taken, grammar_accepted=True)
            self._grammar_taken = None
        if not self.async_scheduling:
            return outputs + (self._update(plan, pending) if pending is not None else [])
        if self._previous is not None:  # not yet taken by the grammar masks
            outputs += self._update(*self._previous)
            self._previous = None
        self._in_flight = (plan, pending) if pending is not None else None
        if self._in_flight is not None and not self.scheduler.has_work_beyond_in_flight():
            # Nothing more could be scheduled until this step's tokens arrive: wait for them now
            # rather than on the next call, so the last tokens come without an extra step.
            done, self._in_flight = self._in_flight, None
            outputs += self._update(*done)
        return outputs

    def _has_grammar_requests(self) -> bool:
        """Whether an unfinished request has structured outputs (a step without one skips the
        per-request check for grammars). O(requests with grammars): finished ones are dropped here."""
        if self._grammar_requests:
            finished = [r.structured_output_request for r in self._grammar_requests if r.is_finished]
            if finished:
                self.structured_output_manager.release(finished)
                self._grammar_requests = [r for r in self._grammar_requests if not r.is_finished]
        return bool(self._grammar_requests)

    def _wait_for_grammar(self, timeout: float = 0.01) -> None:
        """Nothing to run: block briefly on a waiting request's grammar instead of spinning."""
        for request in self.scheduler.waiting:
            grammar = request.structured_output_request
            if grammar is not None and not grammar.is_ready():
                grammar.wait(timeout)
                return

    def _grammar_bitmask_fn(self, plan: SchedulerOutput, outputs: list[RequestOutput]) -> GrammarBitmaskFn:
        """The masks of `plan`'s constrained rows, called by the worker once the forward pass is queued.

        A mask depends on every token before it, so the previous step's tokens (still in flight with
        overlapped scheduling) are taken first: exact, and the host's work overlaps the device's
        forward pass instead of the device's idle time. Only the grammars are advanced before the masks
        are asked for (their critical path, while the device waits to sample). The rest of that step's
        output work runs while the grammar process fills the masks or, with the matchers on this thread,
        follows the launch in step(). With the grammar process the masks are answered as a PendingMask:
        the worker takes them (and launches the sampling) when the next step starts, so this thread
        returns and schedules that step while the process fills them. A step with verified drafts is
        processed whole, into `outputs`."""
        manager = self.structured_output_manager

        def fill(rows: list[int]) -> torch.Tensor | PendingMask | None:
            taken = None
            if self._previous is not None:
                previous_plan, previous = self._previous
                self._previous = None
                result = ResolvedStep(previous.result())
                if result.step.spec_token_ids:
                    outputs.extend(self._update(previous_plan, result))
                else:
                    self.output_processor.accept_grammar_tokens(previous_plan, result.step)
                    taken = (previous_plan, result)
            grammars = []
            for i in rows:
                request = plan.scheduled[i].request
                grammars.append(None if request.is_finished else request.structured_output_request)
            manager.start_bitmask(grammars)
            if manager.matchers_in_process:
                if taken is not None:
                    outputs.extend(self._update(*taken, grammar_accepted=True))
                return manager.finish_bitmask
            if taken is not None:
                self._grammar_taken = taken
            return manager.finish_bitmask()

        return fill

    def _update(
        self, plan: SchedulerOutput, pending: PendingStep, grammar_accepted: bool = False
    ) -> list[RequestOutput]:
        """Wait for a launched step's tokens, apply them, and free the requests they finished."""
        result = pending.result()
        outputs, finished = self.output_processor.process_step(plan, result, grammar_accepted)
        self.scheduler.finish_requests(finished)
        if self.spec_decode is not None:
            self.spec_decode.after_step(plan, result, self.scheduler)
        return outputs

    def warm_up(self) -> WarmUpStats:
        """Run every eager-step kernel variant once (on a GPU this happens at start-up): see warm_up.py."""
        stats = warm_up(self)
        if self.spec_decode is not None:  # the warm-up's drafts are not the user's
            self.spec_decode.reset_stats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False (nothing done) while requests hold KV blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- sleep mode --------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while no request runs (vLLM's sleep mode; worker/sleep_mode.py).

        Level 1 moves the weights to host memory and frees the KV cache; level 2 also drops the weights
        (wake_up reloads them from the checkpoint). The cached prefixes are forgotten. Raises ValueError
        for another level and RuntimeError while requests are unfinished or when already asleep.
        """
        if level not in SLEEP_LEVELS:
            raise ValueError(
                f"level={level!r} is not a sleep level; allowed: {', '.join(map(str, SLEEP_LEVELS))}"
            )
        if self.sleep_level:
            raise RuntimeError(
                f"The engine is already asleep (level {self.sleep_level}); call wake_up() first"
            )
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"Cannot sleep while {self.get_num_unfinished_requests()} request(s) are unfinished; let them "
                "finish or abort them first"
            )
        if self._in_flight is not None:
            # A step launched before its requests finished: its tokens are dropped, as step() would.
            done, self._in_flight = self._in_flight, None
            self._update(*done)
        self.executor.sleep(level)
        reset = self.kv_cache_manager.reset_prefix_cache()
        assert reset, "no request holds blocks, so the prefix cache resets"
        self.sleep_level = level
        logger.info(
            "Sleeping (level %d): weights %s, KV cache freed", level, "offloaded" if level == 1 else "dropped"
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep() freed: everything, or the parts `tags` names ("weights", "kv_cache").

        Waking the weights alone lets a caller update them before the KV cache returns; the KV cache
        needs the weights awake. A no-op while awake.
        """
        names = tuple(WAKE_UP_TAGS if tags is None else tags)
        unknown = sorted(set(names) - set(WAKE_UP_TAGS))
        if unknown:
            raise ValueError(f"Unknown wake_up tags {unknown}; allowed: {', '.join(WAKE_UP_TAGS)}")
        if not self.sleep_level:
            return
        state = self.executor.sleep_state
        if "kv_cache" in names and "weights" not in names and state is not None and state.weights_asleep:
            raise ValueError("wake_up(tags=['kv_cache']) needs the weights awake; wake 'weights' first")
        self.executor.wake_up(names)
        if self.executor.sleep_state is None:
            self.sleep_level = 0
            logger.info("Awake: weights and KV cache back on %s", self.device)

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    # ---- introspection -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            spec_decoding=self.spec_decode.stats.snapshot() if self.spec_decode is not None else None,
        )

    @property
    def attention_backend_name(self) -> str:
        return self.executor.attention_backend_name


def _check_kv_cache_holds_one_request(
    num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int
) -> None:
    """Refuse a cache in which one request of max_model_len tokens could never run (as vLLM does)."""
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return
    tokens = num_blocks * block_size
    raise ValueError(
        f"The KV cache holds {tokens} tokens ({num_blocks} blocks of {block_size}), fewer than one request "
        f"of max_model_len={max_model_len} tokens needs ({needed} blocks, {needed * bytes_per_block} bytes), "
        "so such a request could never finish. Give the cache more memory (kv_cache_memory_bytes of at "
        f"least {needed * bytes_per_block}, or on a GPU a higher gpu_memory_utilization), or lower "
        f"max_model_len to at most {tokens}"
    )
