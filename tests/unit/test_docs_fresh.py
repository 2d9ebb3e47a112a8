"""docs/attention_backends.md is committed and matches the declarations (CI runs the generator --check)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "generate_attention_backend_docs.py"


def test_docs_page_is_fresh() -> None:
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, (
        result.stderr + "\nRegenerate: python tools/generate_attention_backend_docs.py"
    )
    assert time.monotonic() - start < 10


def test_check_detects_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    subprocess.run([sys.executable, str(TOOL), "--output", str(page)], check=True, capture_output=True)
    assert subprocess.run([sys.executable, str(TOOL), "--check", "--output", str(page)]).returncode == 0
    page.write_text(page.read_text() + "hand edit\n")
    result = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--output", str(page)], capture_output=True, text=True
    )
    assert result.returncode == 1 and "stale" in result.stderr


def test_page_content() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import generate_attention_backend_docs as gen
    finally:
        sys.path.pop(0)
    text = gen.render()
    assert "Do not edit it by hand" in text
    assert "--attention-backend FLASH_ATTN" in text and "-ac.backend FLASH_ATTN" in text
    assert '-ac \'{"backend": "FLASH_ATTN", "flash_attn_version": 4}\'' in text
    assert (
        "AttentionConfig(backend=AttentionBackendEnum.FLASH_ATTN)" in text
        and 'attention_backend="FLASH_ATTN"' in text
    )
    assert "Selected backend FLASHMLA is not valid for this configuration. Reason:" in text
    assert (
        "| Backend | Version | Dtypes | KV Dtypes | Block Sizes | Head Sizes | Sink | Sliding Window |"
        in text
    )
    assert "| `CPU_ATTN` |" in text
    assert "**CPU:**\n\n| Priority | Backend |\n|---|---|\n| 1 | `CPU_ATTN` |" in text
    assert "**CUDA Ampere/Hopper (SM 8.x-9.x) and other CUDA:**\n\n| Priority | Backend |" in text


def _render() -> str:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import generate_attention_backend_docs as gen
    finally:
        sys.path.pop(0)
    return gen.render()


def test_every_example_command_on_the_page_parses() -> None:
    """The page's `kvllm generate <model> ...` lines are real command lines (flags and values valid)."""
    import shlex

    from kvllm.entrypoints.cli.engine_args import engine_args_from_cli, preprocess_argv
    from kvllm.entrypoints.cli.main import build_parser

    lines = [line for line in _render().splitlines() if line.startswith("kvllm generate <model> ")]
    assert len(lines) >= 6
    for line in lines:
        argv = ["generate", "some-model", *shlex.split(line.removeprefix("kvllm generate <model> "))]
        engine_args = engine_args_from_cli(build_parser().parse_args(preprocess_argv(argv)))
        assert engine_args.backend.name == "FLASH_ATTN", line


def test_footnotes_follow_the_declarations(monkeypatch) -> None:
    from kvllm.attention.backends.flashinfer import FlashInferBackend

    text = _render()
    assert "FlashAttention-4 only" in text and "TRT-LLM" in text
    assert "declares no sinks" in text and not FlashInferBackend.supports_sink
    monkeypatch.setattr(FlashInferBackend, "supports_sink", True)
    assert "declares no sinks" not in _render()


def test_auto_tune_is_documented() -> None:
    text = _render()
    assert "`--attention-backend auto-tune`" in text and "kvllm backends <model> --tune" in text
