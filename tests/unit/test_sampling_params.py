"""SamplingParams: vLLM defaults, normalisation, validation messages, copies."""

from __future__ import annotations

import pytest

from kvllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy and not p.has_penalties


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.0, seed=3).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.5, seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"temperature": -0.1}, ["temperature", "-0.1", ">= 0"]),
        ({"top_p": 0.0}, ["top_p", "0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ["top_p", "1.5", "(0, 1]"]),
        ({"top_k": -2}, ["top_k", "-2", ">= 1"]),
        ({"top_k": 2.5}, ["top_k", "2.5"]),
        ({"min_p": 1.2}, ["min_p", "1.2", "[0, 1]"]),
        ({"presence_penalty": 2.5}, ["presence_penalty", "2.5", "[-2, 2]"]),
        ({"frequency_penalty": -3}, ["frequency_penalty", "-3", "[-2, 2]"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty", "0.0", "> 0"]),
        ({"n": 0}, ["n=0", ">= 1"]),
        ({"max_tokens": 0}, ["max_tokens=0", ">= 1"]),
        ({"min_tokens": -1}, ["min_tokens=-1", ">= 0"]),
        ({"min_tokens": 20, "max_tokens": 10}, ["min_tokens=20", "max_tokens (10)"]),
        ({"logprobs": -2}, ["logprobs=-2", ">= 0"]),
        ({"logprobs": -1}, ["logprobs=-1", "not supported"]),
        ({"prompt_logprobs": -1}, ["prompt_logprobs=-1", "integer >= 0"]),
        ({"seed": "7"}, ["seed", "'7'", "integer"]),
        ({"seed": 1.5}, ["seed", "1.5", "integer"]),
        ({"seed": 2**64}, ["seed", "18446744073709551616", "-2**63 to 2**64 - 1"]),
        ({"stop": ["ok", ""]}, ["stop", "non-empty"]),
        ({"stop_token_ids": [-1]}, ["stop_token_ids", "-1"]),
        ({"logit_bias": {5: 100.5}}, ["logit_bias={5: 100.5}", "-100 to 100"]),
        ({"logit_bias": {"5": 1.0}}, ["logit_bias", "integers >= 0"]),
        ({"logit_bias": {-1: 1.0}}, ["logit_bias", "integers >= 0"]),
        ({"logit_bias": {5: "x"}}, ["logit_bias", "numbers"]),
        ({"logit_bias": [5]}, ["logit_bias", "dict"]),
        ({"allowed_token_ids": []}, ["allowed_token_ids=[]", "non-empty"]),
        ({"allowed_token_ids": [3, -2, 1.5]}, ["allowed_token_ids=[-2, 1.5]", "integers >= 0"]),
        ({"bad_words": ["ok", ""]}, ["bad_words", "not empty"]),
        ({"bad_words": ["  "]}, ["bad_words", "whitespace"]),
        ({"bad_words": "word"}, ["bad_words", "list of strings"]),
        ({"truncate_prompt_tokens": 0}, ["truncate_prompt_tokens=0", "-1"]),
        ({"truncate_prompt_tokens": -2}, ["truncate_prompt_tokens=-2", ">= 1"]),
        ({"extra_args": [1]}, ["extra_args", "dict"]),
        ({"stop": "x", "detokenize": False}, ["stop", "detokenize=True"]),
        ({"temperature": float("nan")}, ["temperature", "nan"]),
    ],
)
def test_validation_errors_name_field_value_and_range(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_valid_edges():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, min_tokens=16, max_tokens=16, logprobs=0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5, seed=0)
    SamplingParams(min_tokens=100, max_tokens=None)


def test_clone_and_replace():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], temperature=0.5)
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert (
        p.stop == ["a"] and p.stop_token_ids == [1] and q == p.replace(stop=["a", "b"], stop_token_ids=[1, 2])
    )
    r = p.replace(max_tokens=100)
    assert r.max_tokens == 100 and r.temperature == 0.5 and p.max_tokens == 16
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)
    with pytest.raises(TypeError, match="best_of"):
        p.replace(best_of=2)


def test_token_constraint_fields_and_copies():
    p = SamplingParams(
        logit_bias={3: -100, 7: 2.5},
        allowed_token_ids=(1, 2, 3),
        bad_words=("foo", "bar baz"),
        truncate_prompt_tokens=-1,
        extra_args={"custom": [1]},
    )
    assert p.allowed_token_ids == [1, 2, 3] and p.bad_words == ["foo", "bar baz"]
    assert p.has_token_constraints and not SamplingParams().has_token_constraints
    assert SamplingParams().bad_words == [] and SamplingParams().bad_words_token_ids is None
    p._bad_words_token_ids = [[1], [2, 3]]
    copy = p.replace(seed=1)
    assert copy.bad_words_token_ids == [[1], [2, 3]]  # same words: their tokens carry over
    copy.logit_bias[9] = 1.0
    copy.allowed_token_ids.append(9)
    copy.bad_words.append("new")
    assert 9 not in p.logit_bias and 9 not in p.allowed_token_ids and p.bad_words == ["foo", "bar baz"]
    assert p.replace(bad_words=["other"]).bad_words_token_ids is None  # tokenized again by the engine
