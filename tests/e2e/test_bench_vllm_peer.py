"""`--backend vllm` in bench throughput and latency: vLLM's public LLM API on kvllm's engine arguments,
prompts and sampling. Without vLLM the error says so; with a stand-in `vllm` module the plumbing
(arguments, prompts, sampling, counting) is checked without a GPU."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvllm.entrypoints.cli.main import main as cli_main


class FakeLLM:
    """Records what vLLM would be asked; returns outputs of the requested lengths."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[list, list]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        outs = []
        for p in params:
            completion = types.SimpleNamespace(token_ids=[7] * p.max_tokens)
            metrics = types.SimpleNamespace(arrival_time=0.0, first_token_time=0.001)
            outs.append(types.SimpleNamespace(outputs=[completion] * p.n, metrics=metrics))
        return outs


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, ignore_eos=False, max_tokens=16):
        self.n, self.temperature, self.top_p, self.ignore_eos, self.max_tokens = (
            n,
            temperature,
            top_p,
            ignore_eos,
            max_tokens,
        )


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, FakeSamplingParams, "0.0-test"
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return FakeLLM


def test_without_vllm_the_error_says_what_is_missing(tiny_qwen3_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    code = cli_main(
        ["bench", "throughput", "--model", str(tiny_qwen3_path), "--backend", "vllm", "--num-prompts", "2"]
    )
    assert code != 0
    assert "--backend vllm needs vLLM importable" in capsys.readouterr().err


def test_throughput_runs_the_same_workload_on_vllm(tiny_qwen3_path, fake_vllm, tmp_path):
    out = tmp_path / "t.json"
    args = ["bench", "throughput", "--model", str(tiny_qwen3_path), "--backend", "vllm", "--num-prompts", "5"]
    code = cli_main(
        args + ["--input-len", "9", "--output-len", "4", "--load-format", "dummy", "--output-json", str(out)]
    )
    assert code == 0
    (llm,) = fake_vllm.instances
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["enable_prefix_caching"] is False
    assert llm.kwargs["generation_config"] == "vllm" and llm.kwargs["dtype"] == "float32"
    warmup, timed = llm.calls
    prompts, params = timed
    assert len(prompts) == 5 and all(len(p["prompt_token_ids"]) == 9 for p in prompts)
    assert all(p.max_tokens == 4 and p.ignore_eos and p.temperature == 1.0 for p in params)
    result = json.loads(out.read_text())
    assert result["backend"] == "vllm" and result["total_output_tokens"] == 20


def test_latency_runs_the_same_batches_on_vllm(tiny_qwen3_path, fake_vllm, tmp_path):
    out = tmp_path / "l.json"
    args = ["bench", "latency", "--model", str(tiny_qwen3_path), "--backend", "vllm", "--batch-size", "3"]
    code = cli_main(
        args
        + [
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "2",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    (llm,) = fake_vllm.instances
    assert len(llm.calls) == 3 and all(len(prompts) == 3 for prompts, _ in llm.calls)
    result = json.loads(out.read_text())
    assert (
        result["backend"] == "vllm" and len(result["latencies"]) == 2 and result["prefill_latency"] == 0.001
    )
