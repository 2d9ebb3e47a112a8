"""TRITON_ATTN: kvllm's own Triton paged-attention kernels. Declarations only (no torch, no triton).

KV cache layout: (2, num_blocks, block_size, num_kv_heads, head_size): K at index 0, V at index 1,
each page NHD with the head dim contiguous (the same per-page layout FlashAttention uses). Every kernel
takes the block/token/head strides, so KVLLM_TRITON_KV_LAYOUT=HND keeps that shape but stores each page
head-major in memory (one head's block_size rows contiguous), a measurement switch: nano-vllm ran at the
same speed with either on an H100 (docs/benchmarks.md, thirteenth session).
Kernels: `kvllm.attention.ops.triton_reshape_and_cache` and `kvllm.attention.ops.triton_unified_attention`.
"""

from __future__ import annotations

import os
from typing import ClassVar

from kvllm.attention.backend import (
    AttentionBackend,
    AttentionSelectorConfig,
    MultipleOf,
    SizeRule,
)
from kvllm.config.choices import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from kvllm.platforms.interface import DeviceInfo


class TritonAttentionBackend(AttentionBackend):
    """Unified Triton kernel for mixed prefill/decode batches over a paged cache, on CUDA and ROCm.

    Head sizes are padded to the next power of two inside the kernel (masked loads), so any
    multiple of 8 from 32 to 256 runs; block sizes are any multiple of 16 (KV tiles gather pages).
    """

    name: ClassVar[str] = "TRITON_ATTN"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = "kvllm Triton unified paged attention (GQA packing, split-KV decode, fp8 KV)"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES
    block_sizes: ClassVar[SizeRule] = MultipleOf(16)
    head_sizes: ClassVar[SizeRule] = MultipleOf(8, minimum=32, maximum=256)
    platforms: ClassVar[tuple[str, ...]] = ("cuda", "rocm")
    supports_sink: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    attn_types: ClassVar[tuple[str, ...]] = ("decoder",)
    cudagraph_support: ClassVar[str] = "decode_only"
    required_package: ClassVar[str | None] = "triton"
    pip_extra: ClassVar[str | None] = "triton"
    preferred_block_size: ClassVar[int] = 16
    verified_on: ClassVar[str] = (
        "H200 (SM 9.0, bf16/fp16, fp8 KV); CPU via the Triton interpreter (fp16/fp32)"
    )
    kv_cache_layout: ClassVar[str] = "NHD"

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        reasons = []
        # Triton converts to/from float8 in hardware only from Ada/Hopper (sm_89) on.
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

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...] | None:
        layout = os.environ.get("KVLLM_TRITON_KV_LAYOUT", "NHD")
        if layout == "NHD":
            return None
        if layout == "HND":
            return (0, 1, 3, 2, 4)  # K/V, block, head, token, dim
        raise ValueError(f"KVLLM_TRITON_KV_LAYOUT={layout!r}: expected NHD or HND")

    impl_path = "kvllm.attention.backends.triton_attn_impl:TritonAttentionImpl"
    builder_path = "kvllm.attention.backends.triton_attn_impl:TritonAttentionMetadataBuilder"
