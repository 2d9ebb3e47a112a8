"""`kvllm backends` as a user runs it: a subprocess, for SmolLM2 on this machine and simulated ones."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvllm.attention import registry
from kvllm.entrypoints.cli.main import main

ROOT = Path(__file__).resolve().parents[2]

# SmolLM2-135M-Instruct's config.json (the fields attention needs, as HF ships them).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


def run_backends(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVLLM_SIMULATE_PLATFORM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "kvllm.entrypoints.cli.main", "backends", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def backend_lines(stdout: str) -> dict[str, str]:
    lines = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("✅", "❌", "⚠️"):
            lines[parts[1]] = line
    return lines


def test_smollm2_on_this_machine(smollm2_dir: Path) -> None:
    result = run_backends(str(smollm2_dir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Platform: cpu" in out
    # "auto" dtype on the CPU is float32, as the engine itself would run it (the checkpoint says bf16).
    assert "head_size=64" in out and "dtype=float32" in out
    lines = backend_lines(out)
    assert set(lines) == set(registry.registered_backend_names())
    assert lines["CPU_ATTN"].startswith("  ✅ CPU_ATTN") and "valid" in lines["CPU_ATTN"]
    for name, line in lines.items():
        if name == "CPU_ATTN":
            continue
        # Every other backend is explained: rejected with reasons, or valid but only by name.
        if line.lstrip().startswith("❌"):
            assert len(line.split(name, 1)[1].strip()) > 10, line
        else:
            assert "only when selected by name" in line, line
    if "TRITON_ATTN" in lines:
        assert "platform cpu not supported (supported: cuda, rocm)" in lines["TRITON_ATTN"]
    assert "Priority order for standard attention on cpu" in out and "1. CPU_ATTN" in out
    assert "Automatic selection: CPU_ATTN (block size" in out
    assert "Using CPU_ATTN attention backend out of potential backends: ['CPU_ATTN']" in result.stderr


def test_simulated_hopper_and_manual_choice(smollm2_dir: Path) -> None:
    result = run_backends(
        str(smollm2_dir), "--platform", "cuda", "--capability", "9.0", "--attention-backend", "CPU_ATTN"
    )
    assert result.returncode == 1  # the manual choice cannot run on CUDA
    out = result.stdout
    assert "Platform: cuda (compute capability 9.0) (simulated)" in out
    assert "1. FLASH_ATTN" in out
    assert "❌ CPU_ATTN" in out and "platform cuda not supported (supported: cpu)" in out
    assert (
        "Your selection: Selected backend CPU_ATTN is not valid for this configuration. Reason: "
        "['platform cuda not supported (supported: cpu)']"
    ) in out
    if (
        importlib.util.find_spec("triton")
        and not importlib.util.find_spec("flash_attn")
        and not importlib.util.find_spec("flashinfer")
        and registry.is_registered("TRITON_ATTN")
    ):
        assert "Automatic selection: TRITON_ATTN" in out


def test_pinned_knobs_reach_the_report(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        ["backends", str(smollm2_dir), "--dtype", "float32", "--block-size", "24", "--kv-cache-dtype", "fp8"]
    )
    out = capsys.readouterr().out
    assert "dtype=float32" in out and "block_size=24" in out and "kv_cache_dtype=fp8" in out
    lines = backend_lines(out)
    if "FLEX_ATTENTION" in lines:
        assert "block_size 24 not supported" in lines["FLEX_ATTENTION"]


def test_bad_capability_is_a_user_error(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", str(smollm2_dir), "--capability", "nine"]) == 2
    assert "Invalid compute capability 'nine'" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("kvllm.models.default_model") is None,
    reason="kvllm.models.default_model not built yet",
)
def test_default_model() -> None:
    result = run_backends()
    assert result.returncode == 0, result.stderr
    assert "✅ CPU_ATTN" in result.stdout and "head_size=64" in result.stdout


def _config_folder(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


SMALL = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def test_architecture_kvllm_cannot_load_is_not_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**SMOLLM2_CONFIG, "architectures": ["GPT2LMHeadModel"]})
    )
    assert main(["backends", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        "Model support: ❌ kvllm cannot load this model: model architecture ['GPT2LMHeadModel'] is not supported"
        in out
    )
    lines = backend_lines(out)
    assert "attention valid, but kvllm cannot load the model" in lines["CPU_ATTN"]
    assert not any(line.rstrip().endswith(" valid") for line in lines.values())
    assert "Automatic selection: none. kvllm cannot load this model" in out


def test_mxfp4_gpt_oss_is_refused_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, architectures=["GptOssForCausalLM"], **SMALL
    )
    config.quantization_config = {"quant_method": "mxfp4"}
    assert main(["backends", str(_config_folder(tmp_path, config))]) == 1
    out = capsys.readouterr().out
    assert "kvllm cannot load this model: GptOssForCausalLM: MXFP4-quantized experts" in out


def test_gemma2_and_gpt_oss_features_decide_the_backends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Window, soft-cap and sinks of the real model configs reach the report, and each backend lacking one
    says which."""
    from transformers import Gemma2Config, GptOssConfig

    gemma2 = _config_folder(
        tmp_path / "gemma2", Gemma2Config(num_hidden_layers=2, architectures=["Gemma2ForCausalLM"], **SMALL)
    )
    assert main(["backends", str(gemma2), "--platform", "cuda", "--capability", "9.0"]) in (0, 1)
    out = capsys.readouterr().out
    assert "has_sliding_window=True" in out and "logits_soft_cap=50.0" in out and "Model support" not in out
    lines = backend_lines(out)
    # FLASHINFER's window and soft-cap passed the walk for every model dtype and cache: neither is a reason,
    # in bfloat16 (the model's) or float16
    assert "window" not in lines["FLASHINFER"] and "soft-cap" not in lines["FLASHINFER"]
    assert lines["TRITON_ATTN"].lstrip().startswith("✅") or "triton not installed" in lines["TRITON_ATTN"]
    assert main(
        ["backends", str(gemma2), "--platform", "cuda", "--capability", "9.0", "--dtype", "float16"]
    ) in (0, 1)
    fp16 = backend_lines(capsys.readouterr().out)["FLASHINFER"]
    assert "FLASHINFER" in fp16 and "window" not in fp16 and "soft-cap" not in fp16 and "verified" not in fp16
    gpt_oss = _config_folder(
        tmp_path / "gpt_oss",
        GptOssConfig(num_hidden_layers=2, num_local_experts=4, architectures=["GptOssForCausalLM"], **SMALL),
    )
    assert main(["backends", str(gpt_oss)]) == 0
    out = capsys.readouterr().out
    assert "has_sink=True" in out
    lines = backend_lines(out)
    assert lines["CPU_ATTN"].lstrip().startswith("✅")
    assert "attention sinks not supported" in lines["FLEX_ATTENTION"]
