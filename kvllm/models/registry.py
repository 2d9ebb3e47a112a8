"""HF `architectures` names -> model classes, imported only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvllm.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("kvllm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kvllm.models.llama", "Qwen3ForCausalLM"),
    "BertModel": ("kvllm.models.bert", "BertModel"),
    "DeepseekV2ForCausalLM": ("kvllm.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("kvllm.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "Phi3ForCausalLM": ("kvllm.models.llama", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("kvllm.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("kvllm.models.gemma", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("kvllm.models.gpt_oss", "GptOssForCausalLM"),
    "Qwen3MoeForCausalLM": ("kvllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("kvllm.models.qwen3_moe", "MixtralForCausalLM"),
}

# Embedding architectures (run with --runner pooling only) -> their default pooling type, as vLLM's.
# Causal LMs converted to embedding models (--convert embed) pool the LAST token by default.
_POOLING_MODELS: dict[str, str] = {"BertModel": "CLS"}
CONVERTED_DEFAULT_POOLING = "LAST"


def is_pooling_architecture(architecture: str) -> bool:
    return architecture in _POOLING_MODELS


def default_pooling_type(architecture: str) -> str:
    return _POOLING_MODELS.get(architecture, CONVERTED_DEFAULT_POOLING)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(architectures: list[str] | None) -> str:
    """The first of a config's `architectures` that kvllm implements; ValueError if none is."""
    for arch in architectures or []:
        if arch in _MODELS:
            return arch
    raise ValueError(
        f"model architecture {architectures!r} is not supported; supported: {', '.join(supported_architectures())}"
    )


def unsupported_model_reason(hf_config: object) -> str | None:
    """Why kvllm cannot load a model of this config (its architecture, or an option of it), or None."""
    from kvllm.models.hf_config import unsupported_config_reason

    try:
        architecture = resolve_architecture(getattr(hf_config, "architectures", None))
    except ValueError as exc:
        return str(exc)
    reason = unsupported_config_reason(hf_config)
    return f"{architecture}: {reason}" if reason else None


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    module_name, class_name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module_name), class_name)
