"""Speculative decoding through the engine: greedy ids equal to those without speculation for every
method and scheduling mode, stops exact inside accepted runs, rejected drafts rolled back without a
KV leak, and several attention backends verifying the multi-token queries."""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import pytest
import torch

from kvllm import LLM, SamplingParams

# Bytes of one 16-token block of the tiny Qwen3 (2 layers, K and V, 2 KV heads of 32, float32).
BLOCK_BYTES = 16 * 2 * 2 * 2 * 32 * 4
MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 32},
    "prefix_caching": {"max_num_seqs": 2},
    # 14 blocks: the prompts do not fit at once, so decodes preempt and recompute (a draft model's
    # cache takes as much again, so its runs get twice the bytes: the same 14 blocks).
    "preemption": {"kv_cache_memory_bytes": 14 * BLOCK_BYTES, "block_size": 16, "max_model_len": 224},
}
# Where each (method, mode) pair is run: every method by default, the two partial-acceptance ones
# through the scheduling modes.
CASES = [
    ("ngram", "default"),
    ("draft_is_target", "default"),
    ("noisy_draft", "default"),
    ("medusa", "default"),
    ("medusa", "chunked_prefill"),
    ("ngram", "chunked_prefill"),
    ("noisy_draft", "chunked_prefill"),
    ("noisy_draft", "prefix_caching"),
    ("ngram", "preemption"),
    ("draft_is_target", "preemption"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def noisy_draft_path(tiny_qwen3_path, tmp_path_factory) -> Path:
    """The tiny Qwen3 with noise on its weights: a draft that agrees with the target only part of the time."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("noisy_draft")
    for f in tiny_qwen3_path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    generator = torch.Generator().manual_seed(1)
    weights = load_file(tiny_qwen3_path / "model.safetensors")
    noisy = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    save_file(noisy, path / "model.safetensors", metadata={"format": "pt"})
    return path


def write_medusa_heads(path: Path, target: Path, num_heads: int = 4, prefix: str = "medusa_head.") -> Path:
    """Random Medusa heads in FasterDecoding's format: one ResBlock each (small random weights) and a
    vocabulary projection near the target's (tied) embedding, so the heads' drafts are sometimes right."""
    import json

    from safetensors.torch import load_file, save_file

    embed = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for i in range(num_heads):
        tensors[f"{prefix}{i}.0.linear.weight"] = 0.02 * torch.randn(hidden, hidden, generator=generator)
        tensors[f"{prefix}{i}.0.linear.bias"] = 0.02 * torch.randn(hidden, generator=generator)
        tensors[f"{prefix}{i}.1.weight"] = embed + 0.01 * torch.randn(vocab, hidden, generator=generator)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "medusa_lm_head.safetensors")
    config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": 1,
        "hidden_size": hidden,
        "vocab_size": vocab,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def medusa_heads_path(tiny_qwen3_path, tmp_path_factory) -> Path:
    return write_medusa_heads(tmp_path_factory.mktemp("medusa"), tiny_qwen3_path)


def _configs(target: Path, draft: Path, medusa: Path | None = None) -> dict[str, dict]:
    return {
        "medusa": {"method": "medusa", "model": str(medusa), "num_speculative_tokens": 3},
        "ngram": NGRAM,
        "draft_is_target": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
        "noisy_draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
    }


def repetitive_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random token runs repeated three times, so n-gram lookup has something to find."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] * 3 for n in lengths]


def _generate(path, prompts, params, **kwargs):
    llm = LLM(str(path), dtype="float32", seed=0, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], llm


_REFERENCE: dict[str, list] = {}


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_greedy_ids_equal_those_without_speculation(
    tiny_qwen3_path, noisy_draft_path, medusa_heads_path, method, mode
):
    config = _configs(tiny_qwen3_path, noisy_draft_path, medusa_heads_path)[method]
    if mode == "preemption":  # 3 x 4 blocks of prompt fit the 14, their outputs do not
        prompts, max_tokens = repetitive_prompts([20, 20, 20], seed=3), [30, 28, 26]
    else:
        prompts, max_tokens = repetitive_prompts([2, 19, 40, 60], seed=3), [20, 24, 3, 16]
    if mode == "prefix_caching":
        prompts += [prompts[-1][:48] + p for p in prompts[1:3]]  # 3 blocks shared with the last one
        max_tokens += [8, 1]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    if mode not in _REFERENCE:  # the same for every method
        _REFERENCE[mode] = _generate(tiny_qwen3_path, prompts, params, **MODES[mode])[0]
    reference = _REFERENCE[mode]
    kwargs = dict(MODES[mode])
    if mode == "preemption" and method != "ngram":
        kwargs["kv_cache_memory_bytes"] *= 2
    ours, llm = _generate(tiny_qwen3_path, prompts, params, speculative_config=config, **kwargs)
    assert ours == reference
    stats = llm.llm_engine.spec_decode.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    if method == "draft_is_target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the same model agrees with itself
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    engine_stats = llm.llm_engine.stats()
    if mode == "preemption":
        assert engine_stats.num_preemptions > 0 and engine_stats.num_blocks == 14
    if mode == "prefix_caching":
        assert engine_stats.prefix_cache_hits >= 2 * 48


def test_stops_are_exact_inside_accepted_runs(tiny_qwen3_path):
    """A stop token or string met inside a run of accepted drafts ends the output there."""
    path = tiny_qwen3_path
    prompts = repetitive_prompts([5, 30], seed=4)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference, _ = _generate(path, prompts, [free] * len(prompts))
    params = []
    for ids, text, _ in reference:
        params.append(
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[ids[10]])
        )
        params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[text[8:11]]))
        params.append(SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))
    tripled = [p for p in prompts for _ in range(3)]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    ours, llm = _generate(path, tripled, params, speculative_config=spec)
    assert llm.llm_engine.spec_decode.stats.num_accepted_tokens > 0
    for (ids, text, reason), p, (ref_ids, ref_text, _) in zip(
        ours, params, [r for r in reference for _ in range(3)]
    ):
        if p.stop_token_ids:
            assert reason == "stop" and ids == ref_ids[: ref_ids.index(p.stop_token_ids[0]) + 1]
        elif p.stop:
            assert reason == "stop" and p.stop[0] not in text and ref_text.startswith(text)
        else:
            assert reason == "length" and ids == ref_ids[:11]


@pytest.mark.parametrize("method", ["ngram", "draft_is_target"])
def test_rejected_drafts_are_rolled_back_and_nothing_leaks(tiny_qwen3_path, noisy_draft_path, method):
    """Step by step: a request's computed count never includes rejected drafts, and it holds no more
    blocks than its tokens, one verification and the draft model's lookahead need."""
    config = _configs(tiny_qwen3_path, noisy_draft_path)[method]
    llm = LLM(str(tiny_qwen3_path), dtype="float32", seed=0, speculative_config=config, block_size=16)
    engine = llm.llm_engine
    k = config["num_speculative_tokens"]
    lookahead = k if method != "ngram" else 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts([6, 23], seed=8)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    kv = engine.kv_cache_manager
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert request.num_computed_tokens == request.num_tokens - 1
            held = len(kv.get_block_ids(request.request_id))
            assert held <= kv.blocks_needed(request.num_tokens + k + lookahead)
    assert kv.num_free_blocks == kv.num_blocks
    assert engine.spec_decode.stats.num_accepted_tokens > 0


# The GPU backends on this CPU, as in test_engine_vs_hf: TRITON_ATTN in the Triton interpreter on a
# simulated SM 9.0, FLEX_ATTENTION natively; both see the verification's multi-token queries.
@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLEX_ATTENTION"])
def test_other_backends_verify_drafts(tiny_qwen3_path, backend):
    from kvllm.platforms import simulate_platform

    prompts = repetitive_prompts([5], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    platform = simulate_platform("cuda", (9, 0)) if backend == "TRITON_ATTN" else contextlib.nullcontext()
    spec = {"method": "draft_model", "model": str(tiny_qwen3_path), "num_speculative_tokens": 3}
    with platform:
        reference, _ = _generate(tiny_qwen3_path, prompts, params, attention_backend=backend)
        ours, llm = _generate(
            tiny_qwen3_path, prompts, params, attention_backend=backend, speculative_config=spec
        )
    assert llm.llm_engine.attention_backend_name == backend
    assert ours == reference
    assert llm.llm_engine.spec_decode.stats.num_accepted_tokens > 0


def test_requests_that_cannot_speculate_decode_one_token_per_step(tiny_qwen3_path):
    """Logprobs and penalties are served without drafts, beside speculating requests."""
    prompts = repetitive_prompts([10, 10], seed=10)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    ]
    spec = {"method": "draft_model", "model": str(tiny_qwen3_path), "num_speculative_tokens": 3}
    ours, llm = _generate(
        tiny_qwen3_path,
        prompts + prompts[:1],
        params + [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)],
        speculative_config=spec,
    )
    reference, _ = _generate(
        tiny_qwen3_path,
        prompts + prompts[:1],
        params + [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)],
    )
    assert ours == reference
    stats = llm.llm_engine.spec_decode.stats
    assert stats.num_drafts > 0
    assert not llm.llm_engine.async_scheduling  # turned off, with a logged reason


