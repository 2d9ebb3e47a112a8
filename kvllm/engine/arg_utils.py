"""vLLM's `vllm.engine.arg_utils` names: `EngineArgs`, and `AsyncEngineArgs` (the same arguments,
for AsyncLLMEngine.from_engine_args)."""

from __future__ import annotations

from kvllm.config.engine import EngineArgs

AsyncEngineArgs = EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
