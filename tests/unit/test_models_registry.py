"""The architecture registry."""

from __future__ import annotations

import pytest

from kvllm.models.registry import get_model_class, supported_architectures

CAUSAL_LMS = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "BertModel",
]


def test_supported_architectures() -> None:
    names = supported_architectures()
    assert names == sorted(names)
    assert set(CAUSAL_LMS) <= set(names)


@pytest.mark.parametrize("architecture", CAUSAL_LMS)
def test_every_architecture_imports_as_its_own_class(architecture: str) -> None:
    assert get_model_class([architecture]).__name__ == architecture


def test_get_model_class_takes_the_first_supported() -> None:
    cls = get_model_class(["SomethingElse", "Qwen3ForCausalLM"])
    assert cls.__name__ == "Qwen3ForCausalLM"
    assert cls.qk_norm


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM, MistralForCausalLM"
    ):
        get_model_class(["GPT2LMHeadModel"])
