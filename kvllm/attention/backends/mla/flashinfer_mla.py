"""FLASHINFER_MLA: FlashInfer's BatchMLAPagedAttentionWrapper for decode (declarations only)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import AttentionSelectorConfig, MultipleOf, OneOf, SizeRule
from kvllm.attention.backends.flashinfer import kv_dtype_mismatch_reasons
from kvllm.attention.backends.mla.common import DEEPSEEK_LATENT_SIZE, MLABackend
from kvllm.platforms.interface import DeviceInfo


class FlashInferMLABackend(MLABackend):
    """FlashInfer 0.5.3's MLA paged decode (its FA2/FA3 template, JIT-compiled for kv_lora_rank 512 and
    rope 64 only), reading the latent and rotary parts of kvllm's one-plane cache as strided views.

    vLLM's FLASHINFER_MLA is the TRT-LLM-gen kernel of SM 10.x; this one is the portable wrapper.
    """

    name: ClassVar[str] = "FLASHINFER_MLA"
    version: ClassVar[str] = "0.5.3"
    description: ClassVar[str] = "FlashInfer BatchMLAPagedAttentionWrapper decode (kv_lora_rank 512, rope 64)"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16")
    block_sizes: ClassVar[SizeRule] = MultipleOf(1, maximum=128)
    head_sizes: ClassVar[SizeRule] = OneOf((DEEPSEEK_LATENT_SIZE,))
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = (8, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (10, 9)
    required_package: ClassVar[str | None] = "flashinfer"
    pip_extra: ClassVar[str | None] = "flashinfer"
    preferred_block_size: ClassVar[int] = 16
    # The builder has graph hooks (graph-mode wrappers per batch size, re-planned before each replay,
    # flashinfer_mla_impl), but they have not run on a GPU yet: declared once
    # tests/gpu/test_mla_gpu.py::test_mla_graph_decode_matches_eager passes for FLASHINFER_MLA.
    cudagraph_support: ClassVar[str] = "never"
    verified_on: ClassVar[str] = "pending: tests/gpu/test_mla_gpu.py on the H200 (SM 9.0)"

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        return super().extra_reasons(config, device) + kv_dtype_mismatch_reasons(config)

    impl_path = "kvllm.attention.backends.mla.flashinfer_mla_impl:FlashInferMLAImpl"
    builder_path = "kvllm.attention.backends.mla.flashinfer_mla_impl:FlashInferMLAMetadataBuilder"