def test_acceptance_metrics_under_vllms_names(tiny_qwen3_path):
    """LLM.get_metrics() and the server's Prometheus series carry vLLM's spec-decoding counters."""
    from prometheus_client import CollectorRegistry

    from kvllm.engine.metrics_reader import Counter, Vector
    from kvllm.entrypoints.openai.metrics import IterationStats, PrometheusStatLogger

    spec = {"method": "draft_model", "model": str(tiny_qwen3_path), "num_speculative_tokens": 3}
    _, llm = _generate(
        tiny_qwen3_path,
        repetitive_prompts([5, 9], seed=11),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        speculative_config=spec,
    )
    stats = llm.llm_engine.spec_decode.stats
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    assert isinstance(metrics["vllm:spec_decode_num_drafts"], Counter)
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == stats.num_accepted_tokens_per_pos

    registry = CollectorRegistry()
    logger = PrometheusStatLogger.for_engine(registry, "m", llm.llm_engine)
    engine_stats = llm.llm_engine.stats()
    logger.log(IterationStats(), engine_stats)
    logger.log(IterationStats(), engine_stats)  # counters add increases only
    value = registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("vllm:spec_decode_num_drafts_total", labels) == stats.num_drafts
    assert value("vllm:spec_decode_num_accepted_tokens_total", labels) == stats.num_accepted_tokens
    assert (
        value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"})
        == (stats.num_accepted_tokens_per_pos[0])
    )


