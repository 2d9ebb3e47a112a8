"""FLASH_ATTN: FlashAttention-4 (CuTe DSL, `flash_attn.cute`) over a paged KV cache.

Declarations only: importable without torch or the kernel library. The kernel side lives in
`flash_attn_impl`, imported when the backend is bound to a model.

Which FlashAttention version serves a configuration comes from `flash_attn_version` on the
selector config (2, 3 or 4; None = the spec's default for the GPU). This build ships only FA4,
so a request for 2 or 3 is a reason; an unset version resolves to FA4 wherever FA4 can run.
"""

from __future__ import annotations

import importlib.util
import os

from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig, OneOf
from kvllm.platforms.interface import DeviceInfo

# Versions this build implements and verifies; 2 and 3 would need their own kernels and tests.
AVAILABLE_FLASH_ATTN_VERSIONS: tuple[int, ...] = (4,)
FA4_MIN_CAPABILITY = (9, 0)


def default_flash_attn_version(capability: tuple[int, int] | None) -> int:
    """The spec's default: FA4 on SM 10.x+, FA3 on SM 9.x, FA2 below."""
    if capability is None or capability >= (10, 0):
        return 4
    return 3 if capability >= (9, 0) else 2


def flash_attn_version_reasons(requested: int | None, capability: tuple[int, int] | None) -> list[str]:
    """Why the requested (or default) FlashAttention version cannot serve on this device."""
    if requested is not None:
        if requested not in (2, 3, 4):
            return [f"flash_attn_version {requested!r} not valid (allowed: 2, 3, 4)"]
        if requested not in AVAILABLE_FLASH_ATTN_VERSIONS:
            return [
                f"flash_attn_version {requested} (FlashAttention-{requested}) is not available in this build "
                f"(available: {', '.join(f'FA{v}' for v in AVAILABLE_FLASH_ATTN_VERSIONS)})"
            ]
    if capability is not None and capability < FA4_MIN_CAPABILITY:
        cap = f"{capability[0]}.{capability[1]}"
        if requested is None:
            default = default_flash_attn_version(capability)
            return [
                f"FlashAttention-{default} (the default on compute capability {cap}) is not available in "
                f"this build, and FlashAttention-4 needs compute capability >= 9.0"
            ]
        return [f"flash_attn_version 4 needs compute capability >= 9.0 (this device: {cap})"]
    return []


def kv_dtype_mismatch_reasons(config: AttentionSelectorConfig) -> list[str]:
    """FA4 reads the cache in the query's dtype: a 16-bit KV dtype other than the model's is a reason."""
    kv = config.kv_cache_dtype
    if kv in ("float16", "bfloat16") and config.dtype in ("float16", "bfloat16") and kv != config.dtype:
        return [
            f"kv_cache_dtype {kv} with dtype {config.dtype} not supported (FA4 needs the cache in the model dtype: use auto)"
        ]
    return []


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention-4 varlen attention: prefill chunks and decode tokens of a step in one call.

    K and V caches are (num_blocks, block_size, num_kv_heads, head_size) each, stacked in front
    (see get_kv_cache_shape). Capabilities below are the ones the GPU conformance test
    (tests/gpu/test_flash_attn_gpu.py) runs; FA4 itself accepts more.
    """

    name = "FLASH_ATTN"
    version = "FA4"
    description = (
        "FlashAttention-4 (CuTe DSL) varlen kernel with a page table; mixed prefill/decode in one call"
    )
    supported_dtypes = ("float16", "bfloat16")
    # FA4 reads fp8 caches only on SM 10.x; not verifiable on the H200, so not declared.
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16")
    # Pages smaller than FA4's key tile (128 on SM 9.0 for head sizes <= 128) take the non-TMA
    # paged path, which never reads rows past a sequence's length.
    block_sizes = OneOf((16, 32, 64))
    head_sizes = OneOf((64, 96, 128, 256))
    platforms = ("cuda",)
    min_capability = FA4_MIN_CAPABILITY
    max_capability = (11, 9)  # FA4's paged kernels: SM 9.x (Hopper), 10.x/11.x (Blackwell)
    supports_sink = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    attn_types = ("decoder",)
    # Decode graphs through the builder's hooks (fixed buffers, max_seqlen_k = max_model_len):
    # tests/gpu/test_cuda_graphs_gpu.py gave ids equal to eager on the H200 (12 of 12 prompts,
    # flash-attn-4 4.0.0b36). Steps with prefill run eagerly.
    cudagraph_support = "decode_only"
    required_package = "flash_attn"  # the FA4 wheel's module is flash_attn.cute
    pip_extra = "flash-attn"
    preferred_block_size = 16
    verified_on = "H200 (SM 9.0), 199 combinations; flash-attn-4 4.0.0b36"

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        reasons = kv_dtype_mismatch_reasons(config)
        if device.platform != "cuda":
            return reasons
        return reasons + flash_attn_version_reasons(
            getattr(config, "flash_attn_version", None), device.capability
        )

    @classmethod
    def missing_package_reason(cls) -> str | None:
        if _has_flash_attn_cute():
            return None
        return (
            "package flash_attn (FlashAttention-4, module flash_attn.cute) not installed "
            f"(pip install 'kvllm[{cls.pip_extra}]')"
        )

    impl_path = "kvllm.attention.backends.flash_attn_impl:FlashAttentionImpl"
    builder_path = "kvllm.attention.backends.flash_attn_impl:FlashAttentionMetadataBuilder"

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """K at [0], V at [1]; each (num_blocks, block_size, num_kv_heads, head_size), as FA4 pages it."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def _has_flash_attn_cute() -> bool:
    """Whether `flash_attn.cute` can be found, without executing any flash_attn code.

    `find_spec("flash_attn.cute")` would import the parent package, which for the classic
    flash-attn (FA2) wheel loads its CUDA extension; so look for the submodule on disk instead.
    """
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return False
    for location in spec.submodule_search_locations or ():
        if os.path.isfile(os.path.join(location, "cute", "__init__.py")):
            return True
    return False
