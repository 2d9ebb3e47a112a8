"""logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens and extra_args through LLM.generate
on a tiny random-weight model (vocab 512, tokenizer 400)."""

from __future__ import annotations

import pytest

from kvllm import LLM, SamplingParams
from kvllm.engine.input_processor import bad_words_token_ids

PROMPTS = ["The capital of France is", "Numbers like"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 22)


def generate(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def assert_idle(llm: LLM) -> None:
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and not llm.llm_engine.has_unfinished_requests()


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_logit_bias_strongly_favouring_a_token_emits_it(llm):
    plain = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    favourite = 123
    assert all(favourite not in tokens for tokens in plain)
    for params in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={favourite: 100.0}),
        SamplingParams(
            temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True, logit_bias={favourite: 100}
        ),
    ):
        for tokens in generate(llm, PROMPTS, params):
            assert tokens == [favourite] * 12
    # A strong negative bias on the greedy choice changes it.
    first = plain[0][0]
    biased = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))
    assert biased[0][0] != first
    assert_idle(llm)


def test_allowed_token_ids_restrict_the_output(llm):
    allowed = [17, 58, 101, 230, 399]
    for params in (
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(
            temperature=1.5, seed=11, n=3, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed
        ),
    ):
        outputs = generate(llm, PROMPTS, params)
        assert all(set(tokens) <= set(allowed) for tokens in outputs)
    assert len({t for tokens in outputs for t in tokens}) > 1  # sampled among them, not stuck on one
    assert_idle(llm)


def test_bad_words_never_appear(llm):
    tokenizer = llm.get_tokenizer()
    plain_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPTS, plain_params, use_tqdm=False)
    # Words the model says without the ban: one of one token, one of two.
    words = ["Par", "pithi"]
    assert all(w in plain[0].outputs[0].text for w in words)
    sequences = bad_words_token_ids(tokenizer, words)
    assert any(len(s) == 1 for s in sequences) and any(len(s) > 1 for s in sequences)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words),
        SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=48, ignore_eos=True, bad_words=words),
    ):
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            for c in output.outputs:
                assert not any(contains(c.token_ids, s) for s in sequences), (c.token_ids, sequences)
                assert not any(w in c.text for w in words), c.text
        assert params.bad_words_token_ids is None  # the caller's params are not changed
    assert_idle(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(5, 65))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params.replace(truncate_prompt_tokens=10), use_tqdm=False)[
        0
    ]
    assert out.prompt_token_ids == ids[-10:]
    expected = llm.generate({"prompt_token_ids": ids[-10:]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    # Shorter than k: unchanged; -1 keeps max_model_len tokens.
    short = llm.generate({"prompt_token_ids": ids}, params.replace(truncate_prompt_tokens=-1), use_tqdm=False)
    assert short[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens=300 is not valid.*max_model_len \\(256\\)"):
        llm.generate({"prompt_token_ids": ids}, params.replace(truncate_prompt_tokens=300), use_tqdm=False)
    # A prompt longer than the context fits once truncated.
    long = list(range(5, 305))
    out = llm.generate(
        {"prompt_token_ids": long}, params.replace(truncate_prompt_tokens=100), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == long[-100:] and len(out.outputs[0].token_ids) == 6
    assert_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {512: 1.0}}, r"logit_bias=\{512: 1.0\} is not valid.*< 512"),
        ({"allowed_token_ids": [5, 450]}, r"allowed_token_ids=\[450\] is not valid.*< 400"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert_idle(llm)
    # Bias on a padded id of the logits (>= the tokenizer's 400, < the model's 512) is allowed.
    assert generate(llm, ["hello"], SamplingParams(temperature=0, max_tokens=2, logit_bias={450: 100}))[
        0
    ] == [
        450,
        450,
    ]


def test_extra_args_pass_through(llm):
    params = SamplingParams(max_tokens=3, ignore_eos=True, extra_args={"my_processor": {"k": 1}})
    assert len(generate(llm, ["hello"], params)[0]) == 3
    assert params.replace(seed=1).extra_args == {"my_processor": {"k": 1}}
