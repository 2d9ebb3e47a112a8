"""`kvllm collect-env`: versions, devices, backend import status, relevant env vars, secrets masked."""

from __future__ import annotations

import pytest

from kvllm.attention import registry
from kvllm.entrypoints.cli.collect_env import backend_import_status, relevant_environment
from kvllm.entrypoints.cli.main import main


def test_relevant_environment_filters_and_masks() -> None:
    env = {
        "HF_TOKEN": "hf_secret",
        "KVLLM_API_KEY": "sk-123",
        "KVLLM_LOGGING_LEVEL": "DEBUG",
        "CUDA_VISIBLE_DEVICES": "0",
        "MY_PASSWORD": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "HOME": "/root",
        "TRITON_INTERPRET": "1",
    }
    assert relevant_environment(env) == [
        ("CUDA_VISIBLE_DEVICES", "0"),
        ("HF_TOKEN", "***"),
        ("KVLLM_API_KEY", "***"),
        ("KVLLM_LOGGING_LEVEL", "DEBUG"),
        ("TRITON_INTERPRET", "1"),
    ]


def test_backend_import_status_names_every_backend() -> None:
    lines = backend_import_status()
    assert len(lines) == len(registry.registered_backend_names())
    assert any(line.strip().startswith("✅ CPU_ATTN") for line in lines)
    assert any(line.strip().startswith("❌ FLASHMLA: declared only") for line in lines)
    for line in lines:
        if "not installed" in line:
            assert "pip install 'kvllm[" in line  # the fix is named


def test_collect_env_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_print_me")
    monkeypatch.setenv("KVLLM_SIMULATE_PLATFORM", "cuda:9.0")
    assert main(["collect-env"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "OS:",
        "Python:",
        "torch:",
        "triton:",
        "transformers:",
        "flashinfer:",
        "flash-attn",
        "Devices:",
        "Attention backends:",
        "HF_TOKEN=***",
        "KVLLM_SIMULATE_PLATFORM=cuda:9.0",
        "kvllm platform: cuda (compute capability 9.0)",
    ):
        assert needle in out, needle
    assert "hf_do_not_print_me" not in out
