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
        metadata={
            "help": "Attention backend to use (e.g. FLASH_ATTN, TRITON_ATTN). Default: automatic choice."
        },
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
        if self.flash_attn_version is not None:
            version = _as_int("flash_attn_version", self.flash_attn_version)
            if version not in (2, 3, 4):
                raise ValueError(
                    f"attention_config.flash_attn_version={self.flash_attn_version!r} is not valid; allowed: 2, 3, 4"
                )
            object.__setattr__(self, "flash_attn_version", version)
        if self.use_trtllm_attention is not None:
            object.__setattr__(
                self, "use_trtllm_attention", _as_bool("use_trtllm_attention", self.use_trtllm_attention)
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionConfig:
        """Build from a dict (JSON or dotted CLI keys); values may be strings, as the CLI gives them."""
        if not isinstance(data, dict):
            raise ValueError(
                f'attention_config must be a JSON object such as {{"backend": "FLASH_ATTN"}}, got {data!r}'
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Unknown attention_config field(s): {', '.join(unknown)}. Valid fields: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults, JSON-ready (the backend as its name)."""
        out: dict[str, Any] = {}
        for name, f in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if value != f.default:
                out[name] = value.name if isinstance(value, AttentionBackendEnum) else value
        return out


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"attention_config.{name}={value!r} is not valid; allowed: an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"attention_config.{name}={value!r} is not valid; allowed: an integer") from None


def _as_bool(name: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if isinstance(value, bool):
        return value
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"attention_config.{name}={value!r} is not valid; allowed: true/false or 1/0")
