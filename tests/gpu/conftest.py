"""Fixtures of the GPU tests (every test here is marked gpu and skipped without CUDA)."""

from __future__ import annotations

import pytest

from tests.model_factory import make_tiny_qwen3


@pytest.fixture(scope="session")
def qwen3_small(tmp_path_factory):
    """Qwen3-shaped: 16 q / 8 kv heads of 128 (as Qwen3-0.6B), 2 layers, hidden 512."""
    return str(
        make_tiny_qwen3(
            tmp_path_factory.mktemp("qwen3_small"),
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        )
    )
