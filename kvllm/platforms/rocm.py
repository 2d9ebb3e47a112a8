"""AMD ROCm (detected through torch.version.hip)."""

from __future__ import annotations

import importlib.util

from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.platforms.interface import DeviceInfo, Platform


def _has_aiter() -> bool:
    return importlib.util.find_spec("aiter") is not None


class RocmPlatform(Platform):
    """ROCm GPUs. Capability is left None: gfx versions are not CUDA compute capabilities."""

    name = "rocm"
    display_name = "ROCm"

    @classmethod
    def backend_priority(cls, device: DeviceInfo, use_mla: bool) -> list[B]:
        if use_mla:
            return [B.ROCM_AITER_MLA, B.TRITON_MLA]
        aiter = [B.ROCM_AITER_FA] if _has_aiter() else []
        return [B.ROCM_ATTN, *aiter, B.ROCM_AITER_UNIFIED_ATTN, B.TRITON_ATTN]
