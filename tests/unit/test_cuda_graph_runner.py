"""CudaGraphRunner's logic without a GPU: buckets, padding, static buffers, builder hooks, fallback.

On the CPU the runner replays with EagerGraph (the captured callable is run again on the same
buffers), so everything but the CUDA graph itself is exercised, through the whole engine too.
"""

from __future__ import annotations

import pytest
import torch

from kvllm import LLM, SamplingParams
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.forward_context import get_forward_context
from kvllm.worker import model_runner
from kvllm.worker.cuda_graph import CudaGraphRunner, EagerGraph, default_capture_sizes
from tests.e2e.test_engine_vs_hf import random_prompts
from tests.hf_reference import hf_greedy


def test_default_capture_sizes_follow_vllms_ladder():
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(6) == [1, 2, 4, 6]  # the largest batch gets its own graph
    assert default_capture_sizes(1024)[-3:] == [480, 496, 512]  # capped at 512 by default
    assert default_capture_sizes(1024, max_capture_size=300)[-2:] == [288, 300]


def _common(num_reqs: int) -> CommonAttentionMetadata:
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq_lens = torch.ones(num_reqs, dtype=torch.int32)
    return CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        num_decodes=num_reqs,
        num_decode_tokens=num_reqs,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=1,
        block_table=torch.zeros(num_reqs, 1, dtype=torch.int32),
        slot_mapping=torch.full((num_reqs,), -1),
    )


class RecordingBuilder:
    """Stands in for a backend builder: records the hook calls and the metadata it hands out."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.static = torch.zeros(16)

    def prepare_for_capture(self, common):
        self.calls.append(("capture", common.num_reqs))
        return ("static", common.num_reqs)

    def prepare_for_replay(self, common):
        self.calls.append(("replay", common.num_reqs))
        self.static[: common.num_reqs] = common.seq_lens_cpu.float()
        return ("static", common.num_reqs)


def test_capture_largest_first_then_replay_reads_the_same_buffers():
    ids = torch.zeros(16, dtype=torch.int32)
    positions = torch.zeros(16, dtype=torch.int32)
    builder = RecordingBuilder()
    seen: list[tuple[int, int, object]] = []

    def forward(input_ids, pos):
        seen.append((input_ids.data_ptr(), input_ids.shape[0], get_forward_context().attn_metadata))
        # Depends on the inputs and on the builder's static buffer, as attention would.
        return (input_ids.float() * 10 + pos.float() + builder.static[: input_ids.shape[0]]).unsqueeze(1)

    runner = CudaGraphRunner(forward, builder, ids, positions, [1, 4, 8], _common, graph_factory=EagerGraph)
    stats = runner.capture()
    assert stats.sizes == [1, 4, 8]
    assert builder.calls == [("capture", 8), ("capture", 4), ("capture", 1)]  # largest first
    assert [runner.padded_size(n) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]

    ids[:3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    positions[:3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    common = _common(4)
    common.seq_lens_cpu[:] = torch.tensor([5, 6, 7, 0], dtype=torch.int32)
    seen.clear()
    hidden = runner.replay(common, num_real_tokens=3)
    assert builder.calls[-1] == ("replay", 4)
    assert hidden.squeeze(1).tolist() == [76.0, 88.0, 100.0]
    # The replayed forward read the input buffers at their fixed address, with the capture's metadata.
    assert seen == [(ids.data_ptr(), 4, ("static", 4))]
    assert runner.num_replays == 1


def test_replay_refuses_what_was_not_captured():
    ids = torch.zeros(8, dtype=torch.int32)
    runner = CudaGraphRunner(
        lambda i, p: i.float().unsqueeze(1),
        RecordingBuilder(),
        ids,
        ids,
        [2],
        _common,
        graph_factory=EagerGraph,
    )
    runner.capture()
    with pytest.raises(ValueError, match="no graph"):
        runner.replay(_common(3), 3)
    mixed = _common(2)
    mixed.max_query_len = 3
    with pytest.raises(ValueError, match="no graph"):
        runner.replay(mixed, 2)
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        CudaGraphRunner(lambda i, p: i, RecordingBuilder(), ids, ids, [16], _common)


@pytest.mark.parametrize(
    "backend", ["TRITON_ATTN", "TRITON_ATTN+fused", "FLEX_ATTENTION", "FLEX_ATTENTION+decode_path"]
)
def test_engine_with_graphs_replayed_eagerly_matches_hf(tiny_qwen3_path, monkeypatch, backend):
    """Decode steps go through the graph runner (padded to 4 or 8), prefill and mixed steps through
    the piecewise runner (padded to 16, 32 or 64 tokens; attention between the pieces on the step's
    own metadata), and greedy ids equal HF's. FLEX_ATTENTION's decode graph hooks are not declared until a
    GPU has run them, and they serve only its decode path, which runs on CUDA: it replays no decode graph
    unless "+decode_path" declares them and runs that path (eagerly, as its kernel tests do); then each
    replay must update the decode masks it reads. Its other
    steps run piecewise either way (attention stays outside the pieces).
    "+fused": the fused kernels as on a GPU, so the QK-norm + RoPE kernel stores K/V and writes q into the
    piecewise runner's shared query buffer, and the runner copies none of q, k, v for TRITON_ATTN."""
    from kvllm.attention.backends import flex_attention_impl as flex
    from kvllm.layers.ops.dispatch import fused_ops_mode
    from kvllm.worker import piecewise_graph

    backend, _, option = backend.partition("+")
    fused = option == "fused"
    if option == "decode_path":  # its hooks, declared once the GPU test has passed (as that test forces them)
        from kvllm.attention.backends.flex_attention import FlexAttentionBackend

        monkeypatch.setenv(flex.COMPILE_ENV, "0")
        monkeypatch.setattr(flex.FlexAttentionImpl, "decode_path_eager", True)
        monkeypatch.setattr(FlexAttentionBackend, "cudagraph_support", "decode_only")
    same_view, queries_in_place = piecewise_graph._same_view, []

    def spy(a, b):
        queries_in_place.append(same_view(a, b))
        return queries_in_place[-1]

    monkeypatch.setattr(piecewise_graph, "_same_view", spy)
    with fused_ops_mode("1" if fused else "auto"):
        _engine_with_graphs_matches_hf(
            tiny_qwen3_path,
            monkeypatch,
            backend,
            decode_graphs=backend == "TRITON_ATTN" or option == "decode_path",
        )
    assert queries_in_place and all(queries_in_place) == fused


