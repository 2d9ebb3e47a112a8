"""The real SmolLM2-135M-Instruct through the whole engine, against HF transformers on the same weights."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time, there was a little",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)


def test_greedy_equals_hf_on_real_weights(llm, smollm2_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        ref_tokens, _, _ = hf_greedy(smollm2_path, output.prompt_token_ids, 16)
        assert output.outputs[0].token_ids == ref_tokens, output.prompt


def test_chat_answer_names_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
