"""The rejection sampler against its definition: greedy rows against a plain loop, sampled rows by
chi-square goodness-of-fit of the emitted tokens against the target distribution (significance level
ALPHA), with negative controls showing the same test rejects slightly biased samplers."""

from __future__ import annotations

import pytest
import torch

import kvllm.spec_decode.rejection_sampler as rs
from kvllm.sample.metadata import SamplingMetadata
from kvllm.sampling_params import SamplingParams
from kvllm.spec_decode.rejection_sampler import rejection_sample

ALPHA = 1e-3  # a correct sampler fails a test with this probability (the seeds are fixed: it passes)
V = 7


def _metadata(num_rows: int, greedy: bool = False, temperature: float = 1.0) -> SamplingMetadata:
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=temperature)
    return SamplingMetadata.from_params([params] * num_rows, torch.device("cpu"), V)


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; categories expected fewer than 5 times are pooled."""
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small].double(), observed[small].double().sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((observed.double() - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_greedy_accepts_while_the_argmax_matches():
    torch.manual_seed(0)
    num_drafts = [3, 1, 4, 2]
    logits = torch.randn(sum(num_drafts), V)
    argmax = logits.argmax(dim=-1)
    drafts = argmax.clone()
    drafts[[1, 3, 9]] = (argmax[[1, 3, 9]] + 1) % V  # rejections at these rows
    bonus = torch.randint(0, V, (len(num_drafts),))
    out = rejection_sample(logits, _metadata(len(drafts), greedy=True), drafts, num_drafts, bonus)
    start = 0
    for s, k in enumerate(num_drafts):
        expected = []
        for j in range(k):
            expected.append(int(argmax[start + j]))
            if drafts[start + j] != argmax[start + j]:
                break
        else:
            expected.append(int(bonus[s]))
        got = out.token_ids[s].tolist()
        assert got[: len(expected)] == expected and all(t == -1 for t in got[len(expected) :])
        assert int(out.num_accepted[s]) == len(expected) - 1
        start += k


def _two_position_trial(num_trials: int, with_q: bool, temperature: float = 1.0):
    """num_trials requests with 2 drafts each over the same target rows p_0, p_1 (the context is the
    same in every trial, so p_1 is the distribution after the draft d_1); returns the first emitted
    token of every trial, the second where d_1 was accepted, and the target distributions."""
    torch.manual_seed(1)
    logits = torch.randn(2, V) * 1.5
    target = (logits / temperature).softmax(dim=-1)
    q = torch.randn(2, V).softmax(dim=-1)
    if with_q:  # drafts drawn from q, as a sampling drafter would
        drafts = torch.stack([torch.multinomial(q[j], num_trials, replacement=True) for j in range(2)], 1)
        draft_probs = q.repeat(num_trials, 1)
    else:  # a deterministic drafter: always the same tokens (q one-hot)
        drafts = torch.tensor([[int(target[0].argsort()[-2]), 2]]).repeat(num_trials, 1)
        draft_probs = None
    # The bonus is a draw from the last row's target (here: after d_2, independent of the test).
    bonus = torch.multinomial(target[1], num_trials, replacement=True)
    out = rejection_sample(
        logits.repeat(num_trials, 1),
        _metadata(2 * num_trials, temperature=temperature),
        drafts.reshape(-1),
        [2] * num_trials,
        bonus,
        draft_probs,
    )
    first = out.token_ids[:, 0]
    second = out.token_ids[out.num_accepted >= 1, 1]
    return first, second, target, out


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot_q", "sampled_drafts"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_follow_the_target_distribution(with_q, temperature):
    first, second, target, out = _two_position_trial(20000, with_q, temperature)
    assert chi_square_p_value(torch.bincount(first, minlength=V), target[0]) > ALPHA
    assert chi_square_p_value(torch.bincount(second, minlength=V), target[1]) > ALPHA
    rate = out.num_accepted.float().mean()
    assert 0.05 < rate < 1.95  # both outcomes happen


@pytest.mark.parametrize(
    "bias",
    [
        lambda u: u * 0.85,  # accepts 18% too often
        lambda u: u.pow(1.1),  # accepts p^(1/1.1) of the time instead of p
    ],
    ids=["scaled_uniform", "skewed_uniform"],
)
def test_negative_control_a_biased_acceptance_fails_the_same_test(monkeypatch, bias):
    real = rs._uniforms
    monkeypatch.setattr(rs, "_uniforms", lambda n, md, device: bias(real(n, md, device)))
    first, _, target, _ = _two_position_trial(20000, with_q=False)
    assert chi_square_p_value(torch.bincount(first, minlength=V), target[0]) < ALPHA


def test_seeded_rows_are_reproducible():
    torch.manual_seed(3)
    logits = torch.randn(6, V)
    drafts = torch.randint(0, V, (6,))

    def run(seed):
        md = SamplingMetadata.from_params(
            [SamplingParams(temperature=1.0)] * 6,
            torch.device("cpu"),
            V,
            generators={i: torch.Generator().manual_seed(seed) for i in range(6)},
        )
        return rejection_sample(logits, md, drafts, [3, 3], torch.tensor([0, 1])).token_ids

    assert torch.equal(run(5), run(5))
