"""ModelConfig: what the engine needs to know about the model, resolved from EngineArgs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvllm.config.choices import GENERATION_CONFIG_SAMPLING, MODEL_DTYPES
from kvllm.config.pooler import PoolerConfig
from kvllm.logger import init_logger
from kvllm.models import hf_config as rules
from kvllm.models.tokenizer import tokenizer_eos_id
from kvllm.platforms import current_device_info
from kvllm.platforms.interface import DeviceInfo
from kvllm.utils.dtypes import torch_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvllm.config.engine import EngineArgs
    from kvllm.layers.quantization.base import QuantizationConfig

logger = init_logger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """The resolved model: local folders, HF config, architecture, dtype, context length and shapes."""

    model: str  # what the user passed, or the default model's name
    model_path: str  # local HF folder: a given folder, a hub snapshot, or the folder a GGUF was converted to
    tokenizer_path: str
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    sliding_window: int | None  # the window of the layers that have one; None if all attend fully
    eos_token_ids: tuple[int, ...]
    # Sampling defaults from generation_config.json (as vLLM applies them): SamplingParams field -> value.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    runner_type: str = "generate"  # "pooling": prompts are embedded (see kvllm/models/pooling_config.py)
    pooler_config: PoolerConfig | None = None  # resolved, for runner_type "pooling"
    is_encoder_only: bool = (
        False  # bidirectional attention over the whole prompt (no chunking, no prefix cache)
    )

    quant_config: QuantizationConfig | None = None  # from --quantization and quantization_config

    @property
    def is_pooling(self) -> bool:
        return self.runner_type == "pooling"

    @classmethod
    def from_engine_args(cls, args: EngineArgs, device: torch.device) -> ModelConfig:
        from transformers import AutoConfig

        from kvllm.layers.quantization import get_quantization_config
        from kvllm.models import pooling_config
        from kvllm.models.registry import default_pooling_type, is_pooling_architecture, resolve_architecture

        hub = {"download_dir": args.download_dir, "hf_token": args.hf_token}
        model, model_path = _resolve_model(args.model, args.revision, **hub)
        tokenizer_path = model_path
        tokenizer_revision = args.tokenizer_revision or args.revision
        if args.tokenizer is not None:
            _, tokenizer_path = _resolve_model(args.tokenizer, tokenizer_revision, what="Tokenizer", **hub)
        elif tokenizer_revision != args.revision:
            _, tokenizer_path = _resolve_model(args.model, tokenizer_revision, what="Tokenizer", **hub)
        try:
            hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot read the model config (config.json) of {model!r} in {model_path!r}: {e}"
            ) from e
        hf_config = apply_hf_overrides(hf_config, args.hf_overrides)
        architecture = resolve_architecture(getattr(hf_config, "architectures", None))
        unsupported = rules.unsupported_config_reason(hf_config)
        if unsupported:
            raise ValueError(f"model {model!r} ({architecture}) cannot be loaded: {unsupported}")
        num_kv_heads = rules.num_kv_heads(hf_config)
        check_num_kv_heads(args.attention_config.num_kv_heads, num_kv_heads, model)
        runner_type = pooling_config.resolve_runner_type(
            args.runner, args.convert, architecture, model_path, is_pooling_architecture(architecture)
        )
        pooler = None
        max_model_len = args.max_model_len
        if runner_type == "pooling":
            pooler = pooling_config.resolve_pooler_config(
                args.pooler_config, model_path, default_pooling_type(architecture)
            )
            st_len = pooling_config.sentence_transformers_max_seq_length(model_path)
            if max_model_len is None and st_len is not None:
                max_model_len = min(st_len, getattr(hf_config, "max_position_embeddings", st_len))
        elif args.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models only; pass runner='pooling' with it")
        return cls(
            model=model,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            hf_config=hf_config,
            architecture=architecture,
            dtype=resolve_dtype(args.dtype, hf_config, device),
            max_model_len=resolve_max_model_len(max_model_len, hf_config),
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_size=rules.head_size(hf_config),
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            sliding_window=rules.sliding_window(hf_config),
            eos_token_ids=find_eos_token_ids(model_path, tokenizer_path, hf_config),
            default_sampling={
                **(
                    generation_config_sampling_defaults(model_path)
                    if args.generation_config == "auto"
                    else {}
                ),
                **generation_overrides(args.override_generation_config),
            },
            runner_type=runner_type,
            pooler_config=pooler,
            is_encoder_only=rules.is_encoder_only(hf_config),
            quant_config=get_quantization_config(args.quantization, hf_config),
        )


def apply_hf_overrides(hf_config: PretrainedConfig, overrides: Any) -> PretrainedConfig:
    """vLLM's --hf-overrides: a function of the config, or values set on it (a nested object updates
    a nested config, such as text_config; any other value replaces the attribute)."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        return overrides(hf_config)
    _update_config(hf_config, overrides, prefix="")
    return hf_config


