"""The Platform interface: what kvllm needs to know about a kind of device."""

from __future__ import annotations

from kvllm.attention.backend import DeviceInfo
from kvllm.attention.names import AttentionBackendEnum


class Platform:
    """A kind of device (CUDA, ROCm, CPU) and its attention-backend priority lists."""

    name: str = ""
    display_name: str = ""

    @classmethod
    def backend_priority(cls, device: DeviceInfo, use_mla: bool) -> list[AttentionBackendEnum]:
        """Every backend automatic selection should try on `device`, highest priority first.

        Lists name backends whether or not this build implements them; callers filter to the
        registered ones (see kvllm.platforms.backend_priority).
        """
        raise NotImplementedError

    @classmethod
    def priority_tables(cls) -> list[tuple[str, DeviceInfo]]:
        """Representative devices whose priority lists the docs show, with a label each."""
        return [(cls.display_name or cls.name, DeviceInfo(cls.name))]
