"""kvllm: LLM inference and serving with a paged KV cache and self-explaining attention backends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Heavy modules (torch, transformers) load on first use, so `import kvllm` stays cheap.
_LAZY = {
    "LLM": "kvllm.llm",
    "SamplingParams": "kvllm.sampling_params",
    "BeamSearchParams": "kvllm.sampling_params",
    "PoolingParams": "kvllm.pooling_params",
    "PoolerConfig": "kvllm.config.pooler",
    "PoolingRequestOutput": "kvllm.outputs",
    "EmbeddingRequestOutput": "kvllm.outputs",
    "RequestOutput": "kvllm.outputs",
    "CompletionOutput": "kvllm.outputs",
    "AttentionConfig": "kvllm.config.attention",
    "AttentionBackendEnum": "kvllm.config.backend_names",
    "EngineArgs": "kvllm.config.engine",
    "LLMEngine": "kvllm.engine.llm_engine",
    "AsyncLLMEngine": "kvllm.engine.async_llm_engine",
    "AsyncEngineArgs": "kvllm.engine.arg_utils",
}

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "AttentionBackendEnum",
    "BeamSearchParams",
    "AttentionConfig",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "PoolerConfig",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from kvllm.config.attention import AttentionConfig
    from kvllm.config.backend_names import AttentionBackendEnum
    from kvllm.config.engine import EngineArgs
    from kvllm.config.pooler import PoolerConfig
    from kvllm.engine.arg_utils import AsyncEngineArgs
    from kvllm.engine.async_llm_engine import AsyncLLMEngine
    from kvllm.engine.llm_engine import LLMEngine
    from kvllm.llm import LLM
    from kvllm.outputs import CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
    from kvllm.pooling_params import PoolingParams
    from kvllm.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvllm' has no attribute {name!r}")
