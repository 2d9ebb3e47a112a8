"""The attention-backend contract: declarations and validation.

This module is pure Python (no torch, no CUDA, no kernel library) so that every backend's
declarations can be imported anywhere: by the selector, by `kvllm backends`, and by the docs
generator. The torch side of a backend (per-layer implementation and per-step metadata builder)
lives in `kvllm.attention.impl` and in each backend's own `*_impl` module, imported lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvllm.platforms.interface import DeviceInfo

if TYPE_CHECKING:
    import torch

    from kvllm.attention.impl import AttentionImpl, AttentionMetadataBuilder


@dataclass(frozen=True)
class MultipleOf:
    """A size rule: any positive multiple of `factor`, optionally bounded."""

    factor: int
    minimum: int | None = None
    maximum: int | None = None

    def allows(self, value: int) -> bool:
        if value <= 0 or value % self.factor:
            return False
        if self.minimum is not None and value < self.minimum:
            return False
        return self.maximum is None or value <= self.maximum

    def describe(self) -> str:
        text = f"multiples of {self.factor}" if self.factor > 1 else "any"
        if self.minimum is not None:
            text += f", >= {self.minimum}"
        if self.maximum is not None:
            text += f", <= {self.maximum}"
        return text

    def short(self) -> str:
        text = f"%{self.factor}" if self.factor > 1 else "any"
        if self.minimum is not None:
            text += f", ≥{self.minimum}"
        if self.maximum is not None:
            text += f", ≤{self.maximum}"
        return text


@dataclass(frozen=True)
class OneOf:
    """A size rule: an explicit list of allowed values."""

    values: tuple[int, ...]

    def allows(self, value: int) -> bool:
        return value in self.values

    def describe(self) -> str:
        return ", ".join(str(v) for v in self.values)

    def short(self) -> str:
        return self.describe()


SizeRule = MultipleOf | OneOf


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """Everything backend choice depends on. Hashable: it is also the cache key of the choice."""

    head_size: int
    dtype: str  # model dtype name: float16, bfloat16, float32
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None unless the user pinned it
    use_mla: bool = False
    has_sink: bool = False
    has_sliding_window: bool = False
    logits_soft_cap: float | None = None
    use_alibi: bool = False
    attn_type: str = "decoder"
    use_non_causal: bool = False
    use_mm_prefix: bool = False
    # Backend-specific knobs from AttentionConfig; None = the backend's default for the device.
    flash_attn_version: int | None = None
    use_trtllm_attention: bool | None = None

    def __str__(self) -> str:
        parts = [
            f"head_size={self.head_size}",
            f"dtype={self.dtype}",
            f"kv_cache_dtype={self.kv_cache_dtype}",
            f"block_size={self.block_size}",
            f"attn_type={self.attn_type}",
        ]
        for flag in (
            "use_mla",
            "has_sink",
            "has_sliding_window",
            "use_alibi",
            "use_non_causal",
            "use_mm_prefix",
        ):
            if getattr(self, flag):
                parts.append(f"{flag}=True")
        for knob in ("logits_soft_cap", "flash_attn_version", "use_trtllm_attention"):
            if getattr(self, knob) is not None:
                parts.append(f"{knob}={getattr(self, knob)}")
        return "AttentionSelectorConfig(" + ", ".join(parts) + ")"


class AttentionBackend:
    """Base of every backend. Subclasses override the class-level declarations below.

    Declarations state what the implementation does and the tests show, nothing more: the
    declared-equals-implemented test runs every declared combination through the kernels.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = ""
    description: ClassVar[str] = ""
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16")
    block_sizes: ClassVar[SizeRule] = MultipleOf(16)
    head_sizes: ClassVar[SizeRule] = MultipleOf(8)
    platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    min_capability: ClassVar[tuple[int, int] | None] = None
    max_capability: ClassVar[tuple[int, int] | None] = None  # inclusive major.minor
    supports_sink: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = False
    supports_non_causal: ClassVar[bool] = False
    supports_mm_prefix: ClassVar[bool] = False
    is_mla: ClassVar[bool] = False
    is_sparse: ClassVar[bool] = False
    attn_types: ClassVar[tuple[str, ...]] = ("decoder",)
    # What the engine captures in CUDA graphs with this backend: "never" (every step eager),
    # "decode_only" (uniform single-token decode steps; steps with prefill run eagerly), "always".
    cudagraph_support: ClassVar[str] = "never"
    required_package: ClassVar[str | None] = None  # import name of the kernel library
    pip_extra: ClassVar[str | None] = None  # pip install 'kvllm[<extra>]'
    preferred_block_size: ClassVar[int] = 16
    # Where the declared combinations were last run against the float32 reference
    # (the declared-equals-implemented tests); "" = not yet run on its target hardware.
    verified_on: ClassVar[str] = ""
    kv_cache_layout: ClassVar[str] = "NHD"  # cache shape, see get_kv_cache_shape

    # ---- validation -------------------------------------------------------------------------

    @classmethod
    def validate_configuration(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        """Every reason this backend cannot serve `config` on `device`; empty means valid."""
        reasons: list[str] = []
        if device.platform not in cls.platforms:
            reasons.append(
                f"platform {device.platform} not supported (supported: {', '.join(cls.platforms)})"
            )
        elif device.capability is not None:
            reasons.extend(cls._capability_reasons(device.capability))
        if config.use_mla != cls.is_mla:
            reasons.append(
                "MLA attention needs an MLA backend"
                if config.use_mla
                else "MLA backend cannot serve standard (non-MLA) attention"
            )
        if config.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {config.dtype} not supported (supported: {', '.join(cls.supported_dtypes)})"
            )
        # Encoder-only layers keep no KV cache, so the KV dtype cannot disqualify them.
        if config.attn_type != "encoder_only" and config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype {config.kv_cache_dtype} not supported "
                f"(supported: {', '.join(cls.supported_kv_cache_dtypes)})"
            )
        if not cls.head_sizes.allows(config.head_size):
            reasons.append(
                f"head_size {config.head_size} not supported (supported: {cls.head_sizes.describe()})"
            )
        if config.block_size is not None and not cls.block_sizes.allows(config.block_size):
            reasons.append(
                f"block_size {config.block_size} not supported (supported: {cls.block_sizes.describe()})"
            )
        if config.attn_type not in cls.attn_types:
            reasons.append(
                f"attention type {config.attn_type} not supported (supported: {', '.join(cls.attn_types)})"
            )
        for name, wanted, supported in cls._feature_flags(config):
            if wanted and not supported:
                reasons.append(f"{name} not supported (the model needs it; this backend has none)")
        reasons.extend(cls.extra_reasons(config, device))
        missing = cls.missing_package_reason()
        if missing:
            reasons.append(missing)
        return reasons

    @classmethod
    def _feature_flags(cls, config: AttentionSelectorConfig) -> list[tuple[str, bool, bool]]:
        """(feature, config wants it, backend supports it) for every optional feature."""
        soft_cap = (
            f"logits soft-cap {config.logits_soft_cap}" if config.logits_soft_cap else "logits soft-cap"
        )
        return [
            ("attention sinks", config.has_sink, cls.supports_sink),
            ("sliding window", config.has_sliding_window, cls.supports_sliding_window),
            (soft_cap, bool(config.logits_soft_cap), cls.supports_logits_soft_cap),
            ("ALiBi", config.use_alibi, cls.supports_alibi),
            ("non-causal attention", config.use_non_causal, cls.supports_non_causal),
            ("multimodal prefix attention", config.use_mm_prefix, cls.supports_mm_prefix),
        ]

    @classmethod
    def _capability_reasons(cls, capability: tuple[int, int]) -> list[str]:
        lo, hi = cls.min_capability, cls.max_capability
        if (lo is None or capability >= lo) and (hi is None or capability <= hi):
            return []
        return [
            f"compute capability {capability[0]}.{capability[1]} not supported (needs {cls.capability_text()})"
        ]

    @classmethod
    def capability_text(cls) -> str:
        lo, hi = cls.min_capability, cls.max_capability
        if lo is None and hi is None:
            return "any"
        if hi is None:
            return f">= {lo[0]}.{lo[1]}"
        if lo is None:
            return f"<= {hi[0]}.{hi[1]}"
        if lo[0] == hi[0]:
            return f"{lo[0]}.x" if lo[1] == 0 and hi[1] >= 9 else f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"
        return f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"

    @classmethod
    def cudagraphs_off_reason(cls, device_type: str) -> str | None:
        """Why this process's settings keep steps out of the CUDA graphs the backend declares
        (`cudagraph_support`), or None when they are captured as declared."""
        return None

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        """Backend-specific reasons beyond the declarations (override as needed)."""
        return []

    @classmethod
    def missing_package_reason(cls) -> str | None:
        """A reason naming the pip extra when the kernel package is absent (found without importing it)."""
        if cls.required_package is None:
            return None
        if importlib.util.find_spec(cls.required_package.split(".")[0]) is None:
            hint = f" (pip install 'kvllm[{cls.pip_extra}]')" if cls.pip_extra else ""
            return f"package {cls.required_package} not installed{hint}"
        return None

    # ---- the torch side, imported lazily ---------------------------------------------------------

    # "module:Class" of the torch side, imported on first use so declarations stay importable anywhere.
    impl_path: ClassVar[str] = ""
    builder_path: ClassVar[str] = ""

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return _import_class(cls.impl_path, cls.name, "impl_path")

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return _import_class(cls.builder_path, cls.name, "builder_path")

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache. Default: K and V stacked in front, NHD pages."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...] | None:
        """The order in memory of get_kv_cache_shape's dimensions, outermost first (vLLM's hook of the same
        name); None = as the shape lists them. Kernels then see the logical shape with these strides."""
        return None

    @classmethod
    def allocate_kv_cache(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> torch.Tensor:
        """One layer's cache, zeroed (kernels may read, and mask, slots never written): the logical shape of
        get_kv_cache_shape laid out in memory in get_kv_cache_stride_order."""
        import torch

        shape = cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        order = cls.get_kv_cache_stride_order()
        if order is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        if sorted(order) != list(range(len(shape))):
            raise ValueError(
                f"{cls.name}: stride order {order} is not a permutation of {len(shape)} dimensions"
            )
        physical = torch.zeros([shape[i] for i in order], dtype=dtype, device=device)
        return physical.permute([order.index(i) for i in range(len(shape))])


def _import_class(path: str, backend_name: str, attribute: str) -> type:
    if not path:
        raise NotImplementedError(f"attention backend {backend_name} declares no {attribute}")
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
