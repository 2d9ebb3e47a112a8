"""NVIDIA CUDA: priority lists by compute capability (vLLM v0.33's order)."""

from __future__ import annotations

from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.platforms.interface import DeviceInfo, Platform

_STANDARD_BLACKWELL = [B.FLASHINFER, B.FLASH_ATTN, B.TRITON_ATTN, B.FLEX_ATTENTION]
_STANDARD_DEFAULT = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON_ATTN, B.FLEX_ATTENTION]
_MLA_BLACKWELL = [B.FLASHINFER_MLA, B.CUTLASS_MLA, B.FLASH_ATTN_MLA, B.FLASHMLA, B.TRITON_MLA]
_MLA_DEFAULT = [B.FLASH_ATTN_MLA, B.FLASHMLA, B.FLASHINFER_MLA, B.TRITON_MLA]


class CudaPlatform(Platform):
    """CUDA GPUs; the list depends on whether the device is Blackwell (SM 10.x)."""

    name = "cuda"
    display_name = "CUDA"

    @classmethod
    def backend_priority(cls, device: DeviceInfo, use_mla: bool) -> list[B]:
        blackwell = device.capability is not None and device.capability[0] == 10
        if use_mla:
            return list(_MLA_BLACKWELL if blackwell else _MLA_DEFAULT)
        return list(_STANDARD_BLACKWELL if blackwell else _STANDARD_DEFAULT)

    @classmethod
    def priority_tables(cls) -> list[tuple[str, DeviceInfo]]:
        return [
            ("CUDA Blackwell (SM 10.x)", DeviceInfo("cuda", (10, 0))),
            ("CUDA Ampere/Hopper (SM 8.x-9.x) and other CUDA", DeviceInfo("cuda", (9, 0))),
        ]
