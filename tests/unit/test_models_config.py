"""ModelConfig.from_engine_args: resolution of paths, dtype, context length, shapes and EOS ids."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.models.model_config import ModelConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only its type is looked at: no GPU needed


def config_of(path: Path | str, device: torch.device = CPU, **kwargs: object) -> ModelConfig:
    return ModelConfig.from_engine_args(EngineArgs(model=str(path), **kwargs), device)


def test_fields_of_tiny_qwen3(tiny_qwen3_path: Path) -> None:
    config = config_of(tiny_qwen3_path)
    assert config.model == str(tiny_qwen3_path)
    assert config.model_path == config.tokenizer_path == str(tiny_qwen3_path.resolve())
    assert config.architecture == "Qwen3ForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_kv_heads) == (2, 4, 2)
    assert (config.head_size, config.hidden_size, config.vocab_size) == (32, 64, 512)
    assert config.max_model_len == 2048
    assert config.sliding_window is None
    assert config.eos_token_ids == (2,)
    assert config.dtype == torch.float32


def test_sliding_window(tiny_mistral_path: Path) -> None:
    assert config_of(tiny_mistral_path).sliding_window == 4096


def test_dtype_auto(tiny_llama_path: Path, tmp_path: Path) -> None:
    assert config_of(tiny_llama_path).dtype == torch.float32  # CPU, whatever the checkpoint
    assert config_of(tiny_llama_path, CUDA).dtype == torch.bfloat16  # float32 checkpoint -> bfloat16 on GPU
    fp16 = shutil.copytree(tiny_llama_path, tmp_path / "fp16")
    config_json = json.loads((fp16 / "config.json").read_text())
    config_json["dtype"] = "float16"
    (fp16 / "config.json").write_text(json.dumps(config_json))
    assert config_of(fp16, CUDA).dtype == torch.float16
    assert config_of(fp16, CPU).dtype == torch.float32


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
    ],
)
def test_dtype_explicit(tiny_llama_path: Path, dtype: str, expected: torch.dtype) -> None:
    assert config_of(tiny_llama_path, dtype=dtype).dtype == expected


def test_max_model_len(tiny_llama_path: Path) -> None:
    assert config_of(tiny_llama_path, max_model_len=256).max_model_len == 256
    with pytest.raises(ValueError, match=r"max_model_len=4096 .*max_position_embeddings=2048"):
        config_of(tiny_llama_path, max_model_len=4096)


def test_tokenizer_override(tiny_llama_path: Path, tiny_qwen3_path: Path) -> None:
    config = config_of(tiny_qwen3_path, tokenizer=str(tiny_llama_path))
    assert config.tokenizer_path == str(tiny_llama_path.resolve())


def test_eos_ids_merge_generation_config_and_tokenizer(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_llama_path, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert config_of(folder).eos_token_ids == (7, 2)


def test_unknown_architecture(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_llama_path, tmp_path / "m")
    config_json = json.loads((folder / "config.json").read_text())
    config_json["architectures"] = ["FancyForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match="FancyForCausalLM.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        config_of(folder)


@pytest.mark.parametrize("model", ["/no/such/folder", "./missing-model", "model.gguf", "just-a-name"])
def test_missing_path(model: str) -> None:
    with pytest.raises(ValueError, match="Model path .* does not exist"):
        config_of(model)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        config_of(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        config_of(tmp_path / "weights.bin")


def test_repo_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError,
        match=r"'Qwen/Qwen3-0.6B' at revision 'main'.*no model hub is reachable.*local model folder or a GGUF",
    ):
        config_of("Qwen/Qwen3-0.6B", revision="main")


def test_bogus_repo_id_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(ValueError, match="kvllm-no-such-org/no-such-model.*GGUF file instead"):
        config_of("kvllm-no-such-org/no-such-model")
    assert time.monotonic() - start < 30
