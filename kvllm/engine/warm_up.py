"""Start-up warm-up: every kernel variant an eager step can launch runs once before serving.

Triton compiles a kernel variant the first time it runs with new compile-time constants, seconds
each. CUDA-graph capture compiles what decode graphs replay, but steps that run eagerly (prefill
chunks, the decodes scheduled beside them, split or not, the sampler's greedy / temperature /
penalty paths) would compile in the middle of the first requests: 4.3 s of the first 11 s of
nano-vllm's workload on an H200 before this existed. The warm-up sends a few short requests
through the normal scheduling path, shaped so those steps occur, then leaves no trace: the
requests are finished, their blocks free, the prefix cache and its counters reset.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from kvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REQUEST_ID_PREFIX = "kvllm-warm-up-"
SHORT_PROMPT_LEN = 4
LONG_PROMPT_LEN = 1024  # long enough that decodes beside it split their KV (TRITON_ATTN's rule)


@dataclass(frozen=True)
class WarmUpRound:
    """`num_short` requests prefill alone, then decode beside one long prompt's prefill (a mixed step)."""

    name: str
    num_short: int  # 0 = as many as fit: enough decode programs that no backend splits them
    short: SamplingParams
    long: SamplingParams


def warm_up_rounds() -> list[WarmUpRound]:
    sample = SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    return [
        WarmUpRound("temperature beside greedy, split decodes", 1, sample.replace(logprobs=1), greedy),
        WarmUpRound("all greedy, unsplit decodes", 0, greedy, greedy.replace(max_tokens=1)),
        WarmUpRound("temperature 1", 1, sample.replace(temperature=1.0), sample.replace(temperature=1.0)),
        WarmUpRound("top-p / top-k", 1, sample.replace(top_p=0.9, top_k=20), sample.replace(min_p=0.05)),
        WarmUpRound(
            "penalties", 1, sample.replace(repetition_penalty=1.1), greedy.replace(presence_penalty=0.5)
        ),
    ]


@dataclass(frozen=True)
class WarmUpStats:
    num_rounds: int
    num_steps: int
    seconds: float


def warm_up(engine: Any) -> WarmUpStats:
    """Run the warm-up rounds through `engine` (an LLMEngine, which imports this module); it must have
    no requests of its own yet."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs before any request is added; the engine has unfinished requests")
    start = time.perf_counter()
    rng = random.Random(0)
    bound = max(2, min(engine.model_config.vocab_size, 10_000))
    max_model_len = engine.model_config.max_model_len
    long_len = max(1, min(LONG_PROMPT_LEN, max_model_len - 4))
    short_len = max(1, min(SHORT_PROMPT_LEN, max_model_len - 4))
    cache = engine.kv_cache_manager
    # "As many as fit": every short request holds one block per few tokens and the long one its own.
    fit = min(
        engine.args.max_num_seqs - 1,
        (cache.num_free_blocks - cache.blocks_needed(long_len + 4))
        // max(1, cache.blocks_needed(short_len + 4)),
        engine.max_num_batched_tokens // (short_len + 1),
    )
    rounds = warm_up_rounds()
    num_steps = 0
    for index, plan in enumerate(rounds):
        num_short = max(0, min(plan.num_short or fit, fit))
        prefix = f"{REQUEST_ID_PREFIX}{index}-"
        for i in range(num_short):
            prompt = [rng.randrange(bound) for _ in range(short_len)]
            engine.add_request(f"{prefix}s{i}", {"prompt_token_ids": prompt}, plan.short)
        if num_short:
            engine.step()
            num_steps += 1
        prompt = [rng.randrange(bound) for _ in range(long_len)]
        engine.add_request(f"{prefix}long", {"prompt_token_ids": prompt}, plan.long)
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
    cache.reset_prefix_cache()
    cache.prefix_cache_queries = cache.prefix_cache_hits = 0
    engine.scheduler.num_preemptions = 0
    stats = WarmUpStats(len(rounds), num_steps, time.perf_counter() - start)
    logger.info(
        "Warm-up: %d steps in %.1f s, so kernels compile before serving, not during it",
        stats.num_steps,
        stats.seconds,
    )
    return stats
