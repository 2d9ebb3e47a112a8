"""`kvllm bench throughput` on the CPU with a tiny model, kvllm beside HF transformers; the workloads."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch

from kvllm.benchmarks.datasets import nano_vllm_requests, random_requests
from kvllm.entrypoints.cli.main import main

TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", str(1 << 22)]
FIELDS = (
    "elapsed_time",
    "num_requests",
    "total_num_tokens",
    "total_output_tokens",
    "requests_per_second",
    "tokens_per_second",
    "output_tokens_per_second",
    "gpu_util",
    "gpu_util_source",
    "engine",
    "env",
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(model, tmp_path, backend: str, *extra: str) -> dict:
    out = tmp_path / f"{backend}.json"
    argv = [
        "bench",
        "throughput",
        str(model),
        *TINY_ENGINE,
        "--backend",
        backend,
        "--num-prompts",
        "6",
        "--input-len",
        "10",
        "--output-len",
        "5",
        "--hf-max-batch-size",
        "4",
        "--output-json",
        str(out),
        *extra,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_throughput_kvllm_beside_hf(tiny_qwen3_path, tmp_path, load_format):
    results = {b: _run(tiny_qwen3_path, tmp_path, b, "--load-format", load_format) for b in ("kvllm", "hf")}
    for backend, result in results.items():
        for name in FIELDS:
            assert name in result, (backend, name)
        assert result["backend"] == backend and result["num_requests"] == 6
        assert result["total_output_tokens"] == 6 * 5
        assert result["total_num_tokens"] == 6 * (10 + 5)
        assert result["output_tokens_per_second"] == pytest.approx(30 / result["elapsed_time"])
        assert result["requests_per_second"] == pytest.approx(6 / result["elapsed_time"])
        assert result["gpu_util"] is None
        assert result["engine"]["dtype"] == "float32"
    assert results["kvllm"]["engine"]["enable_prefix_caching"] is False
    assert results["hf"]["engine"]["hf_max_batch_size"] == 4


def test_throughput_takes_engine_arguments(tiny_llama_path, tmp_path):
    result = _run(
        tiny_llama_path,
        tmp_path,
        "kvllm",
        "--attention-backend",
        "CPU_ATTN",
        "--max-num-seqs",
        "2",
        "--random-range-ratio",
        "0.5",
        "--no-warmup",
    )
    assert result["engine"]["attention_backend"] == "CPU_ATTN" and result["engine"]["max_num_seqs"] == 2
    assert result["total_output_tokens"] > 0 and result["config"]["warmup"] is False


def test_random_requests_are_seeded_and_sized():
    a = random_requests(5, 7, 3, vocab_size=50, seed=1)
    assert a == random_requests(5, 7, 3, vocab_size=50, seed=1)
    assert a != random_requests(5, 7, 3, vocab_size=50, seed=2)
    assert all(r.prompt_len == 7 and r.output_len == 3 and max(r.prompt_token_ids) < 50 for r in a)
    ranged = random_requests(50, 10, 10, vocab_size=50, range_ratio=0.5)
    assert all(5 <= r.prompt_len <= 15 and 5 <= r.output_len <= 15 for r in ranged)


def test_nano_vllm_workload_matches_its_bench_script():
    # nano-vllm's bench.py, with the module-level random it uses.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    requests = nano_vllm_requests()
    assert [r.prompt_token_ids for r in requests] == prompts
    assert [r.output_len for r in requests] == max_tokens


def test_nano_vllm_workload_needs_a_real_vocabulary(tiny_qwen3_path, capsys):
    argv = ["bench", "throughput", str(tiny_qwen3_path), *TINY_ENGINE, "--dataset-name", "nano-vllm"]
    assert main(argv) == 2
    assert "vocabulary is 512" in capsys.readouterr().err
