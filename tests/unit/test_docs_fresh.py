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
    assert '-ac \'{"backend": "FLASH_ATTN", "flash_attn_version": 3}\'' in text
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
    assert "| CPU | 1. `CPU_ATTN` |" in text
