"""CPU_ATTN: paged attention in plain torch on the CPU (declarations; torch-free)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import AttentionBackend, MultipleOf, SizeRule
from kvllm.config.choices import KV_CACHE_DTYPES


class CpuAttentionBackend(AttentionBackend):
    """Gathers each request's pages into a padded batch and runs torch SDPA (or an explicit
    softmax when soft-cap or sinks need it). The reference-quality fallback on any CPU."""

    name = "CPU_ATTN"
    description = "Plain-torch paged attention on the CPU (SDPA over gathered pages)."
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    block_sizes: ClassVar[SizeRule] = MultipleOf(8)
    head_sizes: ClassVar[SizeRule] = MultipleOf(8, maximum=512)
    platforms: ClassVar[tuple[str, ...]] = ("cpu",)
    supports_sink = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_non_causal = True
    attn_types: ClassVar[tuple[str, ...]] = ("decoder", "encoder_only")
    preferred_block_size = 16
    verified_on = "CPU (CI, every declared combination)"

    impl_path = "kvllm.attention.backends.cpu_attn_impl:CpuAttentionImpl"
    builder_path = "kvllm.attention.backends.cpu_attn_impl:CpuAttentionMetadataBuilder"