def _update_config(config: Any, overrides: dict[str, Any], prefix: str) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            _update_config(current, value, prefix=f"{prefix}{key}.")
            continue
        logger.info("hf_overrides: %s%s = %r (config.json had %r)", prefix, key, value, current)
        setattr(config, key, value)


def generation_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """--override-generation-config as SamplingParams defaults (keys checked by EngineArgs)."""
    return {GENERATION_CONFIG_SAMPLING[key]: value for key, value in (overrides or {}).items()}


def generation_config_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The sampling settings a model ships in generation_config.json (empty when it has none)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("ignoring unreadable %s", path)
        return {}
    return {
        name: config[key] for key, name in GENERATION_CONFIG_SAMPLING.items() if config.get(key) is not None
    }


def check_num_kv_heads(expected: int | None, num_kv_heads: int, model: str) -> None:
    """attention_config.num_kv_heads is a check against the model, not a setting: equal, or an error."""
    if expected is None:
        return
    if expected != num_kv_heads:
        raise ValueError(
            f"attention_config.num_kv_heads={expected} does not match the model: {model!r} has "
            f"num_kv_heads={num_kv_heads} (num_key_value_heads in its config.json). The KV head count is a "
            f"property of the model and cannot be changed; set num_kv_heads={num_kv_heads} or drop it"
        )
    logger.info("attention_config.num_kv_heads=%d matches the model's KV head count", expected)


def _resolve_model(
    model: str | None,
    revision: str | None,
    what: str = "Model",
    download_dir: str | None = None,
    hf_token: str | None = None,
) -> tuple[str, str]:
    """(name to show, local HF folder) for a model argument: None, a folder, a GGUF file or a repo id."""
    from kvllm.models.default_model import DEFAULT_MODEL, default_model_path
    from kvllm.models.loader.gguf import converted_gguf_folder, is_gguf_file
    from kvllm.models.loader.hub import resolve_model_path

    if model is None or (model == DEFAULT_MODEL and not Path(model).exists()):
        return DEFAULT_MODEL, default_model_path()
    path = resolve_model_path(model, revision, what=what, cache_dir=download_dir, token=hf_token)
    if Path(path).is_file():
        if not is_gguf_file(path):
            raise ValueError(
                f"{what} path {model!r} is a file but not a GGUF file; pass a model folder or a .gguf file"
            )
        return model, converted_gguf_folder(path)
    return model, path


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """The model's torch dtype on `device` (see resolve_model_dtype for the rule)."""
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed: auto, {', '.join(MODEL_DTYPES)}")
    info = DeviceInfo("cpu")
    if torch.device(device).type == "cuda":
        info = current_device_info()
        if info.platform == "cpu":  # a CUDA device named without a GPU (tests): capability unknown
            info = DeviceInfo("cuda")
    return torch_dtype(rules.resolve_model_dtype(dtype, hf_config, info))


def resolve_max_model_len(max_model_len: int | None, hf_config: Any) -> int:
    supported = getattr(hf_config, "max_position_embeddings", None)
    if supported is None:
        if max_model_len is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return max_model_len
    if max_model_len is None:
        return int(supported)
    if max_model_len > supported:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model supports "
            f"(max_position_embeddings={supported}); pass max_model_len <= {supported}"
        )
    return max_model_len


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def find_eos_token_ids(model_path: str, tokenizer_path: str, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json and the tokenizer (the config's only if both have none)."""
    ids: list[int] = []
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        ids += _as_ids(json.loads(generation_config.read_text()).get("eos_token_id"))
    tokenizer_eos = tokenizer_eos_id(tokenizer_path)
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    if not ids:
        ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
