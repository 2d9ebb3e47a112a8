"""Sleep mode on one device (vLLM's `LLM.sleep` / `wake_up`): what a sleeping ModelRunner gave back.

Level 1 keeps the weights in host memory (pinned on a GPU, so waking is one copy per tensor) and frees
their device memory; level 2 drops them (waking reloads them from the checkpoint). Both free the KV
cache and everything built on its addresses (the metadata builder, the input batch, the CUDA graphs),
which waking builds again: the cache's contents are lost, and graphs captured on the old addresses
would read freed memory.

On the CPU there is no device memory to give back: level 1 only frees the KV cache (the weights stay
where they are, detached from the model while it sleeps, so nothing can run on them by mistake).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

SLEEP_LEVELS = (1, 2)
WAKE_UP_TAGS = ("weights", "kv_cache")


@dataclass
class SleepState:
    """What is asleep; `host_weights` holds level 1's weights by parameter or buffer name."""

    level: int
    host_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    weights_asleep: bool = True
    kv_cache_asleep: bool = True


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Tied weights are one Parameter and are listed once.
    return list(itertools.chain(model.named_parameters(), model.named_buffers()))


def offload_weights(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Move every parameter and buffer to host memory; the model keeps empty tensors in their place."""
    host: dict[str, torch.Tensor] = {}
    for name, tensor in _tensors(model):
        data = tensor.data
        if device.type == "cpu":
            host[name] = data
        else:
            host[name] = torch.empty(data.shape, dtype=data.dtype, pin_memory=True).copy_(data)
        tensor.data = torch.empty(0, dtype=data.dtype, device=data.device)
    return host


def restore_weights(model: torch.nn.Module, host: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put `offload_weights`' tensors back on `device`, in the same parameter and buffer objects."""
    tensors = dict(_tensors(model))
    missing = set(host) ^ set(tensors)
    assert not missing, f"offloaded and current weights differ: {sorted(missing)}"
    for name, tensor in tensors.items():
        tensor.data = host[name].to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_device_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the device, so other processes can use them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
