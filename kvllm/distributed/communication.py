"""Collectives over the tensor-parallel group. At TP=1 each returns its input: no kernel, no copy."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group


def _group() -> dist.ProcessGroup:
    group = get_tp_group()
    if group is None:
        raise RuntimeError(
            "a tensor-parallel collective ran without a process group (layers built under "
            "simulated_tensor_parallel combine their partial results in the caller)"
        )
    return group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place; every rank gets it."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x, group=_group())
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim` in rank order; every rank gets it."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_group())
    return torch.cat(parts, dim=dim)
