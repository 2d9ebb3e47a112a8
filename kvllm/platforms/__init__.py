"""Platforms (placeholder; issue 3 completes it with CUDA/ROCm/CPU detection and simulation)."""

from __future__ import annotations

from kvllm.attention.backend import DeviceInfo


def current_device_info() -> DeviceInfo:
    import torch

    if torch.cuda.is_available():
        platform = "rocm" if torch.version.hip else "cuda"
        return DeviceInfo(platform, torch.cuda.get_device_capability())
    return DeviceInfo("cpu")
