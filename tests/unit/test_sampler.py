"""Sampler against plain-torch, one-row-at-a-time references on fixed random logits."""

from __future__ import annotations

import math

import pytest
import torch

from kvllm.sample.sampler import Sampler, SamplingRow
from kvllm.sampling_params import SamplingParams

VOCAB = 64


def _logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _row(params: SamplingParams, prompt=(), output=(), eos=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, list(eos))


def _reference_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The documented pipeline for one row, written the obvious way."""
    p = row.params
    x = logits.clone().double()
    if len(row.output_token_ids) < p.min_tokens:
        for t in [*row.eos_token_ids, *p.stop_token_ids]:
            x[t] = -math.inf
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in row.output_token_ids:
        x[t] -= p.frequency_penalty
    for t in set(row.output_token_ids):
        x[t] -= p.presence_penalty
    if p.is_greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    x = x / p.temperature
    if p.top_k > 0:
        kth = x.sort(descending=True).values[min(p.top_k, x.numel()) - 1]
        x[x < kth] = -math.inf
    if p.top_p < 1.0:
        probs = x.softmax(-1)
        order = probs.argsort(descending=True)
        cumulative = probs[order].cumsum(0)
        num_keep = int((cumulative < p.top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        x[order[num_keep:]] = -math.inf
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return x.softmax(-1)


PARAM_CASES = {
    "plain": SamplingParams(),
    "temperature": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(top_k=5),
    "top_k_hot": SamplingParams(top_k=10, temperature=1.7),
    "top_p": SamplingParams(top_p=0.7),
    "top_p_small": SamplingParams(top_p=0.05),
    "top_k_top_p": SamplingParams(top_k=8, top_p=0.8, temperature=0.9),
    "min_p": SamplingParams(min_p=0.1),
    "all_truncation": SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=0.8),
    "repetition": SamplingParams(repetition_penalty=1.5),
    "repetition_below_one": SamplingParams(repetition_penalty=0.7),
    "frequency": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=-1.2),
    "all_penalties": SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, top_k=12
    ),
    "greedy": SamplingParams(temperature=0.0),
    "greedy_penalised": SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
}


def _rows_for_cases(cases: list[SamplingParams]) -> list[SamplingRow]:
    prompt = [1, 2, 3, 3, 40, 41]
    output = [3, 7, 7, 7, 9, 41, 63]
    return [_row(p, prompt=prompt, output=output) for p in cases]


@pytest.mark.parametrize("name", list(PARAM_CASES))
def test_processed_distribution_matches_reference(name):
    logits = _logits(4, seed=1)
    rows = _rows_for_cases([PARAM_CASES[name]] * 4)
    probs = Sampler().sampling_probs(logits, rows)
    for i, row in enumerate(rows):
        torch.testing.assert_close(probs[i].double(), _reference_probs(logits[i], row), atol=1e-6, rtol=1e-5)


def test_mixed_batch_matches_reference_row_by_row():
    cases = list(PARAM_CASES.values())
    logits = _logits(len(cases), seed=2)
    rows = _rows_for_cases(cases)
    probs = Sampler().sampling_probs(logits, rows)
    for i, row in enumerate(rows):
        torch.testing.assert_close(probs[i].double(), _reference_probs(logits[i], row), atol=1e-6, rtol=1e-5)
    # Every sampled token lies in the support of its row's distribution.
    for _ in range(5):
        out = Sampler()(logits, rows)
        assert all(probs[i, t] > 0 for i, t in enumerate(out.token_ids))


def test_penalties_only_touch_seen_tokens():
    logits = _logits(1, seed=3)
    row = _row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[5], output=[6, 6])
    work = Sampler._apply_sequence_processors(logits, [row])[0]
    unseen = torch.ones(VOCAB, dtype=torch.bool)
    unseen[[5, 6]] = False
    assert torch.equal(work[unseen], logits[0][unseen])
    x5 = logits[0, 5]
    assert work[5] == (x5 / 2 if x5 > 0 else x5 * 2)
    x6 = logits[0, 6]
    assert torch.isclose(work[6], (x6 / 2 if x6 > 0 else x6 * 2) - 2.0)


def test_greedy_is_argmax_and_skips_rng():
    logits = _logits(6, seed=4)
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    state = torch.get_rng_state()
    out = Sampler()(logits, rows)
    assert torch.equal(torch.get_rng_state(), state)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    expected = logits.log_softmax(-1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.sampled_logprobs), expected)


def test_top_k_one_is_greedy():
    logits = _logits(3, seed=5)
    out = Sampler()(logits, [_row(SamplingParams(top_k=1, temperature=1.5)) for _ in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    logits = torch.zeros(4, VOCAB)
    logits[:, 2] = 100.0  # EOS
    logits[:, 9] = 50.0  # a stop token id
    logits[:, 11] = 10.0
    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    rows = [
        _row(greedy, output=[4], eos=[2]),  # 1 < 3: both suppressed
        _row(greedy, output=[4, 4, 4], eos=[2]),  # reached min_tokens
        _row(SamplingParams(min_tokens=3, stop_token_ids=[9], top_k=1), output=[], eos=[2]),
        # EOS does not stop an ignore_eos request, so min_tokens leaves it alone (as vLLM does).
        _row(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True), eos=[2]),
    ]
    assert Sampler()(logits, rows).token_ids == [11, 2, 11, 2]


def _seeded_run(batch_size: int, position: int, steps: int, seed: int = 1234) -> list[int]:
    """Sample `steps` tokens for one seeded row placed among other seeded/unseeded/greedy rows."""
    target = SamplingParams(seed=seed, temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    generators = {i: torch.Generator().manual_seed(seed + 1 + i) for i in range(batch_size)}
    generators[position] = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    others = [SamplingParams(), SamplingParams(seed=7, top_k=3), SamplingParams(temperature=0.0)]
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        rows = []
        for i in range(batch_size):
            params = target if i == position else others[i % 3]
            generator = generators[i] if params.seed is not None else None
            rows.append(_row(params, prompt=[1, 2, 3], output=outputs[i], generator=generator))
        logits = _logits(batch_size, seed=100 + step)
        logits[position] = _logits(1, seed=500 + step)[0]
        out = sampler(logits, rows)
        for i, t in enumerate(out.token_ids):
            outputs[i].append(t)
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_rows_reproduce_independently_of_batch():
    alone = _seeded_run(batch_size=1, position=0, steps=12)
    torch.manual_seed(0)
    in_batch = _seeded_run(batch_size=8, position=5, steps=12)
    torch.manual_seed(99)
    elsewhere = _seeded_run(batch_size=8, position=2, steps=12)
    assert alone == in_batch == elsewhere
    assert len(set(alone)) > 1  # really sampling, not collapsing to one token
    assert _seeded_run(batch_size=1, position=0, steps=12, seed=4321) != alone


def test_temperature_sampling_frequencies_match_distribution():
    torch.manual_seed(0)
    vocab, num_samples = 10, 20000
    base = _logits(1, seed=6, vocab=vocab)
    params = SamplingParams(temperature=0.7, top_k=8)
    rows = [_row(params) for _ in range(num_samples)]
    expected = _reference_probs(base[0], rows[0])
    out = Sampler()(base.expand(num_samples, vocab).contiguous(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0  # masked tokens never drawn
    support = expected > 0
    expected_counts = expected[support] * num_samples
    chi2 = ((counts[support] - expected_counts) ** 2 / expected_counts).sum().item()
    assert chi2 < 40.0, (chi2, counts, expected_counts)  # df = 7: p(chi2 > 40) < 1e-5


def test_seeded_sampling_frequencies_match_distribution():
    vocab, steps = 6, 3000
    logits = _logits(1, seed=8, vocab=vocab)
    generator = torch.Generator().manual_seed(5)
    row = _row(SamplingParams(seed=5), generator=generator)
    counts = torch.zeros(vocab, dtype=torch.float64)
    sampler = Sampler()
    for _ in range(steps):
        counts[sampler(logits, [row]).token_ids[0]] += 1
    expected = logits[0].double().softmax(-1) * steps
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 35.0, (chi2, counts, expected)


def test_logprobs_are_raw_with_ranks_and_sampled_token():
    logits = _logits(3, seed=9)
    raw = logits.log_softmax(-1)
    rows = [
        _row(
            SamplingParams(logprobs=5, temperature=0.0, repetition_penalty=3.0),
            prompt=logits[0].topk(2).indices,
        ),
        _row(SamplingParams(logprobs=0, temperature=5.0, top_p=0.999)),
        _row(SamplingParams()),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs[2] is None
    top5 = raw[0].topk(5)
    entry = out.logprobs[0]
    sampled = out.token_ids[0]
    assert sampled not in top5.indices[:2].tolist()  # the penalty moved the argmax; logprobs stay raw
    for rank, (value, token) in enumerate(zip(top5.values.tolist(), top5.indices.tolist()), start=1):
        assert entry[token].rank == rank and entry[token].logprob == pytest.approx(value, abs=1e-6)
    assert sampled in entry
    expected_rank = int((raw[0] > raw[0, sampled]).sum()) + 1
    assert entry[sampled].rank == expected_rank
    assert entry[sampled].logprob == pytest.approx(raw[0, sampled].item(), abs=1e-6)
    assert len(entry) == (5 if expected_rank <= 5 else 6)
    assert out.sampled_logprobs[0] == pytest.approx(raw[0, sampled].item(), abs=1e-6)
    # logprobs=0: only the sampled token, with its rank under the raw distribution.
    only = out.logprobs[1]
    token = out.token_ids[1]
    assert list(only) == [token]
    assert only[token].rank == int((raw[1] > raw[1, token]).sum()) + 1
    for i in range(3):
        assert out.sampled_logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)


def test_logprobs_when_greedy_repetition_penalty_moves_the_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    row = _row(SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2), prompt=[0])
    out = Sampler()(logits, [row])
    assert out.token_ids == [1]
    assert out.logprobs[0][1].rank == 2 and out.logprobs[0][0].rank == 1
    assert list(out.logprobs[0]) == [1, 0]


def test_bfloat16_logits_and_rejects_bad_shapes():
    logits = _logits(2, seed=10).to(torch.bfloat16)
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(top_k=3))])
    assert out.token_ids[0] == logits.float().argmax(-1)[0].item()
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(logits, [_row(SamplingParams())])


def test_top_k_only_batch_with_disabled_rows():
    cases = [
        SamplingParams(top_k=5),
        SamplingParams(),
        SamplingParams(top_k=1000),
        SamplingParams(top_k=2, min_p=0.2),
    ]
    logits = _logits(len(cases), seed=11)
    rows = _rows_for_cases(cases)
    probs = Sampler().sampling_probs(logits, rows)
    batched = Sampler._random_probs(logits, rows)
    for i, row in enumerate(rows):
        torch.testing.assert_close(probs[i].double(), _reference_probs(logits[i], row), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batched[i], probs[i])
    assert [int((p > 0).sum()) for p in batched] == [5, VOCAB, VOCAB, 2]
