"""The decode fast path (kvllm/worker/decode_advance.py): graph decode steps of the same requests are
advanced on the device instead of rebuilt on the host, and every token comes out as without it.

On the CPU the graph runner replays eagerly (EagerGraph) and the advance runs as torch ops, so the
bookkeeping is what these tests check: the same ids as the full prepare under greedy and seeded
sampling, through block boundaries, requests finishing at different steps, chunked prefill beside
decodes, preemption, min_tokens and penalties (whose sampling inputs change every step).
"""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.worker import model_runner
from kvllm.worker.decode_advance import advance_decode
from kvllm.worker.input_batch import InputBatch
from tests.e2e.test_engine_vs_hf import random_prompts


def _llm(path, monkeypatch, **kwargs) -> LLM:
    from kvllm.platforms import simulate_platform

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    with simulate_platform("cuda", (9, 0)):
        return LLM(
            str(path),
            dtype="float32",
            attention_backend="TRITON_ATTN",
            cudagraph_capture_sizes=[1, 2, 4, 8],
            max_model_len=64,
            **kwargs,
        )


def _run(llm: LLM, prompts, params, fast: bool, monkeypatch) -> list[list[int]]:
    monkeypatch.setattr(InputBatch, "decode_fast_path", fast)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return [o.outputs[0].token_ids for o in outputs]


def _input_batch(llm: LLM) -> InputBatch:
    return llm.llm_engine.executor.worker.model_runner.input_batch


@pytest.mark.parametrize(
    "params_of",
    [
        pytest.param(
            lambda i, n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), id="greedy"
        ),
        pytest.param(
            lambda i, n: SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n, ignore_eos=True),
            id="seeded",
        ),
        pytest.param(
            lambda i, n: SamplingParams(temperature=0.8, top_k=20, max_tokens=n, min_tokens=n // 2, seed=i),
            id="top_k-min_tokens",
        ),
        pytest.param(
            lambda i, n: SamplingParams(
                temperature=0.0, max_tokens=n, repetition_penalty=1.3, ignore_eos=True
            ),
            id="penalties",
        ),
    ],
)
def test_fast_path_gives_the_same_tokens(tiny_qwen3_path, monkeypatch, params_of):
    llm = _llm(tiny_qwen3_path, monkeypatch, max_num_batched_tokens=16)  # prefill chunks beside decodes
    prompts = random_prompts(400, [3, 17, 9, 5], seed=5)
    max_tokens = [21, 3, 18, 6]  # across block boundaries (16); requests leave at different steps
    params = [params_of(i, n) for i, n in enumerate(max_tokens)]
    slow = _run(llm, prompts, params, False, monkeypatch)
    assert _input_batch(llm).num_advanced_steps == 0
    fast = _run(llm, prompts, params, True, monkeypatch)
    assert fast == slow
    assert _input_batch(llm).num_advanced_steps >= 10


def test_fast_path_under_preemption(tiny_qwen3_path, monkeypatch):
    """A KV cache too small for all requests: preempted requests rejoin through the full prepare."""
    block_bytes = 16 * 2 * 2 * 32 * 4 * 2  # tokens x (K, V) x KV heads x head size x float32 x layers
    llm = _llm(tiny_qwen3_path, monkeypatch, kv_cache_memory_bytes=6 * block_bytes, max_num_seqs=3)
    prompts = random_prompts(400, [14, 20, 12], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    slow = _run(llm, prompts, params, False, monkeypatch)
    fast = _run(llm, prompts, params, True, monkeypatch)
    assert fast == slow
    assert llm.llm_engine.stats().num_preemptions > 0
    assert _input_batch(llm).num_advanced_steps > 0


def test_advance_decode_arithmetic():
    """Positions, sequence lengths, slots, input ids and sampled-id slots of two requests, one crossing
    into its next block; the padded third entry is left alone."""
    block_size, max_model_len = 4, 16
    gen = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, 1000, (3, max_model_len), dtype=torch.int32, generator=gen)
    block_table = torch.tensor([[7, 3, 9, 0], [2, 5, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    rows = torch.tensor([1, 0], dtype=torch.int64)  # request 0 sits in row 1, request 1 in row 0
    positions = torch.tensor([3, 9, 0], dtype=torch.int32)
    seq_lens = torch.tensor([4, 10, 0], dtype=torch.int32)
    slots = torch.tensor([2 * 4 + 3, 9 * 4 + 1, -1], dtype=torch.int64)
    sample_slots = torch.tensor([1 * max_model_len + 4, 0 * max_model_len + 10, 0], dtype=torch.int64)
    input_ids = torch.zeros(3, dtype=torch.int32)
    advance_decode(
        positions[:2],
        seq_lens[:2],
        slots[:2],
        sample_slots[:2],
        rows,
        input_ids[:2],
        token_ids,
        block_table,
        4,
    )
    assert positions.tolist() == [4, 10, 0]
    assert seq_lens.tolist() == [5, 11, 0]
    assert slots.tolist() == [5 * block_size + 0, 9 * block_size + 2, -1]  # request 0 enters block 5
    assert input_ids.tolist() == [int(token_ids[1, 4]), int(token_ids[0, 10]), 0]
    assert sample_slots.tolist() == [1 * max_model_len + 5, 0 * max_model_len + 11, 0]
