"""Which requests may be drafted: features whose token choice depends on each earlier position (or
that report per-token logprobs) decode one token per step, beside speculating requests."""

from __future__ import annotations

import pytest

from kvllm import SamplingParams
from kvllm.core.request import Request
from kvllm.sampling_params import StructuredOutputsParams
from kvllm.spec_decode.coordinator import can_speculate


def request(**params) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=8, **params), max_tokens=8, eos_token_ids=(0,))


def test_plain_requests_speculate():
    assert can_speculate(request())
    assert can_speculate(request(temperature=0.8, top_k=20, top_p=0.9))


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 2},
        {"repetition_penalty": 1.2},
        {"bad_words": ["x"]},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [1, 2]},
        {"min_tokens": 4},
        {"structured_outputs": StructuredOutputsParams(regex="[ab]+")},
    ],
    ids=lambda p: next(iter(p)),
)
def test_position_dependent_features_do_not(params):
    assert not can_speculate(request(**params))
