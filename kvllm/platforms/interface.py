"""The Platform interface and DeviceInfo: what kvllm needs to know about a kind of device."""

from __future__ import annotations

from dataclasses import dataclass

from kvllm.config.backend_names import AttentionBackendEnum


@dataclass(frozen=True)
class DeviceInfo:
    """The platform a configuration is validated for: real or simulated."""

    platform: str  # "cuda", "rocm" or "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability; None elsewhere

    def describe(self) -> str:
        if self.capability is None:
            return self.platform
        return f"{self.platform} (compute capability {self.capability[0]}.{self.capability[1]})"


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
