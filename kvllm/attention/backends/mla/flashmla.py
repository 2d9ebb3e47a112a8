"""FLASHMLA: DeepSeek's FlashMLA decode kernels (declared; no kernel binding in this build)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import OneOf, SizeRule
from kvllm.attention.backends.mla.common import DEEPSEEK_LATENT_SIZE, MLABackend


class FlashMLABackend(MLABackend):
    """vLLM's FLASHMLA row: the `flash_mla` package (deepseek-ai/FlashMLA), SM 9.x-10.x, page size 64.

    Registered so that selection explains it; it is rejected with its package reason, since neither
    the package nor a binding to it is part of this build (never replaced by another kernel).
    """

    name: ClassVar[str] = "FLASHMLA"
    description: ClassVar[str] = (
        "DeepSeek FlashMLA decode (declared only: the flash_mla package is not bound)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    block_sizes: ClassVar[SizeRule] = OneOf((64,))
    head_sizes: ClassVar[SizeRule] = OneOf((DEEPSEEK_LATENT_SIZE,))
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (10, 9)
    required_package: ClassVar[str | None] = "flash_mla"
    preferred_block_size: ClassVar[int] = 64
    implemented: ClassVar[bool] = False
    verified_on: ClassVar[str] = "never: no kernel binding in this build (always rejected with a reason)"
