"""CPU_MLA: MLA in plain torch on the CPU (declarations; torch-free)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import MultipleOf, SizeRule
from kvllm.attention.backends.mla.common import MLABackend
from kvllm.config.choices import KV_CACHE_DTYPES


class CpuMLABackend(MLABackend):
    """Absorbed-weight decode over the gathered latent pages, in torch: the CI-testable reference backend."""

    name = "CPU_MLA"
    description = "Plain-torch MLA on the CPU: latent-space decode (absorbed weights), up-projected prefill."
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    block_sizes: ClassVar[SizeRule] = MultipleOf(8)
    head_sizes: ClassVar[SizeRule] = MultipleOf(8, maximum=1024)
    platforms: ClassVar[tuple[str, ...]] = ("cpu",)
    preferred_block_size = 16
    verified_on = "CPU (CI, every declared combination; DeepSeek-V2/V3 engine vs HF transformers)"

    impl_path = "kvllm.attention.backends.mla.cpu_mla_impl:CpuMLAImpl"
    builder_path = "kvllm.attention.backends.mla.common_impl:MLAMetadataBuilder"
