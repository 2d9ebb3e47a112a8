"""On a CUDA GPU: speculative decoding gives the greedy ids of plain decoding (CUDA graphs on for the
steps without drafts), and sampling with drafts runs through the fused sampler and the rejection
sampler on the device."""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams
from tests.e2e.test_spec_decode import repetitive_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(path, params, **kwargs):
    # Each test keeps two engines alive (plain and speculative): each takes a fifth of the GPU, not the
    # default 0.9 that would leave the second no room for its KV cache.
    llm = LLM(str(path), dtype="float32", seed=0, gpu_memory_utilization=0.2, max_model_len=1024, **kwargs)
    prompts = repetitive_prompts([3, 17, 40, 90], seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_ids_equal_plain_decoding_on_the_gpu(tiny_qwen3_path, method):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    config = {"method": method, "num_speculative_tokens": 3}
    config.update(
        {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_qwen3_path)}
    )
    reference, plain = _run(tiny_qwen3_path, params)
    ours, llm = _run(tiny_qwen3_path, params, speculative_config=config)
    assert ours == reference
    assert llm.llm_engine.spec_decode.stats.num_accepted_tokens > 0
    assert plain.llm_engine.executor.worker.model_runner.graph_runner is not None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_and_drafting_replay_full_cuda_graphs(tiny_qwen3_path, method):
    """With TRITON_ATTN every verification step (k + 1 tokens per request, fewer where fewer drafts)
    replays a full CUDA graph, the draft model's passes replay their own, and greedy ids stay those
    of plain decoding. Steps that verify beside a prefill chunk (the start-up warm-up's mixed steps)
    have no uniform graph and are counted apart (the H200 run of 2026-12-02 saw three such steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    config = {"method": method, "num_speculative_tokens": 3}
    config.update(
        {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_qwen3_path)}
    )
    engine = {"attention_backend": "TRITON_ATTN", "max_num_seqs": 8}  # graphs of 1, 2, 4, 8 requests
    reference, _ = _run(tiny_qwen3_path, params, **engine)
    ours, llm = _run(tiny_qwen3_path, params, speculative_config=config, **engine)
    assert ours == reference
    runner = llm.llm_engine.executor.worker.model_runner
    counts = runner.graph_replay_counts()
    stats = llm.llm_engine.spec_decode.stats
    assert stats.num_accepted_tokens > 0
    # The batch (4 requests, then fewer) always fits a graph: every step with drafts replayed one.
    assert runner.num_verify_steps > 0
    assert runner.num_verify_steps_graphed == runner.num_verify_steps, (
        f"verification steps without a full graph (requests, longest query, tokens): "
        f"{runner.ungraphed_verify_steps}"
    )
    assert counts["target"][4] >= runner.num_verify_steps
    if method == "draft_model":
        # Decode-only steps: the first proposal step (two tokens per request) replaces the pass over
        # the step's tokens.
        assert counts["draft_propose"][2] >= runner.num_verify_steps
        assert counts["draft_propose"][1] > 0


def test_sampling_with_drafts_runs_on_the_device(tiny_qwen3_path):
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=3)
    config = {"method": "draft_model", "model": str(tiny_qwen3_path), "num_speculative_tokens": 3}
    first, llm = _run(tiny_qwen3_path, params, speculative_config=config)
    again, _ = _run(tiny_qwen3_path, params, speculative_config=config)
    assert first == again  # per-request seeds make speculative sampling reproducible
    stats = llm.llm_engine.spec_decode.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_give_the_greedy_ids_of_plain_decoding_on_the_gpu(tiny_qwen3_path, tmp_path, method):
    from tests.spec_heads import write_eagle3_head, write_eagle_head

    if method == "eagle":
        head = write_eagle_head(tmp_path / "eagle", tiny_qwen3_path)
    else:
        head = write_eagle3_head(tmp_path / "eagle3", tiny_qwen3_path, [0, 1, 1], draft_vocab=256)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference, _ = _run(tiny_qwen3_path, params)
    config = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    ours, llm = _run(tiny_qwen3_path, params, speculative_config=config)
    assert ours == reference
    stats = llm.llm_engine.spec_decode.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
