"""TRITON_MLA: kvllm's own Triton decode kernel over the latent paged cache (declarations only)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import AttentionSelectorConfig, MultipleOf, SizeRule
from kvllm.attention.backends.mla.common import MLABackend
from kvllm.config.choices import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from kvllm.platforms.interface import DeviceInfo


class TritonMLABackend(MLABackend):
    """Split-KV Triton decode in the latent space (`kvllm.attention.ops.triton_mla_decode`): one
    program per block of up to 64 heads and one KV segment, so a latent tile is loaded once for all
    of them; decode steps are captured in CUDA graphs.

    Any latent width that is a multiple of 8 up to 1024 runs (the kernel pads the latent and rotary
    parts to powers of two with masked loads); fp8 caches are read back with the layer's k_scale.
    """

    name: ClassVar[str] = "TRITON_MLA"
    version: ClassVar[str] = "2"
    description: ClassVar[str] = (
        "kvllm Triton MLA decode (head-blocked, split-KV over latent pages, fp8 latent cache)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    block_sizes: ClassVar[SizeRule] = MultipleOf(16)
    head_sizes: ClassVar[SizeRule] = MultipleOf(8, minimum=16, maximum=1024)
    platforms: ClassVar[tuple[str, ...]] = ("cuda", "rocm")
    required_package: ClassVar[str | None] = "triton"
    pip_extra: ClassVar[str | None] = "triton"
    preferred_block_size: ClassVar[int] = 16
    # Graph steps read fixed buffers and split by batch size and max_model_len only (triton_mla_impl).
    cudagraph_support: ClassVar[str] = "decode_only"
    verified_on: ClassVar[str] = (
        "CPU via the Triton interpreter (fp16/fp32, fp8 e4m3/e5m2 latent); H200: see the GPU test"
    )

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        reasons = super().extra_reasons(config, device)
        if (
            config.kv_cache_dtype in FP8_KV_CACHE_DTYPES
            and device.platform == "cuda"
            and device.capability is not None
            and device.capability < (8, 9)
        ):
            cap = device.capability
            reasons.append(
                f"kv_cache_dtype {config.kv_cache_dtype} needs compute capability >= 8.9 "
                f"(got {cap[0]}.{cap[1]}; use kv_cache_dtype auto)"
            )
        return reasons

    impl_path = "kvllm.attention.backends.mla.triton_mla_impl:TritonMLAImpl"
    builder_path = "kvllm.attention.backends.mla.common_impl:MLAMetadataBuilder"
