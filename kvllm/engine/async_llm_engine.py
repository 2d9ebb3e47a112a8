"""AsyncLLMEngine: vLLM's asyncio engine API (`from vllm.engine.async_llm_engine import AsyncLLMEngine`)
over kvllm's AsyncLLM.

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="..."))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        ...
    await engine.abort("r1")

The engine thread starts with the first call that needs it, on the event loop that makes it (as
vLLM's starts its output handler); from then on the engine belongs to that loop, and a call from
another loop is an error that says so. Outputs follow `SamplingParams.output_kind` (CUMULATIVE by
default; DELTA yields each piece once). `shutdown()` stops the engine thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from kvllm.config.engine import EngineArgs
from kvllm.engine.async_llm import AsyncLLM, EngineDeadError, StatRecorder
from kvllm.engine.llm_engine import LLMEngine, PromptType
from kvllm.models.model_config import ModelConfig
from kvllm.outputs import PoolingRequestOutput, RequestOutput
from kvllm.pooling_params import PoolingParams
from kvllm.sampling_params import SamplingParams


class AsyncLLMEngine:
    """An asyncio engine shaped like vLLM's AsyncLLMEngine: generate, abort, health, sleep mode."""

    def __init__(self, engine: LLMEngine, stat_recorders: Sequence[StatRecorder] = ()) -> None:
        self.async_llm = AsyncLLM(engine, stat_recorders)
        self._start_lock: asyncio.Lock | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        """Build the engine (loads the model). vLLM's keyword arguments that only tune its process
        layout (usage_context, start_engine_loop, stat_loggers=None, ...) are accepted when they ask
        for nothing kvllm lacks."""
        stat_loggers = kwargs.pop("stat_loggers", None)
        if stat_loggers:
            raise ValueError("stat_loggers are not supported: kvllm's metrics are served by `kvllm serve`")
        if not kwargs.pop("start_engine_loop", True):
            raise ValueError(
                "start_engine_loop=False is not supported: the engine thread starts on first use"
            )
        kwargs.pop("usage_context", None)
        kwargs.pop("disable_log_stats", None)
        kwargs.pop("disable_log_requests", None)
        kwargs.pop("enable_log_requests", None)
        if kwargs:
            raise TypeError(
                f"AsyncLLMEngine.from_engine_args got unexpected arguments: {', '.join(sorted(kwargs))}"
            )
        return cls(LLMEngine.from_engine_args(engine_args))

    # ---- state --------------------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        return self.async_llm.engine

    @property
    def is_running(self) -> bool:
        return self.async_llm.is_accepting

    @property
    def errored(self) -> bool:
        return self.async_llm.errored

    @property
    def dead_error(self) -> BaseException | None:
        return self.async_llm.dead_error

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread has crashed."""
        if self.errored:
            raise EngineDeadError(f"The engine has stopped after an error: {self.dead_error!r}")

    async def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def get_model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("embed",) if self.engine.model_config.is_pooling else ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return False

    # ---- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; leaving early aborts it.

        Raises ValueError for input the engine rejects (also a reused request id) and
        EngineSleepingError while asleep.
        """
        if lora_request is not None:
            raise ValueError("lora_request is not supported: kvllm serves no LoRA adapters")
        await self._ensure_started()
        async for output in self.async_llm.generate(prompt, sampling_params, request_id, priority=priority):
            yield output

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, *, lora_request: Any = None
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's embedding of `prompt`: one PoolingRequestOutput (vLLM's `encode`)."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: kvllm serves no LoRA adapters")
        await self._ensure_started()
        async for output in self.async_llm.generate(prompt, pooling_params, request_id):  # type: ignore[arg-type]
            yield output  # type: ignore[misc]

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort". Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.async_llm.abort(ids)

    # ---- engine calls (run on the engine thread) ----------------------------------------------

    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False while requests hold KV blocks."""
        await self._ensure_started()
        return await self.async_llm.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep on the engine thread (no request may be unfinished)."""
        await self._ensure_started()
        await self.async_llm.call_engine(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._ensure_started()
        await self.async_llm.call_engine(lambda engine: engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def shutdown(self) -> None:
        """Stop the engine thread (waits for a running step); requests left end with an error."""
        self.async_llm.stop()

    async def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        bound = self.async_llm.event_loop
        if bound is not None:
            if bound is not loop:
                raise RuntimeError(
                    "This AsyncLLMEngine runs on another event loop (the one of its first call); use it from "
                    "that loop, or build one engine per loop"
                )
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.async_llm.event_loop is None:
                await self.async_llm.start()
