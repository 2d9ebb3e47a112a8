"""Host and device buffers of the input batch: state written rarely (a snapshot is uploaded), and a
step's staging (two pinned host buffers in turn, one device buffer at a fixed address)."""

from __future__ import annotations

from typing import Any

import torch

from kvllm.utils.host_copy import upload_from_host

__all__ = ["CpuGpuBuffer", "Layout", "StagingBuffer", "upload_from_host"]


class CpuGpuBuffer:
    """A host array (numpy) and its device twin, for state written rarely (rows' parameters, blocks).

    `upload` sends a snapshot of the host array, so the host may write it again at once, even while
    the copy waits on the stream. On the CPU the device twin *is* the host array.
    """

    def __init__(self, shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=dtype, device=device) if device.type != "cpu" else self.cpu

    def upload(self) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu.copy_(upload_from_host(self.cpu.clone(), self.device), non_blocking=True)
        return self.gpu


class StagingBuffer:
    """A fixed device buffer written each step from one of two pinned host buffers, in turn.

    With overlapped scheduling the host prepares step N+1 while step N's upload may still be queued
    behind step N-1 on the stream, so it writes the other host buffer, and waits (normally not at
    all) for the upload that last read it. On the CPU the host buffer is the device buffer.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.on_gpu = device.type != "cpu"
        self.gpu = torch.zeros(size, dtype=dtype, device=device)
        if self.on_gpu:
            self._hosts = [torch.zeros(size, dtype=dtype, pin_memory=True) for _ in range(2)]
            self._uploaded: list[torch.cuda.Event | None] = [None, None]
        else:
            self._hosts = [self.gpu]
        self._host_arrays = [h.numpy() for h in self._hosts]  # one numpy view each, made once
        self._current = 0

    def next_host(self) -> torch.Tensor:
        """The host buffer to fill for the next step (safe to overwrite once this returns)."""
        if self.on_gpu:
            self._current ^= 1
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


class Layout:
    """Named sections of a flat buffer at fixed offsets, each starting on a 16-byte boundary.

    Kernels are specialized on whether their pointers are 16-byte aligned: a section at an odd
    offset would make eager steps compile other variants than the CUDA-graph captures, and read
    with narrower loads.
    """

    ALIGN_BYTES = 16

    def __init__(self, element_size: int, **sizes: int) -> None:
        if self.ALIGN_BYTES % element_size:
            raise ValueError(f"element size {element_size} does not divide {self.ALIGN_BYTES}")
        align = self.ALIGN_BYTES // element_size
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in sizes.items():
            self.offsets[name] = (offset, size)
            offset += -(-size // align) * align
        self.size = offset
        self._views: dict[int, tuple[Any, dict[str, Any]]] = {}

    def views(self, buffer: Any) -> dict[str, Any]:
        """Each section of `buffer` (a numpy array or a tensor) as a view, by name. Made once per
        buffer object (slicing costs microseconds a view, every step), so pass long-lived buffers."""
        cached = self._views.get(id(buffer))
        if cached is None or cached[0] is not buffer:
            views = {name: buffer[start : start + size] for name, (start, size) in self.offsets.items()}
            cached = self._views[id(buffer)] = (buffer, views)
        return cached[1]
