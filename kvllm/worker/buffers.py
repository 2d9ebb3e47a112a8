"""Host and device buffers of the input batch: state written rarely (a snapshot is uploaded), and a
step's staging (two pinned host buffers in turn, one device buffer at a fixed address)."""

from __future__ import annotations

from typing import Any

import torch

from kvllm.utils.host_copy import StagingBuffer, upload_from_host

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
