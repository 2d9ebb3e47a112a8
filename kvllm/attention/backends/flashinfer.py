"""FLASHINFER: FlashInfer 0.5.x paged-KV decode and prefill wrappers.

Declarations only: importable without torch or flashinfer. The kernel side lives in
`flashinfer_impl`, imported when the backend is bound to a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig, OneOf
from kvllm.platforms.interface import DeviceInfo


def trtllm_attention_reasons(
    use_trtllm_attention: bool | None, capability: tuple[int, int] | None
) -> list[str]:
    """TRT-LLM attention kernels are not part of this build; asking for them is always a reason."""
    if not use_trtllm_attention:
        return []
    if capability is not None and capability[0] == 10:
        return [
            "use_trtllm_attention: the TRT-LLM kernels for compute capability 10.x could not be verified "
            "in this build (set use_trtllm_attention=False to use FlashInfer's own kernels)"
        ]
    where = f" (this device: {capability[0]}.{capability[1]})" if capability is not None else ""
    return [
        "use_trtllm_attention needs compute capability 10.x (TRT-LLM kernels), which this build could not verify"
        + where
    ]


def kv_dtype_mismatch_reasons(config: AttentionSelectorConfig) -> list[str]:
    """A 16-bit KV dtype other than the model's is unverified (and FA3 prefill kernels refuse it)."""
    kv = config.kv_cache_dtype
    if kv in ("float16", "bfloat16") and config.dtype in ("float16", "bfloat16") and kv != config.dtype:
        return [
            f"kv_cache_dtype {kv} with dtype {config.dtype} not supported (use auto: the cache in the model dtype)"
        ]
    return []


