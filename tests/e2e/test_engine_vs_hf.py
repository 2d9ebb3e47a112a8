"""The engine's greedy output equals HF transformers' on tiny random models, in every scheduling mode.

Tolerance for logprobs: 1e-3 absolute. Both sides run float32 on the CPU; what differs is the
order of reductions (paged gather + SDPA vs HF's contiguous attention), worth about 1e-5.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from kvllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy

MAX_NEW_TOKENS = 10
PROMPT_LENGTHS = [1, 3, 17, 64, 129, 200, 333, 500]
LOGPROB_ATOL = 1e-3


def random_prompts(vocab: int, lengths: list[int], seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["tiny_qwen3_path", "tiny_llama_path"])
def model_and_reference(request):
    path = str(request.getfixturevalue(request.param))
    from transformers import AutoConfig

    vocab = min(AutoConfig.from_pretrained(path).vocab_size, 400)
    prompts = random_prompts(vocab, PROMPT_LENGTHS) + random_prompts(
        vocab, [5, 40, 90], seed=1, shared_prefix=70
    )
    reference = [hf_greedy(path, p, MAX_NEW_TOKENS)[:2] for p in prompts]
    return path, prompts, reference


MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 32},
    "prefix_caching": {"max_num_seqs": 4},
    # 48 blocks of 16 tokens: too few for all prompts at once, so requests are preempted and recomputed;
    # enough for the longest (500 + 10 tokens), and for max_model_len=512, as start-up requires.
    "preemption": {
        "kv_cache_memory_bytes": 48 * 16 * 2 * 2 * 2 * 32 * 4,
        "block_size": 16,
        "max_model_len": 512,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(model_and_reference, mode):
    path, prompts, reference = model_and_reference
    llm = LLM(path, dtype="float32", seed=0, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)
        assert completion.finish_reason == "length"
    stats = llm.llm_engine.stats()
    if mode == "prefix_caching":
        # The three prompts sharing a 70-token prefix hit the cache (4 full blocks of 16).
        assert stats.prefix_cache_hits >= 2 * 64
    if mode == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


# The GPU backends through the whole engine on this CPU: FLEX_ATTENTION runs here natively;
# TRITON_ATTN's kernels run in the Triton interpreter on a simulated SM 9.0 (its declaration lists
# CUDA and ROCm only), which is slow, so it gets the shorter prompts.
@pytest.mark.parametrize(
    ("backend", "num_prompts", "mode"),
    [
        ("FLEX_ATTENTION", 11, "default"),
        ("FLEX_ATTENTION", 11, "chunked_prefill"),
        ("TRITON_ATTN", 6, "chunked_prefill"),
        ("TRITON_ATTN", 3, "hnd_pages"),
    ],
)
def test_other_backends_match_hf(model_and_reference, backend, num_prompts, mode, monkeypatch):
    from kvllm.platforms import simulate_platform

    path, prompts, reference = model_and_reference
    if mode == "hnd_pages":  # the cache's pages head-major in memory (KVLLM_TRITON_KV_LAYOUT)
        monkeypatch.setenv("KVLLM_TRITON_KV_LAYOUT", "HND")
        mode = "chunked_prefill"
    platform = simulate_platform("cuda", (9, 0)) if backend == "TRITON_ATTN" else contextlib.nullcontext()
    with platform:
        llm = LLM(path, dtype="float32", seed=0, attention_backend=backend, **MODES[mode])
    assert llm.llm_engine.attention_backend_name == backend
    if backend == "TRITON_ATTN":
        cache = llm.llm_engine.executor.worker.model_runner.attention_layers[0].kv_cache
        head_major = os.environ.get("KVLLM_TRITON_KV_LAYOUT") == "HND"
        assert (cache.stride(3) > cache.stride(2)) == head_major, cache.stride()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:num_prompts]], params, use_tqdm=False)
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"{backend}: prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
