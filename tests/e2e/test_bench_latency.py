"""`kvllm bench latency` on the CPU with a tiny model: the JSON fields, engine arguments, profiling."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from kvllm.entrypoints.cli.main import main

TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", str(1 << 22)]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Tiny matmuls on a shared CPU run far faster on one thread than with idle-spinning workers.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_latency_json_fields_and_profile(tiny_qwen3_path, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        str(tiny_qwen3_path),
        *TINY_ENGINE,
        "--attention-backend",
        "CPU_ATTN",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
        "--output-json",
        str(out),
        "--profile-steps",
        "2",
        "--profile-dir",
        str(tmp_path / "prof"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    assert "GPU utilization: not available" in printed
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert result["percentiles"]["10"] <= result["percentiles"]["50"] <= result["percentiles"]["99"]
    assert 0 < result["prefill_latency"] < result["avg_latency"]
    expected_decode = 2 * (4 - 1) / (result["avg_latency"] - result["prefill_latency"])
    assert result["decode_throughput"] == pytest.approx(expected_decode)
    assert result["gpu_util"] is None and result["gpu_util_source"].startswith("not available")
    assert result["num_steps"] == 4  # one prefill step, three decode steps
    engine = result["engine"]
    assert engine["attention_backend"] == "CPU_ATTN" and engine["enable_prefix_caching"] is False
    assert result["config"]["batch_size"] == 2 and result["env"]["torch"] == torch.__version__
    trace = json.loads(open(result["profile_trace"]).read())
    assert trace["traceEvents"]


def test_latency_takes_attention_config_and_prefix_caching(tiny_llama_path, tmp_path):
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--model",
        str(tiny_llama_path),
        *TINY_ENGINE,
        "-ac.backend",
        "CPU_ATTN",
        "--enable-prefix-caching",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--batch-size",
        "1",
        "--num-iters-warmup",
        "0",
        "--num-iters",
        "1",
        "--disable-detokenize",
        "--output-json",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["engine"]["enable_prefix_caching"] is True
    assert result["engine"]["attention_backend"] == "CPU_ATTN"
    assert result["config"]["disable_detokenize"] is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input-len", "60", "--output-len", "10"], "exceeds max_model_len=64"),
        (["--num-iters", "0"], "--num-iters=0"),
        (["--attention-backend", "NO_SUCH"], "Unknown attention backend"),
    ],
)
def test_latency_bad_arguments_are_clear_errors(tiny_qwen3_path, capsys, extra, message):
    argv = ["bench", "latency", str(tiny_qwen3_path), *TINY_ENGINE, "--num-iters-warmup", "0", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
