"""The real SmolLM2-135M-Instruct, converted from its GGUF file: tokenizer, HF greedy answer, our logits."""

from __future__ import annotations

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.forward_context import set_forward_context
from kvllm.models.default_model import DEFAULT_MODEL
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_config(smollm2_path: str) -> ModelConfig:
    return ModelConfig.from_engine_args(EngineArgs(), CPU)


@pytest.fixture(scope="module")
def chat_ids(model_config: ModelConfig) -> list[int]:
    tokenizer = load_tokenizer(model_config.tokenizer_path)
    return tokenizer(
        tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ).input_ids


@pytest.fixture(scope="module")
def hf_model(smollm2_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)


def test_default_model_config(model_config: ModelConfig, smollm2_path: str) -> None:
    assert model_config.model == DEFAULT_MODEL
    assert model_config.model_path == smollm2_path
    assert model_config.architecture == "LlamaForCausalLM"
    assert (model_config.num_hidden_layers, model_config.hidden_size, model_config.vocab_size) == (
        30,
        576,
        49152,
    )
    assert (model_config.num_attention_heads, model_config.num_kv_heads, model_config.head_size) == (9, 3, 64)
    assert model_config.max_model_len == 8192
    assert model_config.eos_token_ids == (2,)
    assert model_config.hf_config.tie_word_embeddings


def test_tokenizer(model_config: ModelConfig, chat_ids: list[int]) -> None:
    tokenizer = load_tokenizer(model_config.tokenizer_path)
    assert tokenizer.is_fast
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1
    assert tokenizer("Hello").input_ids == [19556]  # no BOS added
    assert tokenizer("2024").input_ids == [34, 32, 34, 36]  # digits one by one
    assert chat_ids[0] == 1  # <|im_start|> from the template, not from the tokenizer
    assert tokenizer.decode(chat_ids).endswith(
        "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_answers_paris(model_config: ModelConfig, hf_model: torch.nn.Module, chat_ids: list[int]) -> None:
    tokenizer = load_tokenizer(model_config.tokenizer_path)
    output = hf_model.generate(torch.tensor([chat_ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, len(chat_ids) :])


def test_our_logits_equal_hf(
    model_config: ModelConfig, hf_model: torch.nn.Module, chat_ids: list[int]
) -> None:
    model = load_model(model_config, "gguf", CPU)
    input_ids = torch.tensor(chat_ids)
    with torch.no_grad():
        reference = hf_model(input_ids[None]).logits[0]
        with set_forward_context(None):
            ours = model.compute_logits(model(input_ids, torch.arange(len(chat_ids))))
    torch.testing.assert_close(ours, reference, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
