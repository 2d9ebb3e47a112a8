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
}


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


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    module_name, class_name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module_name), class_name)
