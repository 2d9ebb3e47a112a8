"""Tensor parallelism's process groups and collectives (torch.distributed: NCCL on CUDA, gloo on the CPU)."""

from kvllm.distributed.communication import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvllm.distributed.parallel_state import (
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed_environment,
)

__all__ = [
    "destroy_distributed_environment",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
