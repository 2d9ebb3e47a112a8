"""The architecture registry."""

from __future__ import annotations

import pytest

from kvllm.models.registry import get_model_class, supported_architectures


def test_supported_architectures() -> None:
    assert supported_architectures() == [
        "BertModel",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ]


def test_get_model_class_takes_the_first_supported() -> None:
    cls = get_model_class(["SomethingElse", "Qwen3ForCausalLM"])
    assert cls.__name__ == "Qwen3ForCausalLM"
    assert cls.qk_norm


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match="GPT2LMHeadModel.*supported: .*DeepseekV3ForCausalLM, LlamaForCausalLM, MistralForCausalLM",
    ):
        get_model_class(["GPT2LMHeadModel"])
