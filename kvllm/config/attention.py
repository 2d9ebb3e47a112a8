"""AttentionConfig: how the user steers attention-backend choice (no torch imported here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvllm.attention.names import AttentionBackendEnum


@dataclass(frozen=True)
class AttentionConfig:
    """Attention settings, set with `-ac.KEY VALUE`, `-ac JSON` or `LLM(attention_config=...)`."""

    backend: AttentionBackendEnum | None = field(
        default=None,
        metadata={"help": "Attention backend to use (e.g. FLASH_ATTN, TRITON_ATTN). Default: automatic choice."},
    )
    flash_attn_version: int | None = field(
        default=None,
        metadata={"help": "FlashAttention version for FLASH_ATTN (2, 3 or 4). Default depends on the GPU."},
    )
    use_trtllm_attention: bool | None = field(
        default=None,
        metadata={"help": "FLASHINFER: use TRT-LLM attention kernels (SM 10.x only). Default: auto."},
    )
    mla_prefill_backend: str | None = field(
        default=None,
        metadata={"help": "Prefill backend for MLA models. Default: automatic."},
    )

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, AttentionBackendEnum):
            object.__setattr__(self, "backend", AttentionBackendEnum.from_name(self.backend))
        if self.flash_attn_version is not None and self.flash_attn_version not in (2, 3, 4):
            raise ValueError(
                f"attention_config.flash_attn_version={self.flash_attn_version!r} is not valid; allowed: 2, 3, 4"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Unknown attention_config field(s): {', '.join(unknown)}. Valid fields: {', '.join(sorted(known))}"
            )
        return cls(**data)
