"""FLASH_ATTN_MLA: FlashAttention-3's MLA decode (declared; no kernel binding in this build)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import MultipleOf, OneOf, SizeRule
from kvllm.attention.backends.mla.common import DEEPSEEK_LATENT_SIZE, MLABackend


class FlashAttnMLABackend(MLABackend):
    """vLLM's FLASH_ATTN_MLA row: FlashAttention 3's varlen kernel with a separate value input (`qv`),
    SM 9.x. The FA3 interface module (`flash_attn_interface`) is not part of this build, and the
    FlashAttention-4 wheel that runs on our H200 has no MLA decode, so this backend is rejected with
    its package reason."""

    name: ClassVar[str] = "FLASH_ATTN_MLA"
    description: ClassVar[str] = (
        "FlashAttention-3 MLA decode (declared only: flash_attn_interface is not bound)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16")
    block_sizes: ClassVar[SizeRule] = MultipleOf(16)
    head_sizes: ClassVar[SizeRule] = OneOf((DEEPSEEK_LATENT_SIZE,))
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (9, 9)
    required_package: ClassVar[str | None] = "flash_attn_interface"
    preferred_block_size: ClassVar[int] = 16
    implemented: ClassVar[bool] = False
    verified_on: ClassVar[str] = "never: no kernel binding in this build (always rejected with a reason)"
