"""Building the engine for a benchmark, and driving one batch through it step by step with timings."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvllm.engine.llm_engine import LLMEngine
    from kvllm.llm import LLM
    from kvllm.sampling_params import SamplingParams

_request_ids = itertools.count()


def build_llm(engine_kwargs: dict[str, Any], **defaults: Any) -> LLM:
    """An LLM from the user's engine arguments; `defaults` fill only what the user did not set.

    Benchmarks turn prefix caching off unless asked (`defaults`), because repeated random prompts
    would otherwise hit the cache and measure nothing but the cache.
    """
    from kvllm.llm import LLM

    kwargs = {**defaults, **engine_kwargs}
    return LLM(**kwargs)


def engine_description(llm: LLM) -> dict[str, Any]:
    """What was measured: the model, its dtype, the attention backend and the cache settings."""
    engine = llm.llm_engine
    args = engine.args
    config = engine.model_config
    return {
        "model": config.model,
        "dtype": str(config.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "attention_backend": engine.attention_backend_name,
        "block_size": engine.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_kv_blocks": engine.kv_cache_manager.num_blocks,
        "max_model_len": config.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enforce_eager": args.enforce_eager,
        "load_format": args.load_format,
    }


@dataclass(frozen=True)
class BatchTiming:
    """Wall times of one batch run to completion (seconds, from adding the first request)."""

    latency: float
    first_token_latency: float  # until every request had its first token: the batch's prefill
    num_output_tokens: int
    num_steps: int


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    on_step: Callable[[], None] | None = None,
) -> BatchTiming:
    """Add every prompt, step the engine until all finish; `on_step` runs after each step.

    The engine returns sampled ids on the host, so each step has already synchronized with the GPU.
    """
    synchronize()
    start = time.perf_counter()
    ids: list[str] = []
    first_token: dict[str, float] = {}
    num_output_tokens = 0
    num_steps = 0
    try:
        for prompt, p in zip(prompts, params):
            request_id = f"bench-{next(_request_ids)}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p)
            ids.append(request_id)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            num_steps += 1
            for output in outputs:
                first_token.setdefault(output.request_id, now)
                if output.finished:
                    num_output_tokens += output.num_output_tokens
            if on_step is not None:
                on_step()
    except BaseException:
        engine.abort_request(ids)
        raise
    end = time.perf_counter()
    return BatchTiming(
        latency=end - start,
        first_token_latency=max(first_token.values()) - start,
        num_output_tokens=num_output_tokens,
        num_steps=num_steps,
    )
