"""MLA prefill backends: which kernel attends for the prefill part of a step (pure Python).

MLA prefill up-projects each request's latent (context and new tokens) to full per-head keys
(qk_nope + rope, 192 for DeepSeek) and values (v_head_dim, 128) and runs ordinary causal
attention with those unequal head sizes; decode never does this (it attends in the latent).
Chosen with `-ac.mla_prefill_backend=NAME` (validated, failing with reasons) or automatically,
first valid in PRIORITY. Names are vLLM's, plus TORCH_SDPA, kvllm's own portable path.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from kvllm.config.backend_names import MLA_PREFILL_BACKENDS
from kvllm.logger import init_logger
from kvllm.platforms.interface import DeviceInfo

logger = init_logger(__name__)

# Automatic order (FlashAttention varlen first, as vLLM orders it).
PRIORITY = MLA_PREFILL_BACKENDS


@dataclass(frozen=True)
class MLAPrefillBackend:
    """One prefill backend's declaration."""

    name: str
    description: str
    platforms: tuple[str, ...]
    dtypes: tuple[str, ...]
    min_capability: tuple[int, int] | None = None
    required_package: str | None = None
    pip_extra: str | None = None
    # (qk, v) head-dim pairs it runs; empty = any.
    head_dims: tuple[tuple[int, int], ...] = ()
    # None: implemented by `impl_path`; otherwise why this build cannot run it.
    not_available: str | None = None
    impl_path: str = ""

    def get_impl_cls(self) -> type:
        """The torch side (an MLAPrefillImpl subclass), imported on first use."""
        if not self.impl_path:
            raise NotImplementedError(f"MLA prefill backend {self.name} has no implementation in this build")
        module_name, _, class_name = self.impl_path.partition(":")
        return getattr(importlib.import_module(module_name), class_name)

    def reasons(self, device: DeviceInfo, dtype: str, head_dims: tuple[int, int] | None = None) -> list[str]:
        """Every reason this backend cannot run the prefill of an MLA model in `dtype` on `device`, with
        per-head (qk, v) dims `head_dims` (qk_nope + rope, v_head_dim) when known."""
        reasons = []
        if head_dims is not None and self.head_dims and tuple(head_dims) not in self.head_dims:
            allowed = ", ".join(f"qk {qk} / v {v}" for qk, v in self.head_dims)
            reasons.append(
                f"head dims qk {head_dims[0]} / v {head_dims[1]} not supported (supported: {allowed})"
            )
        if device.platform not in self.platforms:
            reasons.append(
                f"platform {device.platform} not supported (supported: {', '.join(self.platforms)})"
            )
        elif self.min_capability is not None and device.capability is not None:
            if device.capability < self.min_capability:
                lo = self.min_capability
                cap = device.capability
                reasons.append(
                    f"compute capability {cap[0]}.{cap[1]} not supported (needs >= {lo[0]}.{lo[1]})"
                )
        if dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} not supported (supported: {', '.join(self.dtypes)})")
        if self.required_package and importlib.util.find_spec(self.required_package) is None:
            hint = f" (pip install 'kvllm[{self.pip_extra}]')" if self.pip_extra else ""
            reasons.append(f"package {self.required_package} not installed{hint}")
        if self.not_available:
            reasons.append(self.not_available)
        return reasons


_SIXTEEN_BIT = ("float16", "bfloat16")
DECLARATIONS: dict[str, MLAPrefillBackend] = {
    b.name: b
    for b in (
        MLAPrefillBackend(
            "FLASH_ATTN",
            "FlashAttention varlen (FA3/FA4) over up-projected keys and values",
            ("cuda",),
            _SIXTEEN_BIT,
            min_capability=(9, 0),
            required_package="flash_attn",
            pip_extra="flash-attn",
            head_dims=((192, 128),),
            not_available="no FlashAttention MLA prefill binding in this build (qk 192 / v 128 unverified with FA4)",
        ),
        MLAPrefillBackend(
            "FLASHINFER",
            "FlashInfer BatchPrefillWithRaggedKVCacheWrapper (qk 192 / v 128)",
            ("cuda",),
            _SIXTEEN_BIT,
            min_capability=(8, 0),
            required_package="flashinfer",
            pip_extra="flashinfer",
            head_dims=((192, 128),),
            impl_path="kvllm.attention.backends.mla.prefill_flashinfer:FlashInferMLAPrefill",
        ),
        MLAPrefillBackend(
            "TRTLLM_RAGGED",
            "TRT-LLM ragged prefill through FlashInfer (SM 10.x)",
            ("cuda",),
            _SIXTEEN_BIT,
            min_capability=(10, 0),
            not_available="TRT-LLM ragged prefill targets SM 10.x, which could not be verified here; not in this build",
        ),
        MLAPrefillBackend(
            "CUDNN",
            "cuDNN SDPA prefill",
            ("cuda",),
            _SIXTEEN_BIT,
            not_available="no cuDNN MLA prefill binding in this build",
        ),
        MLAPrefillBackend(
            "TORCH_SDPA",
            "torch scaled_dot_product_attention per prefill request (kvllm's portable path)",
            ("cuda", "rocm", "cpu"),
            ("float16", "bfloat16", "float32"),
            impl_path="kvllm.attention.backends.mla.prefill_impl:TorchSDPAPrefill",
        ),
    )
}


def check_prefill_backend_name(name: str) -> str:
    """The canonical name, or ValueError listing the valid ones."""
    key = str(name).strip().upper()
    if key not in DECLARATIONS:
        raise ValueError(
            f"Unknown MLA prefill backend: {name!r}. Valid options are: {', '.join(MLA_PREFILL_BACKENDS)}"
        )
    return key


def choose_prefill_backend(
    device: DeviceInfo, dtype: str, requested: str | None = None, head_dims: tuple[int, int] | None = None
) -> MLAPrefillBackend:
    """The requested prefill backend if it can run (else ValueError with its reasons), or the first valid."""
    if requested is not None:
        backend = DECLARATIONS[check_prefill_backend_name(requested)]
        reasons = backend.reasons(device, dtype, head_dims)
        if reasons:
            raise ValueError(
                f"Selected MLA prefill backend {backend.name} is not valid for this configuration. "
                f"Reason: {reasons}"
            )
        return backend
    rejected = {}
    for name in PRIORITY:
        reasons = DECLARATIONS[name].reasons(device, dtype, head_dims)
        if not reasons:
            for other, other_reasons in rejected.items():
                logger.info(
                    "MLA prefill backend %s (higher priority) rejected: %s", other, "; ".join(other_reasons)
                )
            return DECLARATIONS[name]
        rejected[name] = reasons
    raise ValueError(
        f"No valid MLA prefill backend for {device.describe()} and dtype {dtype}. Reasons: {rejected}"
    )
