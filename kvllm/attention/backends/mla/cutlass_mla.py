"""CUTLASS_MLA: the SM 10.x CUTLASS MLA decode (declared; not verifiable on the hardware we have)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import AttentionSelectorConfig, OneOf, SizeRule
from kvllm.attention.backends.mla.common import DEEPSEEK_LATENT_SIZE, MLABackend
from kvllm.platforms.interface import DeviceInfo

NOT_VERIFIED = (
    "CUTLASS_MLA targets SM 10.x (Blackwell) only, which could not be verified here "
    "(our GPU is an H200, SM 9.0); this build has no CUTLASS MLA kernel"
)


class CutlassMLABackend(MLABackend):
    """vLLM's CUTLASS_MLA row (page size 128, SM 10.x), declared so Blackwell priority lists explain it.

    Always rejected in this build: the kernel ships compiled inside vLLM, and without a Blackwell
    GPU nothing here could show it right, so kvllm does not claim it.
    """

    name: ClassVar[str] = "CUTLASS_MLA"
    description: ClassVar[str] = "CUTLASS MLA decode for SM 10.x (declared only; unverified here)"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    block_sizes: ClassVar[SizeRule] = OneOf((128,))
    head_sizes: ClassVar[SizeRule] = OneOf((DEEPSEEK_LATENT_SIZE,))
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = (10, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (10, 9)
    preferred_block_size: ClassVar[int] = 128
    implemented: ClassVar[bool] = False
    verified_on: ClassVar[str] = "never: no kernel binding in this build (always rejected with a reason)"

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        return [NOT_VERIFIED]
