"""`kvllm bench attention` hands its arguments to the kernel benchmark's main(argv)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvllm.entrypoints.cli import bench
from kvllm.entrypoints.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
needs_kernel_bench = pytest.mark.skipif(
    importlib.util.find_spec(bench.ATTENTION_KERNELS_MODULE) is None,
    reason="the attention kernel benchmark is not in this build yet",
)


def test_attention_arguments_go_to_the_kernel_benchmark_unchanged(monkeypatch):
    seen: list[list[str]] = []
    fake = types.ModuleType(bench.ATTENTION_KERNELS_MODULE)
    fake.__spec__ = importlib.machinery.ModuleSpec(bench.ATTENTION_KERNELS_MODULE, None)
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, bench.ATTENTION_KERNELS_MODULE, fake)
    assert main(["bench", "attention", "--backends", "TRITON_ATTN", "--batch-size", "4", "-h"]) == 0
    assert seen == [["--backends", "TRITON_ATTN", "--batch-size", "4", "-h"]]


@needs_kernel_bench
def test_attention_tiny_run_checks_before_timing(tmp_path):
    # A subprocess: the CPU run needs the Triton interpreter, chosen when triton is first imported.
    out = tmp_path / "attention.json"
    cmd = [
        sys.executable,
        "-m",
        "kvllm.entrypoints.cli.main",
        "bench",
        "attention",
        "--tiny",
        "--output-json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    triton = [r for r in rows if r["kernel"] == "TRITON_ATTN"]
    assert triton and all(r["status"] == "ok" and r["rel_error"] < 1e-3 and r["ms"] > 0 for r in triton)


@needs_kernel_bench
def test_attention_help_reaches_the_real_kernel_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_bench_without_a_benchmark_prints_help(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    for name in ("latency", "throughput", "serve", "attention"):
        assert name in out
