"""benchmarks/h200/pick_arm.py: the faster arm of a nano-vllm A/B, the default unless beaten by the margin."""

from __future__ import annotations

import json
import subprocess
import sys


def _write(folder, label: str, run: int, rate: float) -> None:
    records = [{"bench": "startup", "seconds": 9.0}, {"bench": "nano", "out_tok_per_s": rate}]
    (folder / f"bench-nano-{label}-{run}.jsonl").write_text("\n".join(json.dumps(r) for r in records))


def _pick(folder, *args: str) -> str:
    cmd = [sys.executable, "benchmarks/h200/pick_arm.py", str(folder), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_pick_arm(tmp_path) -> None:
    for run, (a, b) in enumerate([(24_000, 24_500), (24_100, 24_300)]):
        _write(tmp_path, "default", run, a)
        _write(tmp_path, "plan", run, b)
    assert _pick(tmp_path, "default", "plan") == "plan"  # 24,400 against 24,050: +1.5%
    assert _pick(tmp_path, "default", "plan", "--margin", "0.02") == "default"
    assert _pick(tmp_path, "plan", "default") == "plan"
    assert _pick(tmp_path, "default", "missing") == "default"
