"""The engine's rules for pooling (embedding) requests: scheduler settings per model, PoolingParams checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvllm.core.request import Request
from kvllm.logger import init_logger
from kvllm.pooling_params import PoolingParams
from kvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvllm.config.engine import EngineArgs
    from kvllm.models.model_config import ModelConfig

logger = init_logger(__name__)

# What a pooling request's Request carries as sampling parameters: nothing is sampled or detokenized.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def pooling_request(
    request_id: str, token_ids: list[int], params: PoolingParams, arrival_time: float | None
) -> Request:
    """The scheduler's Request for one pooling prompt: one prefill, whose last chunk leaves the usual
    placeholder (max_tokens=1), which the pooled vector resolves instead of a sampled token."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=POOLING_SAMPLING,
        max_tokens=1,
        parent_id=request_id,
        eos_token_ids=(),
        pooling_params=params,
    )
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def pooling_scheduler_settings(args: EngineArgs, model_config: ModelConfig) -> tuple[bool, bool]:
    """(chunked prefill, prefix caching) for the model. An encoder attends over the whole prompt at
    once, so its prompts are never chunked; pooling needs every prompt row except for LAST pooling of a
    causal model, so only that keeps the prefix cache (as vLLM)."""
    chunked, prefix = args.enable_chunked_prefill, args.enable_prefix_caching
    if model_config.is_encoder_only and chunked:
        logger.info(
            "Chunked prefill off: %s attends bidirectionally over each prompt", model_config.architecture
        )
        chunked = False
    pooler = model_config.pooler_config
    if prefix and model_config.is_pooling:
        if model_config.is_encoder_only or (pooler is not None and pooler.seq_pooling_type != "LAST"):
            logger.info("Prefix caching off: pooling needs the hidden states of every prompt token")
            prefix = False
    return chunked, prefix


def check_pooling_params(params: PoolingParams, model_config: ModelConfig) -> None:
    """ValueError for `dimensions` the model cannot give (vLLM's rule: matryoshka models only)."""
    if params.dimensions is None:
        return
    hf = model_config.hf_config
    allowed = getattr(hf, "matryoshka_dimensions", None)
    if not (getattr(hf, "is_matryoshka", False) or allowed):
        raise ValueError(
            f'Model "{model_config.model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results."
        )
    if allowed and params.dimensions not in allowed:
        raise ValueError(
            f'Model "{model_config.model}" only supports {list(allowed)} matryoshka dimensions, using other output dimensions will lead to poor results.'
        )
    if params.dimensions > model_config.hidden_size:
        raise ValueError(
            f"dimensions={params.dimensions} is larger than the model's embedding size {model_config.hidden_size}"
        )
