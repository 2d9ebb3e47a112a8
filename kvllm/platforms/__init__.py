"""Platforms: which device kvllm runs on (real or simulated) and its attention priority lists.

Simulation lets tests, docs and `kvllm backends --platform cuda --capability 9.0` reason about a
machine kvllm is not running on. Precedence: `simulate_platform(...)` context, then the
KVLLM_SIMULATE_PLATFORM environment variable ("cuda:9.0", "rocm", "cpu"), then torch's view.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvllm.config.backend_names import AttentionBackendEnum, is_registered
from kvllm.platforms.cpu import CpuPlatform
from kvllm.platforms.cuda import CudaPlatform
from kvllm.platforms.interface import DeviceInfo, Platform
from kvllm.platforms.rocm import RocmPlatform

if TYPE_CHECKING:
    import torch

SIMULATE_ENV = "KVLLM_SIMULATE_PLATFORM"
PLATFORMS: dict[str, type[Platform]] = {p.name: p for p in (CudaPlatform, RocmPlatform, CpuPlatform)}

_simulated: list[DeviceInfo] = []  # stack of simulate_platform() contexts, innermost last

__all__ = [
    "PLATFORMS",
    "DeviceInfo",
    "SIMULATE_ENV",
    "Platform",
    "backend_priority",
    "current_device_info",
    "get_platform",
    "is_simulated",
    "make_device_info",
    "parse_device_spec",
    "resolve_device",
    "simulate_platform",
]


def make_device_info(platform: str, capability: tuple[int, int] | str | None = None) -> DeviceInfo:
    """A validated DeviceInfo. CUDA needs a capability ("9.0" or (9, 0)); other platforms have none."""
    platform = platform.strip().lower()
    if platform not in PLATFORMS:
        raise ValueError(f"Unknown platform {platform!r}; valid platforms: {', '.join(PLATFORMS)}")
    if isinstance(capability, str):
        capability = _parse_capability(capability)
    if platform == "cuda":
        if capability is None:
            raise ValueError(
                "Simulating CUDA needs a compute capability, e.g. 9.0 (Hopper) or 10.0 (Blackwell)"
            )
        return DeviceInfo("cuda", (int(capability[0]), int(capability[1])))
    if capability is not None:
        raise ValueError(f"A compute capability applies to CUDA only, not to {platform}; leave it out")
    return DeviceInfo(platform)


def parse_device_spec(spec: str) -> DeviceInfo:
    """Parse "cuda:9.0", "rocm" or "cpu" (the KVLLM_SIMULATE_PLATFORM format)."""
    platform, _, capability = spec.partition(":")
    return make_device_info(platform, capability or None)


def _parse_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise ValueError(f"Invalid compute capability {text!r}; write it as MAJOR.MINOR, e.g. 9.0") from None


@contextmanager
def simulate_platform(platform: str, capability: tuple[int, int] | str | None = None) -> Iterator[DeviceInfo]:
    """Make current_device_info() report a simulated device inside the block (nesting allowed)."""
    device = make_device_info(platform, capability)
    _simulated.append(device)
    try:
        yield device
    finally:
        _simulated.pop()


def is_simulated() -> bool:
    """Whether current_device_info() reports a simulated device."""
    return bool(_simulated) or bool(os.environ.get(SIMULATE_ENV))


def current_device_info() -> DeviceInfo:
    """The device kvllm runs on: simulated if asked, else what torch sees (CUDA, ROCm or CPU)."""
    if _simulated:
        return _simulated[-1]
    spec = os.environ.get(SIMULATE_ENV)
    if spec:
        try:
            return parse_device_spec(spec)
        except ValueError as exc:
            raise ValueError(f"{SIMULATE_ENV}={spec!r} is not valid: {exc}") from None
    import torch

    if torch.cuda.is_available():
        if torch.version.hip:
            return DeviceInfo("rocm")
        return DeviceInfo("cuda", tuple(torch.cuda.get_device_capability()))
    return DeviceInfo("cpu")


def resolve_device(device: str) -> torch.device:
    """The torch device for the `device` setting ("auto": CUDA when a GPU is there, else the CPU)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was requested but no CUDA GPU is available; use device='cpu' or 'auto'"
        )
    return torch.device(device)


def get_platform(device: DeviceInfo) -> type[Platform]:
    """The Platform class for a device."""
    return PLATFORMS[device.platform]


def backend_priority(
    device: DeviceInfo, use_mla: bool, registered_only: bool = True
) -> list[AttentionBackendEnum]:
    """The device's priority list (index 0 tried first), by default only the registered backends."""
    names = get_platform(device).backend_priority(device, use_mla)
    return [n for n in names if is_registered(n.name)] if registered_only else names
