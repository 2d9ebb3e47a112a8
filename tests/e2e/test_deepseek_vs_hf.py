"""DeepSeek-V2/V3 through the engine equal HF transformers (greedy ids and logprobs), in every scheduling
mode, with CPU_MLA and with TRITON_MLA's kernel under the Triton interpreter (on a simulated SM 9.0).

Covers the MLA latent cache (written per step, read back by decode and by prefill chunks with context),
absorbed-weight decode, up-projected prefill, YaRN with mscale, q LoRA (V3), dense first layer, and the
MoE layer with V2's softmax group-limited and V3's biased sigmoid routing plus a shared expert.
Both sides run float32 on the CPU; logprobs agree to about 1e-6.
"""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from kvllm.platforms import simulate_platform
from tests.e2e.test_engine_vs_hf import random_prompts
from tests.hf_reference import hf_greedy

MAX_NEW_TOKENS = 8
LOGPROB_ATOL = 1e-4
# latent 40 floats x 4 bytes x 2 layers per token: 24 blocks of 16 (384 tokens) hold the longest prompt
# with its output, not every prompt at once, so requests are preempted and recomputed.
LATENT_BYTES_PER_TOKEN = 40 * 4 * 2
MODES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 32},
    "prefix_caching": {"max_num_seqs": 4},
    "preemption": {
        "kv_cache_memory_bytes": 24 * 16 * LATENT_BYTES_PER_TOKEN,
        "block_size": 16,
        "max_model_len": 384,
    },
}


def _model_and_reference(path: str):
    prompts = random_prompts(390, [1, 3, 17, 64, 129, 300]) + random_prompts(
        390, [5, 40], seed=1, shared_prefix=70
    )
    reference = [hf_greedy(path, p, MAX_NEW_TOKENS)[:2] for p in prompts]
    return path, prompts, reference


@pytest.fixture(scope="module", params=["tiny_deepseek_v2_path", "tiny_deepseek_v3_path"])
def model_and_reference(request):
    return _model_and_reference(str(request.getfixturevalue(request.param)))


@pytest.fixture(scope="module")
def v3_and_reference(tiny_deepseek_v3_path):
    return _model_and_reference(str(tiny_deepseek_v3_path))


def _check(llm: LLM, prompts, reference, mode: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, reference):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)
    stats = llm.llm_engine.stats()
    if mode == "prefix_caching":
        assert stats.prefix_cache_hits >= 64  # the two prompts sharing a 70-token prefix
    if mode == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("mode", list(MODES))
def test_cpu_mla_matches_hf(model_and_reference, mode):
    path, prompts, reference = model_and_reference
    llm = LLM(path, dtype="float32", seed=0, **MODES[mode])
    assert llm.llm_engine.attention_backend_name == "CPU_MLA"
    _check(llm, prompts, reference, mode)


# The interpreted kernel is slow: TRITON_MLA runs V3 only (V2 differs outside attention, which CPU_MLA
# covers), with the prompts up to 64 tokens and the two sharing a prefix, and 8 blocks for preemption.
TRITON_PROMPTS = [0, 1, 2, 3, 6, 7]
TRITON_MODES = {
    **MODES,
    "preemption": {
        **MODES["preemption"],
        "kv_cache_memory_bytes": 8 * 16 * LATENT_BYTES_PER_TOKEN,
        "max_model_len": 128,
    },
}


@pytest.mark.parametrize("mode", list(TRITON_MODES))
def test_triton_mla_matches_hf(v3_and_reference, mode):
    path, prompts, reference = v3_and_reference
    with simulate_platform("cuda", (9, 0)):
        llm = LLM(path, dtype="float32", seed=0, attention_backend="TRITON_MLA", **TRITON_MODES[mode])
    assert llm.llm_engine.attention_backend_name == "TRITON_MLA"
    _check(llm, [prompts[i] for i in TRITON_PROMPTS], [reference[i] for i in TRITON_PROMPTS], mode)


def test_triton_mla_cuda_graphs_replayed_eagerly_match_hf(v3_and_reference, monkeypatch):
    """Decode steps replay TRITON_MLA's captured steps (EagerGraph on the CPU: the same buffers, the
    same launch plan), padded from 6 requests to 8 (two of sequence length 0)."""
    from kvllm.worker import model_runner

    monkeypatch.setattr(model_runner, "graphs_available", lambda device: True)
    path, prompts, reference = v3_and_reference
    with simulate_platform("cuda", (9, 0)):
        llm = LLM(
            path, dtype="float32", seed=0, attention_backend="TRITON_MLA", cudagraph_capture_sizes=[1, 2, 8]
        )
    runner = llm.llm_engine.executor.worker.model_runner.graph_runner
    assert runner is not None and sorted(runner.graphs) == [1, 2, 8]
    _check(llm, [prompts[i] for i in TRITON_PROMPTS], [reference[i] for i in TRITON_PROMPTS], "default")
    assert runner.num_replays >= MAX_NEW_TOKENS - 1
