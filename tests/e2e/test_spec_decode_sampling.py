"""At temperature 1.0 the tokens sampled with speculation follow the same distribution as without.

N requests share one prompt, so each output position j has one distribution; the histograms of the
token at positions 0..3 with and without speculation (independent engines, different seeds) are
compared by Pearson's chi-square test of homogeneity, each at significance level ALPHA (Bonferroni
over the positions: 4 * ALPHA for the test). A negative control accepts every draft: the same test
must reject it. The model is a tiny Qwen3 with large weights, so its distributions are peaked (a few
dozen tokens carry the mass) and its own greedy drafts are accepted about half the time.
"""

from __future__ import annotations

import pytest
import torch

import kvllm.spec_decode.rejection_sampler as rs
from kvllm import LLM, SamplingParams
from tests import model_factory

ALPHA = 1e-3
N = 600
PROMPT = [5, 17, 33, 5, 17, 33, 5, 17]


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    return model_factory.make_tiny_qwen3(
        tmp_path_factory.mktemp("peaked"), vocab_size=400, initializer_range=1.0
    )


def homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two samples of token ids come from one distribution (categories with an
    expected count below 5 in either sample are pooled into one)."""
    size = int(max(a.max(), b.max())) + 1
    table = torch.stack([torch.bincount(a, minlength=size), torch.bincount(b, minlength=size)]).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = (expected < 5).any(0)
    if small.any():
        table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], 1)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _sample(path, seed: int, speculative_config=None) -> tuple[torch.Tensor, LLM]:
    llm = LLM(str(path), dtype="float32", seed=seed, speculative_config=speculative_config)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids for o in outs]), llm


@pytest.fixture(scope="module")
def without_speculation(peaked_model):
    return _sample(peaked_model, seed=0)[0]


def _draft_config(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}


def test_sampled_tokens_have_the_distribution_without_speculation(peaked_model, without_speculation):
    ours, llm = _sample(peaked_model, seed=1, speculative_config=_draft_config(peaked_model))
    stats = llm.llm_engine.spec_decode.stats
    assert 0.2 < stats.acceptance_rate < 0.9  # drafts are both accepted and rejected
    for j in range(4):
        assert homogeneity_p_value(ours[:, j], without_speculation[:, j]) > ALPHA, f"position {j}"


@pytest.fixture(scope="module")
def repeating_model(tmp_path_factory):
    """A less peaked tiny Qwen3 with damped layers: it often repeats its last token, which the random
    EAGLE head (near-identity, tests/spec_heads.py) drafts, so its drafts are accepted now and then."""
    from tests.spec_heads import damp_layers

    path = model_factory.make_tiny_qwen3(
        tmp_path_factory.mktemp("repeating"), vocab_size=400, initializer_range=0.5
    )
    return damp_layers(path, 0.3)


def test_eagle_sampled_tokens_have_the_distribution_without_speculation(repeating_model, tmp_path):
    from tests.spec_heads import write_eagle_head

    reference, _ = _sample(repeating_model, seed=0)
    head = write_eagle_head(tmp_path / "eagle", repeating_model)
    config = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    ours, llm = _sample(repeating_model, seed=1, speculative_config=config)
    stats = llm.llm_engine.spec_decode.stats
    assert 0.02 < stats.acceptance_rate < 0.9  # drafts are both accepted and rejected
    for j in range(4):
        assert homogeneity_p_value(ours[:, j], reference[:, j]) > ALPHA, f"position {j}"


def test_negative_control_accepting_every_draft_is_detected(peaked_model, without_speculation, monkeypatch):
    monkeypatch.setattr(rs, "_uniforms", lambda n, md, device: torch.zeros(n, device=device))
    biased, _ = _sample(peaked_model, seed=1, speculative_config=_draft_config(peaked_model))
    p_values = [homogeneity_p_value(biased[:, j], without_speculation[:, j]) for j in range(4)]
    assert min(p_values) < ALPHA
