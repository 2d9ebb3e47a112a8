"""The tensor-parallel group of this process: its rank and size, set once per worker process.

A process that never joins a group (the in-process executor, TP=1) is rank 0 of 1: the layers read
these getters when they are built, so at TP=1 they build exactly what they built before tensor
parallelism existed, and the collectives return their input without a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) can put a shared host's GPUs out of service; it stays off in every process
# kvllm starts, whatever the caller's environment says.
NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_nvlink_multicast() -> None:
    """Set the switches that keep NCCL, PyTorch and NVSHMEM off NVLink multicast (before any process
    group exists; child processes inherit them)."""
    os.environ.update(NVLINK_MULTICAST_OFF)


@dataclass(frozen=True)
class TensorParallelState:
    """This process's place in its tensor-parallel group (`group` None: no process group, size 1)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None


_TP = TensorParallelState(rank=0, world_size=1, group=None)


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tp_group() -> dist.ProcessGroup | None:
    """The process group of the tensor-parallel ranks; None at TP=1."""
    return _TP.group


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str | None = None, timeout_s: float = 600.0
) -> None:
    """Join the tensor-parallel group: `backend` "nccl" (CUDA) or "gloo" (CPU), by default the one
    of this process's device; `init_method` a "tcp://host:port" every rank names alike."""
    global _TP
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group")
    disable_nvlink_multicast()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    from datetime import timedelta

    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )
    _TP = TensorParallelState(rank=rank, world_size=world_size, group=dist.group.WORLD)


def destroy_distributed_environment() -> None:
    """Leave the group (idempotent): the process is rank 0 of 1 again."""
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelState(rank=0, world_size=1, group=None)


@contextmanager
def simulated_tensor_parallel(rank: int, world_size: int) -> Iterator[None]:
    """Build layers as rank `rank` of `world_size` in this process, with no process group (tests of
    the sharding math combine the ranks' partial results themselves; a collective here raises)."""
    global _TP
    saved = _TP
    _TP = TensorParallelState(rank=rank, world_size=world_size, group=None)
    try:
        yield
    finally:
        _TP = saved
