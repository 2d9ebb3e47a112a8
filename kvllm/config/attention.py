"""AttentionConfig: how the user steers attention-backend choice (no torch imported here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvllm.config.backend_names import MLA_PREFILL_BACKENDS, AttentionBackendEnum, BackendName
from kvllm.config.choices import KV_CACHE_DTYPES

# Fields some guides put in AttentionConfig although they are engine settings; EngineArgs moves
# them onto its own fields (block_size, max_model_len, kv_cache_dtype) and clears them here.
ENGINE_MAPPED_FIELDS = ("block_size", "max_seq_len", "fp8_enabled", "kv_cache_dtype")


@dataclass(frozen=True)
class AttentionConfig:
    """Attention settings, set with `-ac.KEY VALUE`, `-ac JSON` or `LLM(attention_config=...)`."""

    backend: BackendName | None = field(
        default=None,
        metadata={
            "help": "Attention backend to use (e.g. FLASH_ATTN, TRITON_ATTN, or auto-tune: the fastest one "
            "here, timed at start-up). Default: automatic choice."
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
        metadata={
            "help": "Prefill backend for MLA (DeepSeek) models: "
            + ", ".join(MLA_PREFILL_BACKENDS)
            + ". Default: the first valid one, in that order."
        },
    )
    use_prefill_query_quantization: bool = field(
        default=False,
        metadata={
            "help": "vLLM's fp8 query in MLA prefill; not implemented in kvllm (only false is accepted)."
        },
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Same setting as --block-size (tokens per KV-cache block); both given must agree."},
    )
    max_seq_len: int | None = field(
        default=None,
        metadata={"help": "Same setting as --max-model-len (prompt + output tokens); both given must agree."},
    )
    kv_cache_dtype: str | None = field(
        default=None,
        metadata={"help": "Same setting as --kv-cache-dtype; both given must agree."},
    )
    fp8_enabled: bool | None = field(
        default=None,
        metadata={
            "help": "true = an fp8 KV cache (--kv-cache-dtype fp8); false = an unquantized one. "
            "Weights are not affected."
        },
    )
    num_kv_heads: int | None = field(
        default=None,
        metadata={
            "help": "A check, not a setting: the model's KV head count (from its config.json) must equal it."
        },
    )

    def __post_init__(self) -> None:
        if self.backend is not None:
            object.__setattr__(self, "backend", AttentionBackendEnum.from_name(self.backend))
        if self.flash_attn_version is not None:
            version = _as_int("flash_attn_version", self.flash_attn_version)
            if version not in (2, 3, 4):
                raise ValueError(
                    f"attention_config.flash_attn_version={self.flash_attn_version!r} is not valid; allowed: 2, 3, 4"
                )
            object.__setattr__(self, "flash_attn_version", version)
        if self.mla_prefill_backend is not None:
            name = str(self.mla_prefill_backend).strip().upper()
            if name not in MLA_PREFILL_BACKENDS:
                raise ValueError(
                    f"attention_config.mla_prefill_backend={self.mla_prefill_backend!r} is not valid; "
                    f"allowed: {', '.join(MLA_PREFILL_BACKENDS)}"
                )
            object.__setattr__(self, "mla_prefill_backend", name)
        if _as_bool("use_prefill_query_quantization", self.use_prefill_query_quantization):
            raise ValueError(
                "attention_config.use_prefill_query_quantization=true is not supported: kvllm's MLA prefill "
                "runs in the model dtype (fp8 queries are not implemented); leave it false"
            )
        object.__setattr__(self, "use_prefill_query_quantization", False)
        if self.use_trtllm_attention is not None:
            object.__setattr__(
                self, "use_trtllm_attention", _as_bool("use_trtllm_attention", self.use_trtllm_attention)
            )
        for name in ("block_size", "max_seq_len", "num_kv_heads"):
            value = getattr(self, name)
            if value is not None:
                number = _as_int(name, value)
                if number <= 0:
                    raise ValueError(
                        f"attention_config.{name}={value!r} is not valid; allowed: a positive integer"
                    )
                object.__setattr__(self, name, number)
        if self.fp8_enabled is not None:
            object.__setattr__(self, "fp8_enabled", _as_bool("fp8_enabled", self.fp8_enabled))
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"attention_config.kv_cache_dtype={self.kv_cache_dtype!r} is not valid; "
                f"allowed: {', '.join(KV_CACHE_DTYPES)}"
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
