"""N-gram speculation on the real SmolLM2-135M-Instruct: the same greedy ids as without it, and most
drafts accepted when the answer repeats the prompt (the figure docs/benchmarks.md reports)."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step. All that glitters is not gold. Actions speak louder than words."
)
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly, twice:\n\n{TEXT}"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_ngram_on_a_repetitive_prompt(smollm2_path):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    kwargs = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20)
    plain = LLM(smollm2_path, **kwargs).chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(smollm2_path, speculative_config=NGRAM, **kwargs)
    ours = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == plain.token_ids and ours.text == plain.text
    stats = llm.llm_engine.spec_decode.stats
    # Measured 20 of 24 drafts accepted (8 verifications for 28 tokens): well above chance.
    assert stats.num_draft_tokens >= 12 and stats.acceptance_rate > 0.5
