"""CPU: one backend per attention kind; FLEX_ATTENTION also runs here when asked for by name."""

from __future__ import annotations

from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.platforms.interface import DeviceInfo, Platform


class CpuPlatform(Platform):
    """x86/ARM CPUs."""

    name = "cpu"
    display_name = "CPU"

    @classmethod
    def backend_priority(cls, device: DeviceInfo, use_mla: bool) -> list[B]:
        return [B.CPU_MLA] if use_mla else [B.CPU_ATTN]
