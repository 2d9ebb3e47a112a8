"""load_model (safetensors, dummy) and load_tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.forward_context import set_forward_context
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.models.tokenizer import load_tokenizer

CPU = torch.device("cpu")


def config_of(path: Path, **kwargs: object) -> ModelConfig:
    return ModelConfig.from_engine_args(EngineArgs(model=str(path), **kwargs), CPU)


def run(model: torch.nn.Module, input_ids: list[int]) -> torch.Tensor:
    with torch.no_grad(), set_forward_context(None):
        return model.compute_logits(model(torch.tensor(input_ids), torch.arange(len(input_ids))))


def test_safetensors_load(tiny_llama_path: Path) -> None:
    config = config_of(tiny_llama_path)
    model = load_model(config, "safetensors", CPU)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    from safetensors.torch import load_file

    checkpoint = load_file(tiny_llama_path / "model.safetensors")
    q = checkpoint["model.layers.1.self_attn.q_proj.weight"]
    k = checkpoint["model.layers.1.self_attn.k_proj.weight"]
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv[: q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k, rtol=0, atol=0)


def test_load_in_bfloat16(tiny_qwen3_path: Path) -> None:
    model = load_model(config_of(tiny_qwen3_path, dtype="bfloat16"), "auto", CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = run(model, [5, 6, 7, 8])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_gguf_format_needs_a_gguf_model(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="load_format='gguf' needs a .gguf"):
        load_model(config_of(tiny_llama_path), "gguf", CPU)


def test_missing_weights(tiny_llama_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_llama_path, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights.*model.layers.0.mlp.down_proj.weight"):
        load_model(config_of(folder), "auto", CPU)


def test_no_weights_but_dummy_works(tiny_qwen3_path: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_qwen3_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    config = config_of(folder)
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(config, "auto", CPU)
    torch.manual_seed(0)
    first = load_model(config, "dummy", CPU)
    torch.manual_seed(0)
    second = load_model(config, "dummy", CPU)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    logits = run(first, [5, 6, 7, 8, 9])
    assert torch.isfinite(logits).all()
    assert 1e-3 < logits.std().item() < 10
    assert torch.equal(first.model.norm.weight, torch.ones(64))


def test_dummy_bfloat16(tiny_llama_path: Path) -> None:
    torch.manual_seed(1)
    model = load_model(config_of(tiny_llama_path, dtype="bfloat16"), "dummy", CPU)
    assert torch.isfinite(run(model, [5, 6, 7])).all()


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    Qwen3Config(num_hidden_layers=2, eos_token_id=7, architectures=["Qwen3ForCausalLM"]).save_pretrained(
        tmp_path
    )
    config = config_of(tmp_path)
    assert config.eos_token_ids == (
        7,
    )  # from config.json when neither tokenizer nor generation config has one
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(config.tokenizer_path)


def test_tokenizer(tiny_qwen3_path: Path) -> None:
    tokenizer = load_tokenizer(config_of(tiny_qwen3_path).tokenizer_path)
    assert tokenizer.is_fast
    assert tokenizer.eos_token_id == 2
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert ids[0] == 1  # <|im_start|>
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
