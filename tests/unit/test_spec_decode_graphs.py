"""Full CUDA graphs with speculative decoding, without a GPU (graphs replayed eagerly, TRITON_ATTN in
the Triton interpreter): verification steps of up to k + 1 tokens per request replay the k + 1 graph
whatever their mix of draft counts, the draft model's passes replay its own graphs, and greedy ids
equal those of plain decoding (the reference: the same engine with no speculation)."""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.attention.backends.triton_attn import TritonAttentionBackend
from kvllm.attention.backends.triton_attn_impl import TritonAttentionMetadataBuilder
from kvllm.attention.metadata import KVCacheSpec
from kvllm.worker import model_runner
from kvllm.worker.cuda_graph import CudaGraphRunner, EagerGraph
from kvllm.worker.uniform_graph import UniformDecodeGraphs, spec_capture_sizes
from tests.e2e.test_spec_decode import repetitive_prompts

K = 3
# Requests finish at different steps, some inside a run of accepted drafts and some with fewer slots
# left than k (they draft fewer tokens): batches shrink from 4 to 1 while verifying.
MAX_TOKENS = [9, 4, 14, 6]


def _engine(path, monkeypatch, speculative_config=None) -> LLM:
    from kvllm.platforms import simulate_platform

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    with simulate_platform("cuda", (9, 0)):
        return LLM(
            str(path),
            dtype="float32",
            seed=0,
            attention_backend="TRITON_ATTN",
            cudagraph_capture_sizes=[1, 2, 4],
            cudagraph_mode="FULL_DECODE_ONLY",  # prompts run eagerly: this file is about decode graphs
            max_model_len=256,
            kv_cache_memory_bytes=64 * 16 * 2 * 2 * 2 * 32 * 4,  # 64 blocks of the tiny Qwen3
            speculative_config=speculative_config,
        )


