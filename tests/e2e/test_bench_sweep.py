"""The H200 sweep driver and the plot helper, smoke-tested on the CPU with a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_tool(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep_out(tiny_qwen3_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    cmd = [
        sys.executable,
        "benchmarks/sweep_e2e.py",
        "--out",
        str(out),
        "--model",
        str(tiny_qwen3_path),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--batch-sizes",
        "1,2",
        "--output-len",
        "3",
        "--num-iters",
        "1",
        "--backends",
        "CPU_ATTN,FLASHINFER",
        "--skip-nano-hf",
        "--budget-s",
        "150",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| CPU_ATTN |" in done.stdout and "| HF |" in done.stdout
    return out


def test_sweep_writes_raw_json_per_measurement(sweep_out):
    raw = sweep_out / "raw"
    for name in (
        "latency-CPU_ATTN-bs1",
        "latency-CPU_ATTN-bs2",
        "throughput-CPU_ATTN-bs2",
        "throughput-HF-bs2",
    ):
        result = json.loads((raw / f"{name}.json").read_text())
        assert "error" not in result, result.get("traceback")
    latency = json.loads((raw / "latency-CPU_ATTN-bs2.json").read_text())
    assert latency["config"]["batch_size"] == 2 and latency["decode_throughput"] > 0
    hf = json.loads((raw / "throughput-HF-bs2.json").read_text())
    assert hf["backend"] == "hf" and hf["engine"]["hf_max_batch_size"] == 2
    # The tiny vocabulary cannot hold nano-vllm's ids: recorded as an error, the sweep goes on.
    assert "vocabulary" in json.loads((raw / "nano-vllm-kvllm.json").read_text())["error"]
    if importlib.util.find_spec("flashinfer") is None:
        assert (
            "not installed" in json.loads((raw / "kvllm-FLASHINFER.json").read_text())["backend_unavailable"]
        )
    assert (sweep_out / "summary.md").read_text().count("| CPU_ATTN |") == 2


def test_plot_helper_draws_the_sweep(sweep_out, tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load_tool("tools/plot_benchmarks.py")
    throughput, decode = plot.collect([sweep_out / "raw"])
    assert set(throughput) == {"CPU_ATTN", "HF transformers"} and set(throughput["CPU_ATTN"]) == {1, 2}
    assert set(decode) == {"CPU_ATTN"}
    png = tmp_path / "sweep.png"
    assert plot.main([str(sweep_out / "raw"), "-o", str(png), "--title", "smoke"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
