"""Which executor an engine gets: in-process at TP=1, one process per rank (mp, or Ray actors) above."""

from __future__ import annotations

import torch

from kvllm.config.engine import EngineArgs
from kvllm.executor.executor import Executor
from kvllm.models.model_config import ModelConfig


def check_tensor_parallel_support(args: EngineArgs, model_config: ModelConfig) -> None:
    """ValueError naming what cannot run split over `args.tensor_parallel_size` ranks (TP > 1)."""
    from kvllm.models.registry import get_model_class

    tp = args.tensor_parallel_size
    model_cls = get_model_class([model_config.architecture])
    if not getattr(model_cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"{model_config.architecture} does not run with tensor parallel in kvllm yet "
            f"(tensor_parallel_size={tp}); the families that do: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3 and DeepSeek-V2/V3. "
            "Use tensor_parallel_size=1"
        )
    if args.speculative_config is not None:
        raise ValueError(
            f"speculative decoding does not run with tensor parallel in kvllm yet (tensor_parallel_size={tp}); "
            "use tensor_parallel_size=1 or drop speculative_config"
        )
    if model_config.is_pooling:
        raise ValueError(
            f"the pooling runner does not run with tensor parallel in kvllm yet (tensor_parallel_size={tp})"
        )


def make_executor(
    args: EngineArgs, model_config: ModelConfig, device: torch.device, max_num_batched_tokens: int
) -> Executor:
    backend = args.distributed_executor_backend
    if backend is None:
        backend = "uni" if args.tensor_parallel_size == 1 else "mp"
    if backend == "uni":
        from kvllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor(args, model_config, device, max_num_batched_tokens)
    check_tensor_parallel_support(args, model_config)
    if backend == "ray":
        from kvllm.executor.ray_executor import RayExecutor

        return RayExecutor(args, model_config, device, max_num_batched_tokens)
    from kvllm.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(args, model_config, device, max_num_batched_tokens)