def test_speculation_beside_cuda_graph_decode_steps(tiny_qwen3_path, monkeypatch):
    """N-gram steps without drafts run as (eagerly replayed) CUDA graphs, repeated ones through the
    decode fast path; steps with drafts run eagerly between them. The ids are those without
    speculation. (Medusa drafts on every decode, so it has no graph steps to mix.)"""
    from kvllm.platforms import simulate_platform
    from kvllm.worker import model_runner
    from kvllm.worker.cuda_graph import CudaGraphRunner

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    replays = []
    real_replay = CudaGraphRunner.replay
    monkeypatch.setattr(
        CudaGraphRunner, "replay", lambda self, *a: replays.append(1) or real_replay(self, *a)
    )
    rng = random.Random(13)
    # A prompt with nothing to look up at first, and one that repeats.
    prompts = [[rng.randrange(3, 400) for _ in range(9)], repetitive_prompts([4], seed=13)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    kwargs = dict(attention_backend="TRITON_ATTN", cudagraph_capture_sizes=[1, 2, 4], max_model_len=64)
    config = NGRAM
    with simulate_platform("cuda", (9, 0)):
        reference, _ = _generate(tiny_qwen3_path, prompts, params, **kwargs)
        replays.clear()
        ours, llm = _generate(tiny_qwen3_path, prompts, params, speculative_config=config, **kwargs)
    assert replays, "no step of the speculative run was a graph replay"
    assert llm.llm_engine.executor.worker.model_runner.input_batch.num_advanced_steps > 0
    assert ours == reference
    assert llm.llm_engine.spec_decode.stats.num_drafts > 0
