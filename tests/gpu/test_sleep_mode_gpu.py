"""On a CUDA GPU: LLM.sleep gives the device memory back and wake_up restores the same greedy ids,
with CUDA graphs captured again on the new weight and KV-cache addresses."""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["The capital of France is", "Once upon a time, there was", "1 2 3 4 5"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_up_gives_the_same_ids(tiny_llama_path, level):
    llm = LLM(str(tiny_llama_path), dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.llm_engine.executor.worker.model_runner
    had_graphs = runner.graph_runner is not None
    awake_bytes = torch.cuda.memory_allocated()
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    llm.sleep(level=level)
    asleep_bytes = torch.cuda.memory_allocated()
    # Everything the engine held on the device went: the weights, the KV cache, graphs and buffers.
    assert asleep_bytes < awake_bytes - weight_bytes
    llm.wake_up()
    assert (runner.graph_runner is not None) == had_graphs
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