def _generate(llm: LLM) -> list[list[int]]:
    prompts = repetitive_prompts([5, 11, 3, 8], seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain_ids(tiny_qwen3_path) -> list[list[int]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _generate(_engine(tiny_qwen3_path, monkeypatch))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_greedy_ids_with_graphed_verification_equal_plain_decoding(
    tiny_qwen3_path, monkeypatch, plain_ids, method, tmp_path
):
    config = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif method == "eagle":  # a random head: drafts mostly rejected; the head runs eagerly
        from tests.spec_heads import write_eagle_head

        config["model"] = str(write_eagle_head(tmp_path / "eagle", tiny_qwen3_path))
    else:
        config["model"] = str(tiny_qwen3_path)  # the target as its own draft: every draft agrees
    llm = _engine(tiny_qwen3_path, monkeypatch, config)
    runner = llm.llm_engine.executor.worker.model_runner
    multi = runner.decode_graphs.multi
    assert multi is not None and multi.query_len == K + 1 and sorted(multi.graphs) == [1, 2, 4]
    seen = []
    replay = CudaGraphRunner.replay

    def recording_replay(self, common, num_real_tokens):
        if self.query_len > 1 and common.num_actual_tokens == common.num_reqs * (K + 1):  # the target's
            lens = common.query_lens_cpu.tolist()
            seen.append(lens)
            # Real tokens packed first; every padded token row writes no KV.
            real = sum(lens)
            assert common.num_decodes == common.num_reqs and real <= num_real_tokens
            assert (common.slot_mapping[real:] == -1).all() and (common.slot_mapping[:real] >= 0).all()
        return replay(self, common, num_real_tokens)

    monkeypatch.setattr(CudaGraphRunner, "replay", recording_replay)
    assert _generate(llm) == plain_ids
    stats = llm.llm_engine.spec_decode.stats
    assert stats.num_accepted_tokens > 0 or method == "eagle"
    assert stats.num_draft_tokens > 0
    counts = runner.graph_replay_counts()
    # Every verification step (its batch <= 4 requests, <= k + 1 tokens each) replayed the k + 1 graph.
    assert runner.num_verify_steps > 0 and runner.num_verify_steps_graphed == runner.num_verify_steps
    assert counts["target"][K + 1] >= runner.num_verify_steps
    assert all(len(lens) in (1, 2, 4) and max(lens) <= K + 1 for lens in seen)
    assert any(sum(lens) < len(lens) * (K + 1) for lens in seen)  # padded requests or fewer drafts
    if method == "draft_model":
        assert runner.drafter.graphs is not None
        # Decode-only steps skip the pass over their tokens: the first proposal step runs two tokens
        # per request (the last accepted and the emitted one), the other k - 1 one each.
        assert counts["draft_step"][K + 1] == 0
        assert counts["draft_propose"][2] >= counts["target"][K + 1]
        assert counts["draft_propose"][1] >= (K - 1) * counts["target"][K + 1] // 2
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the target drafts for itself


def test_graph_selection_and_bucket_sizes():
    spec = KVCacheSpec(16, 2, 32, torch.float32, "auto")
    builder = TritonAttentionMetadataBuilder(TritonAttentionBackend, spec, torch.device("cpu"), 8, 24, 256)
    buffers = torch.zeros(32, dtype=torch.int32)
    graphs = UniformDecodeGraphs(
        lambda ids, pos: ids.float().unsqueeze(1),
        builder,
        buffers,
        buffers,
        [1, 2, 4, 8],
        lambda n, query_len=1: None,
        spec_query_len=K + 1,
        graph_factory=EagerGraph,
    )
    # 8 x 4 tokens exceed the builder's 24: the k + 1 graphs stop at 4 requests.
    assert graphs.multi is not None and graphs.multi.capture_sizes == [1, 2, 4]
    assert spec_capture_sizes([1, 2, 4, 8], 4, 16) == [1, 2, 4]
    select = {(n, q): graphs.select(n, q) for n in (1, 3, 5) for q in (1, 2, 4, 5)}
    assert select[(3, 1)] == (graphs.single, 4)
    assert select[(5, 1)] == (graphs.single, 8)
    assert select[(1, 2)] == (graphs.multi, 1) and select[(3, 4)] == (graphs.multi, 4)
    assert select[(5, 2)] is None  # no k + 1 graph of 8 requests
    assert select[(1, 5)] is None  # a prompt chunk: piecewise or eager
    no_spec = UniformDecodeGraphs(
        lambda ids, pos: ids, builder, buffers, buffers, [1, 2], lambda n, query_len=1: None
    )
    assert no_spec.multi is None and no_spec.select(2, 2) is None

    one_token_only = type(
        "OneTokenBuilder", (TritonAttentionMetadataBuilder,), {"uniform_batch_graphs": False}
    )
    narrow = UniformDecodeGraphs(
        lambda ids, pos: ids,
        one_token_only(TritonAttentionBackend, spec, torch.device("cpu"), 8, 24, 256),
        buffers,
        buffers,
        [1, 2],
        lambda n, query_len=1: None,
        spec_query_len=K + 1,
    )
    assert narrow.multi is None and narrow.select(2, 2) is None  # verification runs piecewise


def test_a_verification_step_beside_a_prefill_is_counted_apart(tiny_qwen3_path, monkeypatch):
    """A prompt that arrives while others verify drafts shares their step: that step has no uniform
    graph (one query is a prefill chunk), so it is a mixed verification step, not an ungraphed one; the
    pure verification steps around it still all replay the k + 1 graph."""
    config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _engine(tiny_qwen3_path, monkeypatch, config)
    engine = llm.llm_engine
    runner = engine.executor.worker.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts([5, 11], seed=21)):
        engine.add_request(f"short-{i}", {"prompt_token_ids": prompt}, params)
    while runner.num_verify_steps == 0 and engine.has_unfinished_requests():
        engine.step()
    assert runner.num_verify_steps > 0 and runner.num_mixed_verify_steps == 0
    long_prompt = repetitive_prompts([24], seed=5)[0]  # 72 tokens, more than k + 1
    engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert runner.num_mixed_verify_steps >= 1
    assert runner.num_verify_steps_graphed == runner.num_verify_steps, runner.ungraphed_verify_steps