def _engine_with_graphs_matches_hf(tiny_qwen3_path, monkeypatch, backend: str, decode_graphs: bool) -> None:
    from kvllm.platforms import simulate_platform

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    path = str(tiny_qwen3_path)
    prompts = random_prompts(400, [3, 17, 30, 9, 64, 5], seed=3)
    max_tokens = [6, 3, 8, 5, 2, 7]  # requests finish at different steps: batches of 6, 5, 3, 2, 1
    with simulate_platform("cuda", (9, 0)):
        llm = LLM(
            path,
            dtype="float32",
            attention_backend=backend,
            cudagraph_capture_sizes=[1, 2, 4, 8],
            max_num_batched_tokens=64,  # chunked prefill: some steps mix decodes and prefill chunks
        )
    runner = llm.llm_engine.executor.worker.model_runner.graph_runner
    piecewise = llm.llm_engine.executor.worker.model_runner.piecewise
    assert piecewise is not None and sorted(piecewise.captured) == [16, 32, 64]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, n in zip(prompts, outputs, max_tokens):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, n)[0]
    if decode_graphs:
        assert runner is not None and sorted(runner.graphs) == [1, 2, 4, 8]
        assert runner.num_replays >= 4
    else:
        assert runner is None
    assert piecewise.num_replays >= 3  # the prompts' chunks: 3 + 17 + 30 + 9 tokens, then 64, then 5
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_failed_piecewise_capture_leaves_those_steps_eager(tiny_qwen3_path, monkeypatch, caplog):
    """Piecewise graphs are a speed feature: when a model's forward cannot be captured in pieces, the
    engine warns and runs prefill and mixed steps eagerly instead of refusing to start."""
    from kvllm.platforms import simulate_platform
    from kvllm.worker.piecewise_graph import PiecewiseGraphRunner

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    monkeypatch.setattr(PiecewiseGraphRunner, "capture", fail)
    path = str(tiny_qwen3_path)
    prompt = random_prompts(400, [20], seed=4)[0]
    with simulate_platform("cuda", (9, 0)), caplog.at_level("WARNING"):
        llm = LLM(path, dtype="float32", attention_backend="TRITON_ATTN", cudagraph_capture_sizes=[1, 2])
    runner = llm.llm_engine.executor.worker.model_runner
    assert runner.piecewise is None and runner.graph_runner is not None
    assert "prefill and mixed steps run eagerly" in caplog.text and "stream is capturing" in caplog.text
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4))
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 4)[0]
