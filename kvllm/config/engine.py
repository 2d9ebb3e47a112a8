"""EngineArgs: every engine setting a user can pass, from the CLI or from `LLM(...)`.

The CLI parser is generated from these fields (help text from field metadata), so flags,
Python keyword arguments and docs cannot drift apart. No torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvllm.attention.backend import KV_CACHE_DTYPES
from kvllm.attention.names import AttentionBackendEnum
from kvllm.config.attention import AttentionConfig

DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineArgs:
    """Engine settings with vLLM's names and defaults."""

    model: str | None = field(
        default=None,
        metadata=_help(
            "Local model folder, GGUF file or HF repo id. Default: the embedded SmolLM2-135M-Instruct."
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("Tokenizer folder or repo id (default: the model's).")
    )
    revision: str | None = field(default=None, metadata=_help("Model revision on the hub."))
    dtype: str = field(default="auto", metadata=_help(f"Model dtype: {', '.join(DTYPES)}."))
    max_model_len: int | None = field(
        default=None, metadata=_help("Maximum context length (prompt + output). Default: the model's.")
    )
    block_size: int | None = field(
        default=None,
        metadata=_help("Tokens per KV-cache block. Default: the attention backend's preferred size."),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("Fraction of GPU memory for weights, activations and KV cache (GPU only)."),
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help("KV-cache size in bytes; overrides gpu_memory_utilization. CPU default: 2 GiB."),
    )
    kv_cache_dtype: str = field(
        default="auto", metadata=_help(f"KV-cache dtype: {', '.join(KV_CACHE_DTYPES)}.")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("Reuse KV blocks of shared prompt prefixes.")
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("Split long prompts into chunks scheduled beside decodes.")
    )
    max_num_seqs: int = field(default=256, metadata=_help("Maximum number of sequences per step."))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help("Token budget per step. Default: 8192 (at least max_model_len without chunking)."),
    )
    seed: int = field(default=0, metadata=_help("Random seed."))
    load_format: str = field(default="auto", metadata=_help(f"Weight format: {', '.join(LOAD_FORMATS)}."))
    enforce_eager: bool = field(default=False, metadata=_help("Never capture CUDA graphs."))
    device: str = field(default="auto", metadata=_help(f"Device: {', '.join(DEVICES)}."))
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model code from the hub."))
    attention_backend: AttentionBackendEnum | None = field(
        default=None, metadata=_help("Attention backend (mutually exclusive with attention_config.backend).")
    )
    attention_config: AttentionConfig = field(
        default_factory=AttentionConfig,
        metadata=_help("Attention settings as JSON, or by key: -ac.backend X, -ac.flash_attn_version 3."),
    )

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        if isinstance(self.attention_config, str):
            set_(
                "attention_config",
                AttentionConfig.from_dict(_parse_json("attention_config", self.attention_config)),
            )
        elif isinstance(self.attention_config, dict):
            set_("attention_config", AttentionConfig.from_dict(self.attention_config))
        elif self.attention_config is None:
            set_("attention_config", AttentionConfig())
        elif not isinstance(self.attention_config, AttentionConfig):
            raise ValueError(
                f"attention_config={self.attention_config!r} is not valid; allowed: an AttentionConfig, "
                'a dict or a JSON string such as \'{"backend": "FLASH_ATTN"}\''
            )
        if self.attention_backend is not None:
            if self.attention_config.backend is not None:
                raise ValueError("attention_backend and attention_config.backend are mutually exclusive")
            backend = AttentionBackendEnum.from_name(self.attention_backend)
            set_("attention_backend", backend)
        dtype = {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype)
        set_("dtype", dtype)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("device", self.device, DEVICES)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range; allowed: (0, 1]"
            )
        for name in ("max_model_len", "block_size", "kv_cache_memory_bytes", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} is not valid; allowed: a positive integer")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} is not valid; allowed: a positive integer")

    @property
    def backend(self) -> AttentionBackendEnum | None:
        """The backend the user pinned, by either of the two ways, or None for automatic choice."""
        return self.attention_backend or self.attention_config.backend

    def with_changes(self, **changes: Any) -> EngineArgs:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _parse_json(name: str, text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f'{name}={text!r} is not valid JSON ({exc.msg}); e.g. \'{{"backend": "FLASH_ATTN"}}\''
        ) from None


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")
