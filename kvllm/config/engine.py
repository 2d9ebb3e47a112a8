"""EngineArgs: every engine setting a user can pass, from the CLI or from `LLM(...)`.

The CLI parser is generated from these fields (help text from field metadata), so flags,
Python keyword arguments and docs cannot drift apart. No torch is imported here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvllm.config.attention import ENGINE_MAPPED_FIELDS, AttentionConfig
from kvllm.config.backend_names import AttentionBackendEnum, BackendName
from kvllm.config.choices import (
    DEVICES,
    DTYPES,
    GENERATION_CONFIGS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    canonical_dtype,
)
from kvllm.logger import init_logger

logger = init_logger(__name__)


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
    enforce_eager: bool = field(
        default=False, metadata=_help("Never capture CUDA graphs: every step runs eagerly.")
    )
    cudagraph_capture_sizes: list[int] | None = field(
        default=None,
        metadata=_help(
            "Decode batch sizes to capture CUDA graphs for (a batch runs in the smallest graph that holds "
            "it). Default: 1, 2, 4, then every 8 up to 256 and every 16 beyond, up to "
            "max_cudagraph_capture_size."
        ),
    )
    max_cudagraph_capture_size: int | None = field(
        default=None,
        metadata=_help(
            "Largest decode batch run in a CUDA graph; larger ones run eagerly. Default: min(max_num_seqs, 512)."
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=_help(
            "Overlap the host's work for the next step (scheduling, inputs, outputs) with the device's "
            "work for the current one (vLLM's flag); --no-async-scheduling waits for every step."
        ),
    )
    device: str = field(default="auto", metadata=_help(f"Device: {', '.join(DEVICES)}."))
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "auto: sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
            "come from the model's generation_config.json, as in vLLM; vllm: ignore that file."
        ),
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model code from the hub."))
    attention_backend: BackendName | None = field(
        default=None, metadata=_help("Attention backend (mutually exclusive with attention_config.backend).")
    )
    attention_config: AttentionConfig = field(
        default_factory=AttentionConfig,
        metadata=_help("Attention settings as JSON, or by key: -ac.backend X, -ac.flash_attn_version 3."),
    )
    # Accepted so that vLLM command lines and guides run; each one is an error or a warning below.
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "Weight quantization method (vLLM's flag). Only unset (None) in this version: AWQ, GPTQ, fp8 "
            "weights... are not available. Use an unquantized or a GGUF model."
        ),
    )
    speculative_config: str | None = field(
        default=None,
        metadata=_help("Speculative decoding settings (vLLM's flag). Not available in this version."),
    )
    speculative_decoding: str | None = field(
        default=None,
        metadata=_help(
            "Same as speculative_config (a name used by some guides). Not available in this version."
        ),
    )
    swap_space: float | None = field(
        default=None,
        metadata=_help(
            "CPU swap space in GiB (vLLM's flag). No effect: kvllm preempts by recomputation, never by swapping."
        ),
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
        _reject_unavailable_features(self)
        self._resolve_attention_config_fields()
        if self.swap_space is not None:
            _check_swap_space(self.swap_space)
        if self.attention_backend is not None:
            if self.attention_config.backend is not None:
                raise ValueError("attention_backend and attention_config.backend are mutually exclusive")
            backend = AttentionBackendEnum.from_name(self.attention_backend)
            set_("attention_backend", backend)
        set_("dtype", canonical_dtype(self.dtype))
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("generation_config", self.generation_config, GENERATION_CONFIGS)
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
        if self.max_cudagraph_capture_size is not None and (
            not isinstance(self.max_cudagraph_capture_size, int) or self.max_cudagraph_capture_size <= 0
        ):
            raise ValueError(
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size!r} is not valid; "
                "allowed: a positive integer"
            )
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if isinstance(sizes, str):
                sizes = [int(x) for x in sizes.replace(",", " ").split()] if sizes.strip() else []
            if not sizes or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes):
                raise ValueError(
                    f"cudagraph_capture_sizes={self.cudagraph_capture_sizes!r} is not valid; allowed: a "
                    "non-empty list of positive integers, e.g. [1, 2, 4, 8]"
                )
            set_("cudagraph_capture_sizes", sorted(set(sizes)))

    def _resolve_attention_config_fields(self) -> None:
        """Move attention_config's engine settings (block_size, max_seq_len, kv_cache_dtype,
        fp8_enabled) onto this object's fields, logging each mapping once; a value given both ways
        must agree. The fields are then cleared in attention_config, so a later `with_changes`
        cannot meet a stale copy. num_kv_heads stays there: ModelConfig checks it against the model.
        """
        ac = self.attention_config
        for ac_name, name, flag in (
            ("block_size", "block_size", "--block-size"),
            ("max_seq_len", "max_model_len", "--max-model-len"),
        ):
            value = getattr(ac, ac_name)
            if value is None:
                continue
            current = getattr(self, name)
            if current is not None and current != value:
                raise ValueError(
                    f"attention_config.{ac_name}={value} conflicts with {name}={current} ({flag}): they are "
                    f"the same setting; give it once, or the same value in both"
                )
            object.__setattr__(self, name, value)
            _log_once(f"attention_config.{ac_name}={value} is kvllm's {flag}; using {name}={value}")
        wanted = self._kv_cache_dtype_from_attention_config(ac)
        if wanted is not None:
            object.__setattr__(self, "kv_cache_dtype", wanted)
        if any(getattr(ac, name) is not None for name in ENGINE_MAPPED_FIELDS):
            object.__setattr__(self, "attention_config", replace(ac, **dict.fromkeys(ENGINE_MAPPED_FIELDS)))

    def _kv_cache_dtype_from_attention_config(self, ac: AttentionConfig) -> str | None:
        """The KV-cache dtype attention_config asks for (None: it asks nothing); conflicts raise.

        kv_cache_dtype="auto" on EngineArgs is the default and counts as not given.
        """
        current = self.kv_cache_dtype
        given = current != "auto"
        if ac.kv_cache_dtype is not None:
            if given and current != ac.kv_cache_dtype:
                raise ValueError(
                    f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r} conflicts with "
                    f"kv_cache_dtype={current!r} (--kv-cache-dtype): they are the same setting; give it once"
                )
            if ac.fp8_enabled is not None and ac.fp8_enabled != ac.kv_cache_dtype.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled={str(ac.fp8_enabled).lower()} conflicts with "
                    f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r}; keep only kv_cache_dtype"
                )
            _log_once(
                f"attention_config.kv_cache_dtype={ac.kv_cache_dtype!r} is kvllm's --kv-cache-dtype; "
                f"using kv_cache_dtype={ac.kv_cache_dtype!r}"
            )
            return ac.kv_cache_dtype
        if ac.fp8_enabled is None:
            return None
        if ac.fp8_enabled:
            if given and not current.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled=true asks for an fp8 KV cache but kv_cache_dtype={current!r} "
                    "(--kv-cache-dtype) asks for another; drop one of them"
                )
            wanted = current if given else "fp8"
        else:
            if current.startswith("fp8"):
                raise ValueError(
                    f"attention_config.fp8_enabled=false conflicts with kv_cache_dtype={current!r} "
                    "(--kv-cache-dtype); drop one of them"
                )
            wanted = current
        _log_once(
            f"attention_config.fp8_enabled={str(ac.fp8_enabled).lower()} is kvllm's --kv-cache-dtype "
            f"(fp8 KV cache; model weights unchanged); using kv_cache_dtype={wanted!r}"
        )
        return wanted

    @property
    def backend(self) -> BackendName | None:
        """The backend the user pinned, by either of the two ways, or None for automatic choice."""
        return self.attention_backend or self.attention_config.backend

    def with_changes(self, **changes: Any) -> EngineArgs:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# LLM(...) keyword arguments / CLI flags that name a model property, not an engine setting.
MODEL_PROPERTY_ARGS = {
    "num_heads": "num_attention_heads",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "head_size": "head_dim",
}

_logged: set[str] = set()


def _log_once(message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time only: EngineArgs is rebuilt from the same arguments several times
    (CLI validation, LLM, benchmarks), and the user needs each mapping said once."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def model_property_error(name: str, value: Any, flag: bool = False) -> ValueError:
    """The error for an attempt to set a model property (head count, head size) as an engine setting."""
    shown = f"--{name.replace('_', '-')} {value}" if flag else f"{name}={value!r}"
    return ValueError(
        f"{shown}: the number of attention heads, KV heads and the head size are properties of the model, "
        f"read from its config.json ({MODEL_PROPERTY_ARGS[name]}); kvllm cannot override them, since the "
        "weights were trained with those shapes. If an attention backend rejects the model's head size, "
        "choose a backend that supports it (the error lists them; `kvllm backends --model MODEL` shows "
        "every backend's verdict), or leave the backend unset for the automatic choice."
    )


def unknown_engine_argument_error(unknown: dict[str, Any]) -> Exception:
    """The error for `LLM(**kwargs)` keyword arguments (name -> value) that are not EngineArgs fields."""
    names = sorted(unknown)
    for name in names:
        if name in MODEL_PROPERTY_ARGS:
            return model_property_error(name, unknown[name])
    return TypeError(
        f"LLM() got unknown engine argument(s): {', '.join(names)}. "
        f"Valid arguments: {', '.join(EngineArgs.field_names())}"
    )


def _reject_unavailable_features(args: EngineArgs) -> None:
    if args.quantization is not None:
        raise ValueError(
            f"quantization={args.quantization!r}: quantized weights ({str(args.quantization).upper()}) are not "
            "available in this version of kvllm; the only supported value is None (unset). Use an unquantized "
            "model (float16/bfloat16/float32 safetensors) or a GGUF file (--load-format gguf, dequantized on "
            "load). To save KV-cache memory instead, use --kv-cache-dtype fp8."
        )
    for name in ("speculative_config", "speculative_decoding"):
        value = getattr(args, name)
        if value is not None:
            alias = " (vLLM's name for it is speculative_config)" if name == "speculative_decoding" else ""
            raise ValueError(
                f"{name}={value!r}: speculative decoding (Medusa, EAGLE, n-gram, draft models) is not "
                f"available in this version of kvllm{alias}. Remove {name}; kvllm decodes one token per "
                "sequence per step (tune throughput with max_num_seqs and max_num_batched_tokens)."
            )


def _check_swap_space(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"swap_space={value!r} is not valid; allowed: a number of GiB >= 0")
    _log_once(
        f"swap_space={value:g} has no effect: kvllm preempts by recomputation, not by swapping (a preempted "
        "request's KV blocks are freed and its tokens recomputed when it resumes), so no CPU swap space is "
        "used. To avoid preemption, give the KV cache more room (gpu_memory_utilization, "
        "kv_cache_memory_bytes) or lower max_num_seqs / max_model_len.",
        logging.WARNING,
    )


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
