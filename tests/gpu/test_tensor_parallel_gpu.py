"""TP=2 over NCCL on two GPUs (one worker process per GPU, CUDA graphs captured on each rank): greedy
ids equal TP=1's, with graphs and eagerly. Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel needs two GPUs"),
]

PROMPTS = [[1, 5, 9, 33, 17], [4, 8, 15, 16, 23, 42, 7, 99, 3], [250, 11], list(range(3, 60))]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_on_two_gpus_matches_tp1(qwen3_small: str, enforce_eager: bool) -> None:
    # float32: the ranks' partial sums add up in another order than one GPU's matmul; in float32 that
    # moves logits by ~1e-6, far below the random model's gaps between its top tokens.
    engine = dict(dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    tp1 = LLM(qwen3_small, **engine)
    expected = _greedy(tp1)
    del tp1
    torch.cuda.empty_cache()
    llm = LLM(qwen3_small, tensor_parallel_size=2, **engine)
    try:
        assert _greedy(llm) == expected
    finally:
        llm.llm_engine.shutdown()
