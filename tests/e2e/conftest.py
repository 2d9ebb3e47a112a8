"""Fixtures shared by the e2e files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen3_server(tiny_qwen3_real_tokenizer_path):
    """One `kvllm serve` of the random-weight Qwen3 with the real tokenizer, for the structured-output,
    tool-calling and reasoning tests: hermes tool calls, the qwen3 reasoning parser, 1024-token context."""
    from tests.e2e.test_server_openai import RemoteServer

    srv = RemoteServer(
        tiny_qwen3_real_tokenizer_path,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--max-model-len",
        "1024",
    )
    yield srv
    srv.stop()
