"""Our Llama-family models give the same logits as HF transformers on the same folder (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.forward_context import set_forward_context
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig

PROMPT = "Once upon a time, the capital of France was Paris; 1234 people lived by the river. " * 4
CPU = torch.device("cpu")


def load_ours(path: Path) -> torch.nn.Module:
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), CPU)
    return load_model(config, "auto", CPU)


def our_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), set_forward_context(None):
        hidden = model(input_ids, torch.arange(input_ids.shape[0]))
        return model.compute_logits(hidden)


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return hf_model(input_ids[None]).logits[0].float()


def prompt_ids(path: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return torch.tensor(AutoTokenizer.from_pretrained(path)(PROMPT).input_ids)


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_llama_path",
        "tiny_qwen3_path",
        "tiny_qwen2_path",
        "tiny_mistral_path",
        "tiny_llama3_rope_path",
        "tiny_linear_rope_path",
    ],
)
def test_logits_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    input_ids = prompt_ids(path)
    assert input_ids.shape[0] > 100
    ours = our_logits(load_ours(path), input_ids)
    reference = hf_logits(path, input_ids)
    assert ours.dtype == torch.float32
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_rope_scaling_changes_the_output(tiny_llama_path: Path, tiny_llama3_rope_path: Path) -> None:
    input_ids = prompt_ids(tiny_llama_path)
    plain = our_logits(load_ours(tiny_llama_path), input_ids)
    scaled = our_logits(load_ours(tiny_llama3_rope_path), input_ids)
    assert not torch.allclose(plain, scaled, atol=1e-3)


def test_logits_cover_the_padded_vocab(tiny_qwen3_path: Path) -> None:
    model = load_ours(tiny_qwen3_path)
    logits = our_logits(model, torch.tensor([3, 4, 5]))
    assert logits.shape == (3, 512)  # the tokenizer has 400 tokens
    assert model.lm_head is None  # tied to the embedding


def test_greedy_output_is_not_one_repeated_token(tiny_llama_path: Path, tiny_qwen3_path: Path) -> None:
    for path in (tiny_llama_path, tiny_qwen3_path):
        model = load_ours(path)
        tokens = [5, 6, 7]
        for _ in range(12):
            tokens.append(int(our_logits(model, torch.tensor(tokens))[-1].argmax()))
        assert len(set(tokens[3:])) > 3


def test_load_weights_rejects_unknown_names(tiny_llama_path: Path) -> None:
    model = load_ours(tiny_llama_path)
    with pytest.raises(ValueError, match="no matching model parameter"):
        model.load_weights([("model.layers.0.mlp.experts.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_attention_layers_are_the_engine_ones(tiny_qwen3_path: Path) -> None:
    from kvllm.layers.attention import Attention

    layers = [m for m in load_ours(tiny_qwen3_path).modules() if isinstance(m, Attention)]
    assert [layer.prefix for layer in layers] == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert (layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_size) == (4, 2, 32)
    assert layers[0].scale == pytest.approx(32**-0.5)
