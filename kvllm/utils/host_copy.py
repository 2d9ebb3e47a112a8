"""Host-to-device copies that do not wait for the device."""

from __future__ import annotations

from typing import Any

import torch


def upload_from_host(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a synchronous copy (through pinned memory on a GPU).

    A copy from pageable memory makes the driver wait for the stream, so the host would stall on
    the work it queued before."""
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)


class StagingBuffer:
    """A fixed device buffer written each step from one of `depth` pinned host buffers, in turn.

    With overlapped scheduling the host prepares step N+1 while step N's upload may still be queued
    behind step N-1 on the stream, so it writes the next host buffer, and waits (normally not at
    all) for the upload that last read it. A buffer filled several times a step (a draft model's
    builder, once per draft) takes a larger depth, so the host does not wait for the device to reach
    an upload queued earlier in the same step. On the CPU the host buffer is the device buffer.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, depth: int = 2) -> None:
        self.on_gpu = device.type != "cpu"
        self.gpu = torch.zeros(size, dtype=dtype, device=device)
        if self.on_gpu:
            self._hosts = [torch.zeros(size, dtype=dtype, pin_memory=True) for _ in range(depth)]
            self._uploaded: list[torch.cuda.Event | None] = [None] * depth
        else:
            self._hosts = [self.gpu]
        self._host_arrays = [h.numpy() for h in self._hosts]  # one numpy view each, made once
        self._current = 0

    def next_host(self) -> torch.Tensor:
        """The host buffer to fill for the next step (safe to overwrite once this returns)."""
        if self.on_gpu:
            self._current = (self._current + 1) % len(self._hosts)
            event = self._uploaded[self._current]
            if event is not None:
                event.synchronize()
        return self._hosts[self._current]

    def next_host_numpy(self) -> Any:
        """`next_host()` as a numpy array (the same object each time a buffer comes round)."""
        self.next_host()
        return self._host_arrays[self._current]

    @property
    def host(self) -> torch.Tensor:
        return self._hosts[self._current]

    def upload(self) -> torch.Tensor:
        if self.on_gpu:
            self.gpu.copy_(self._hosts[self._current], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._uploaded[self._current] = event
        return self.gpu