def _implemented_and_verified(implemented: tuple[int, ...], verified: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(v for v in implemented if v in verified)


@dataclass(frozen=True)
class VerifiedAxes:
    """What passed the conformance walk for one (model dtype, cache dtype) pair."""

    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    sliding_window: bool
    logits_soft_cap: bool


def cache_dtype_name(dtype: str, kv_cache_dtype: str) -> str:
    """The dtype the cache holds: `auto` is the model's, `fp8` is e4m3 (one FlashInfer module each)."""
    return {"auto": dtype, "fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)


def describe_pairs(pairs: list[tuple[str, str]]) -> str:
    """(model dtype, cache dtype) pairs in words, caches grouped by model dtype: "dtype bfloat16 with a
    bfloat16, fp8_e4m3 or fp8_e5m2 cache"."""
    caches: dict[str, list[str]] = {}
    for dtype, cache in pairs:
        caches.setdefault(dtype, []).append(cache)
    return "; ".join(f"dtype {dtype} with a {_or(names)} cache" for dtype, names in caches.items())


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


class FlashInferBackend(AttentionBackend):
    """FlashInfer: BatchDecodeWithPagedKVCacheWrapper for the decode part of a step and
    BatchPrefillWithPagedKVCacheWrapper for its prefill part, planned once per step.

    Cache layout NHD, K and V interleaved per page: (num_blocks, 2, block_size, num_kv_heads,
    head_size). The declarations are the part of what the kernel side implements (IMPLEMENTED_*)
    that has passed the conformance walk on SM 9.0 (H200, H100) with FlashInfer 0.5.3 (VERIFIED_*): the walk
    (`benchmarks/h200/backend_walk.py`, or tests/gpu/test_flashinfer_gpu.py's `widen` part) runs
    everything implemented, and its summary prints the VERIFIED_* lines that what passed allows.
    Widening is one line per feature below; the declarations follow from them.
    """

    # Implemented by flashinfer_impl; each (dtype, KV dtype, head size, feature) costs FlashInfer one
    # to two minutes of first-use compiling on the H200, which is why verification comes in parts.
    IMPLEMENTED_HEAD_SIZES: ClassVar[tuple[int, ...]] = (64, 128, 256)
    IMPLEMENTED_BLOCK_SIZES: ClassVar[tuple[int, ...]] = (16, 32, 64)
    IMPLEMENTS_SLIDING_WINDOW: ClassVar[bool] = True
    IMPLEMENTS_LOGITS_SOFT_CAP: ClassVar[bool] = True
    # Passed on SM 9.0 (FlashInfer 0.5.3) for every model dtype and cache: one line per feature, from the
    # walk's summary. All 27 cases (head sizes 64/128/256 x blocks 16/32/64 x none/window/soft-cap) of all
    # six pairs (bfloat16 / float16 models with their own, fp8_e4m3 and fp8_e5m2 caches), 961 of 961 rows,
    # on H100s (SM 9.0): bfloat16 in the twenty-fifth and twenty-sixth sessions, float16 completed in the
    # twenty-seventh (docs/benchmarks/h200/session25, session26 and session27 fi-walk-results); head size
    # 128 with blocks 16/32 on the H200 since the eighth.
    VERIFIED_HEAD_SIZES: ClassVar[tuple[int, ...]] = (64, 128, 256)
    VERIFIED_BLOCK_SIZES: ClassVar[tuple[int, ...]] = (16, 32, 64)
    VERIFIED_SLIDING_WINDOW: ClassVar[bool] = True
    VERIFIED_LOGITS_SOFT_CAP: ClassVar[bool] = True
    # Per (model dtype, cache dtype) pair, what passed beyond the lines above (a walk that covers some pairs
    # completely and others not): none left, every pair passed everything.
    VERIFIED_BY_DTYPES: ClassVar[dict[tuple[str, str], VerifiedAxes]] = {}
    # fp8 KV caches (stored K / k_scale, read back with k_scale/v_scale): the GPU test's fp8 walk
    # (both model dtypes, fp8_e4m3 and fp8_e5m2, block sizes 16/32/64, head size 128) passed on the H200.
    FP8_KV_CACHE_VERIFIED: ClassVar[bool] = True

    name = "FLASHINFER"
    version = ""
    description = "FlashInfer paged-KV decode and prefill wrappers (plan once per step, run per layer)"
    supported_dtypes = ("float16", "bfloat16")
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16") + (
        ("fp8", "fp8_e4m3", "fp8_e5m2") if FP8_KV_CACHE_VERIFIED else ()
    )
    # Declared: what passed for any pair; extra_reasons narrows it to what passed for the config's own pair.
    block_sizes = OneOf(
        _implemented_and_verified(
            IMPLEMENTED_BLOCK_SIZES,
            VERIFIED_BLOCK_SIZES + tuple(b for v in VERIFIED_BY_DTYPES.values() for b in v.block_sizes),
        )
    )
    head_sizes = OneOf(
        _implemented_and_verified(
            IMPLEMENTED_HEAD_SIZES,
            VERIFIED_HEAD_SIZES + tuple(h for v in VERIFIED_BY_DTYPES.values() for h in v.head_sizes),
        )
    )
    platforms = ("cuda",)
    min_capability = (8, 0)
    max_capability = (10, 9)
    # FlashInfer 0.5.3 has sink kernels on SM 9.0 (BatchAttentionWithAttentionSinkWrapper, XQA decode)
    # that flashinfer_impl does not call yet; vLLM's TRT-LLM path for SM 10.x is not built here.
    supports_sink = False
    supports_sliding_window = IMPLEMENTS_SLIDING_WINDOW and (
        VERIFIED_SLIDING_WINDOW or any(v.sliding_window for v in VERIFIED_BY_DTYPES.values())
    )
    supports_logits_soft_cap = IMPLEMENTS_LOGITS_SOFT_CAP and (
        VERIFIED_LOGITS_SOFT_CAP or any(v.logits_soft_cap for v in VERIFIED_BY_DTYPES.values())
    )
    attn_types = ("decoder",)
    # Decode graphs through the builder's hooks (a graph decode wrapper per batch size, planned
    # before each replay): tests/gpu/test_cuda_graphs_gpu.py gave ids equal to eager on the H200
    # (12 of 12 prompts, flashinfer 0.5.3). Steps with prefill run eagerly.
    cudagraph_support = "decode_only"
    required_package = "flashinfer"
    pip_extra = "flashinfer"
    preferred_block_size = 16
    verified_on = "H200 and H100 (SM 9.0), flashinfer 0.5.3"
    kv_cache_layout = "NHD"

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        reasons = kv_dtype_mismatch_reasons(config) + cls._pending_verification_reasons(config)
        if device.platform != "cuda":
            return reasons
        return reasons + trtllm_attention_reasons(
            getattr(config, "use_trtllm_attention", None), device.capability
        )

    @classmethod
    def verified_everywhere(cls) -> VerifiedAxes:
        """What the walk verified for every (model dtype, cache dtype) pair (the VERIFIED_* lines)."""
        return VerifiedAxes(
            cls.VERIFIED_HEAD_SIZES,
            cls.VERIFIED_BLOCK_SIZES,
            cls.VERIFIED_SLIDING_WINDOW,
            cls.VERIFIED_LOGITS_SOFT_CAP,
        )

    @classmethod
    def verified_axes(cls, config: AttentionSelectorConfig) -> VerifiedAxes:
        """What the walk verified for the config's (model dtype, cache dtype) pair."""
        pair = (config.dtype, cache_dtype_name(config.dtype, config.kv_cache_dtype))
        return cls.VERIFIED_BY_DTYPES.get(pair, cls.verified_everywhere())

    @classmethod
    def _pending_verification_reasons(cls, config: AttentionSelectorConfig) -> list[str]:
        """Says so when what rules this backend out is implemented but not yet verified on a GPU, for
        every pair or for this config's (model dtype, cache dtype) pair."""
        verified = cls.verified_axes(config)
        pairs = list(cls.VERIFIED_BY_DTYPES.values())
        pending, elsewhere = [], []

        def check(name: str, implemented: bool, passed_here: bool, passed_for_a_pair: bool) -> None:
            if implemented and not passed_here:
                (elsewhere if passed_for_a_pair else pending).append(name)

        head = config.head_size
        check(f"head_size {head}", head in cls.IMPLEMENTED_HEAD_SIZES, head in verified.head_sizes,
              any(head in v.head_sizes for v in pairs))  # fmt: skip
        block = config.block_size
        if block is not None:
            check(f"block_size {block}", block in cls.IMPLEMENTED_BLOCK_SIZES, block in verified.block_sizes,
                  any(block in v.block_sizes for v in pairs))  # fmt: skip
        if config.has_sliding_window:
            check("sliding window", cls.IMPLEMENTS_SLIDING_WINDOW, verified.sliding_window,
                  any(v.sliding_window for v in pairs))  # fmt: skip
        if config.logits_soft_cap:
            check("logits soft-cap", cls.IMPLEMENTS_LOGITS_SOFT_CAP, verified.logits_soft_cap,
                  any(v.logits_soft_cap for v in pairs))  # fmt: skip
        reasons = []
        if pending:
            reasons.append(
                f"{', '.join(pending)}: implemented for FLASHINFER but not yet verified on an H200, so not "
                "declared (benchmarks/h200/backend_walk.py flashinfer)"
            )
        if elsewhere:
            verified_pairs = describe_pairs(list(cls.VERIFIED_BY_DTYPES))
            reasons.append(
                f"{', '.join(elsewhere)}: verified for FLASHINFER with {verified_pairs} only, not yet with dtype "
                f"{config.dtype} and kv_cache_dtype {config.kv_cache_dtype} "
                "(benchmarks/h200/backend_walk.py flashinfer)"
            )
        return reasons

    impl_path = "kvllm.attention.backends.flashinfer_impl:FlashInferImpl"
    builder_path = "kvllm.attention.backends.flashinfer_impl:FlashInferMetadataBuilder"

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """FlashInfer's single-tensor NHD layout: kv_cache[:, 0] is K, kv_cache[:, 1] is V."""
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
