"""allowed_token_ids, bad_words and logit_bias in the sampler, against plain-torch references on fresh
random logits, alone, together, beside rows that use none of them, and through the input batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvllm.core.request import Request
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput
from kvllm.engine.input_processor import bad_words_token_ids
from kvllm.sample.sampler import Sampler, SamplingRow, apply_sequence_processors, metadata_from_rows
from kvllm.sampling_params import SamplingParams
from kvllm.worker.input_batch import InputBatch

VOCAB = 64
PROMPT = [1, 2, 3, 3, 40, 41]
OUTPUT = [3, 7, 7, 9, 41, 12, 13]


def _logits(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


def _params(bad_words: list[list[int]] | None = None, **kwargs) -> SamplingParams:
    """SamplingParams whose bad words are given as token ids (what the input processor sets)."""
    words = bad_words or []
    params = SamplingParams(bad_words=[f"w{i}" for i in range(len(words))], **kwargs)
    params._bad_words_token_ids = words
    return params


def _row(params: SamplingParams, output=OUTPUT, prompt=PROMPT, eos=(2,), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, list(eos))


def _reference(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """vLLM v1's processing order for one row, written the obvious way (float64)."""
    p = row.params
    x = logits.clone().double()
    if p.allowed_token_ids is not None:
        keep = torch.zeros(x.numel(), dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -math.inf
    output = list(row.output_token_ids)
    for word in p.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix) :] == prefix):
            x[word[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in [*row.eos_token_ids, *p.stop_token_ids]:
            x[t] = -math.inf
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    for t in set(row.prompt_token_ids) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in output:
        x[t] -= p.frequency_penalty
    return x


CASES = {
    "allowed": _params(allowed_token_ids=[5, 17, 33, 60]),
    "allowed_one": _params(allowed_token_ids=[44], temperature=0.0),
    "bad_single": _params([[8], [21]]),
    # [13] ends the output: banned after it; [12, 13] ends it too: 30 banned; [9, 13] does not match.
    "bad_multi": _params([[13, 25], [12, 13, 30], [9, 13, 31], [35, 50]]),
    "bad_longer_than_output": _params([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7]]),
    "bad_shared_last_token": _params([[13, 26], [5, 26]]),  # one matches, one does not: 26 banned
    "logit_bias": _params(logit_bias={4: 3.5, 19: -7.25, 63: 100.0, 0: -100.0}),
    "bias_and_penalties": _params(logit_bias={3: 2.0, 7: -1.5, 50: 4.0}, repetition_penalty=1.4),
    "all": _params(
        [[13, 22], [6]],
        allowed_token_ids=[6, 22, 7, 3, 40, 50, 2],
        logit_bias={7: 5.0, 50: -3.0, 6: 80.0},
        min_tokens=10,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processed_logits_equal_reference(name):
    logits = _logits(3, seed=hash(name) % 1000)
    rows = [_row(CASES[name]) for _ in range(3)]
    work = Sampler._apply_sequence_processors(logits, rows)
    for i, row in enumerate(rows):
        expected = _reference(logits[i], row)
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(work[i]), finite), name
        torch.testing.assert_close(work[i][finite].double(), expected[finite], atol=1e-5, rtol=1e-5)


def test_bad_word_cases_ban_what_they_should():
    """The reference itself, pinned: which ids each bad-word case bans after OUTPUT (ends 12, 13)."""
    logits = _logits(1, seed=3)

    def banned(name: str) -> set[int]:
        work = Sampler._apply_sequence_processors(logits, [_row(CASES[name])])[0]
        return set(torch.nonzero(torch.isinf(work)).flatten().tolist())

    assert banned("bad_single") == {8, 21}
    assert banned("bad_multi") == {25, 30}
    assert banned("bad_longer_than_output") == {7}
    assert banned("bad_shared_last_token") == {26}
    # A word whose other tokens are the whole output so far completes; one token longer cannot.
    exact = _params([[12, 13, 30], [11, 12, 13, 31]])
    work = Sampler._apply_sequence_processors(logits, [_row(exact, output=[12, 13])])[0]
    assert set(torch.nonzero(torch.isinf(work)).flatten().tolist()) == {30}
    # Matching is against the output only: the prompt does not complete a word.
    prompt_only = _params([[41, 11]])
    work = Sampler._apply_sequence_processors(logits, [_row(prompt_only, output=[])])[0]
    assert torch.isfinite(work).all()


def test_greedy_picks_obey_allowed_and_banned_ids():
    logits = _logits(6, seed=11)
    top = logits.argmax(-1).tolist()
    allowed = [3, 9, 27, 45]
    rows = [
        _row(_params(allowed_token_ids=allowed, temperature=0.0)),
        _row(_params([[top[1]]], temperature=0.0)),  # the argmax itself is a bad word
        _row(_params([[12, 13, top[2]]], temperature=0.0)),  # completes a word after OUTPUT's 12, 13
        _row(_params([[11, 13, top[3]]], temperature=0.0)),  # does not: argmax stays
        _row(_params(logit_bias={17: 100.0}, temperature=0.0)),
        _row(_params(logit_bias={top[5]: -100.0}, temperature=0.0)),
    ]
    out = Sampler()(logits, rows).token_ids
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    second = logits[1].clone()
    second[top[1]] = -math.inf
    assert out[1] == int(second.argmax()) != top[1]
    assert out[2] != top[2]
    assert out[3] == top[3]
    assert out[4] == 17
    assert out[5] != top[5]


@pytest.mark.parametrize("fused", [False, True])
def test_sampling_never_draws_a_disallowed_or_banned_id(fused):
    num = 300 if fused else 2000  # draws at once, one row each (the interpreter runs rows one by one)
    base = _logits(1, seed=21)
    hot = base.expand(num, VOCAB).contiguous()
    top = base[0].topk(4).indices.tolist()
    allowed = [top[0], top[1], 5, 6, 7]
    banned = [[top[0]], [13, top[2]]]  # the favourite token, and one completed after OUTPUT's 13
    rows = [_row(_params(banned, allowed_token_ids=allowed, temperature=1.5)) for _ in range(num)]
    tokens = Sampler(fused=fused)(hot, rows).token_ids
    assert set(tokens) <= set(allowed) - {top[0], top[2]}
    assert len(set(tokens)) > 1  # really sampling
    rows = [_row(_params(banned, temperature=3.0)) for _ in range(num)]
    tokens = Sampler(fused=fused)(hot, rows).token_ids
    assert top[0] not in tokens and top[2] not in tokens and len(set(tokens)) > 10


def test_logit_bias_sampling_frequencies_match_reference():
    torch.manual_seed(0)
    vocab, num = 8, 20000
    base = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(logit_bias={1: 1.5, 6: -2.0, 3: 0.75}, temperature=0.8)
    expected = base[0].clone().double()
    for t, b in params.logit_bias.items():
        expected[t] += b
    expected = (expected / 0.8).softmax(-1)
    tokens = Sampler()(base.expand(num, vocab).contiguous(), [_row(params, output=[]) for _ in range(num)])
    counts = torch.bincount(torch.tensor(tokens.token_ids), minlength=vocab).double()
    chi2 = (((counts - expected * num) ** 2) / (expected * num)).sum().item()
    assert chi2 < 40.0, (chi2, counts, expected * num)  # df = 7: p(chi2 > 40) < 1e-5


PLAIN = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(seed=5, temperature=0.9),
    SamplingParams(temperature=0.7, top_k=9),
]


def _plain_rows() -> list[SamplingRow]:
    return [
        _row(p, generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
        for p in PLAIN
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_rows_without_constraints_are_unchanged_by_rows_with_them(fused):
    constrained = [CASES["all"], CASES["bad_multi"], CASES["logit_bias"], CASES["allowed"]]
    plain_logits = _logits(len(PLAIN), seed=31)
    alone_rows = _plain_rows()
    alone_work = Sampler._apply_sequence_processors(plain_logits, alone_rows)
    torch.manual_seed(1)
    alone = Sampler(fused=fused)(plain_logits, alone_rows).token_ids
    # Interleave: plain rows at even positions, constrained ones between them.
    mixed_logits = torch.empty(2 * len(PLAIN), VOCAB)
    mixed_logits[0::2] = plain_logits
    mixed_logits[1::2] = _logits(len(constrained), seed=32)
    mixed_rows = []
    for plain, other in zip(_plain_rows(), constrained):
        mixed_rows += [plain, _row(other)]
    mixed_work = Sampler._apply_sequence_processors(mixed_logits, mixed_rows)
    assert torch.equal(mixed_work[0::2], alone_work)
    torch.manual_seed(1)
    mixed = Sampler(fused=fused)(mixed_logits, mixed_rows).token_ids
    # Greedy and seeded rows do not depend on the batch; the unseeded top-k row does (shared RNG).
    assert [mixed[2 * i] for i in range(3)] == alone[:3]
    for i, row in enumerate(mixed_rows[1::2]):
        expected = _reference(mixed_logits[2 * i + 1], row)
        assert torch.isfinite(expected[mixed[2 * i + 1]])


def test_unresolved_bad_words_are_an_error():
    row = _row(SamplingParams(bad_words=["hello"]))
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        Sampler()(_logits(1, seed=1), [row])


def test_metadata_is_empty_when_no_row_uses_a_constraint():
    md = metadata_from_rows(_plain_rows(), _logits(len(PLAIN), seed=1))
    assert md.allowed is None and md.bad_words is None and md.logit_bias is None


# ---- through the input batch: persistent rows, tokens from the device table ---------------------


def _request(rid: str, params: SamplingParams, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), params, max_tokens=32, eos_token_ids=(2,))


def _schedule(requests: list[Request], first: bool) -> SchedulerOutput:
    items = []
    for r in requests:
        n = len(r.prompt_token_ids) if first else 1
        r.num_computed_tokens += n
        items.append(ScheduledRequest(r, n, [0, 1, 2, 3]))
    return SchedulerOutput(items)


def test_input_batch_metadata_equals_the_list_based_one_over_steps():
    """Three decode steps of a batch mixing constrained and plain rows: each step's processed logits
    from the input batch's metadata equal those from the list interface given the same outputs."""
    params = [
        PLAIN[0],
        CASES["all"],
        PLAIN[1],
        _params([[7, 9], [9, 11], [11], [5, 7, 9, 13]], logit_bias={9: 4.0, 13: 1.0}),
        CASES["allowed"],
    ]
    requests = [_request(f"r{i}", p, PROMPT) for i, p in enumerate(params)]
    b = InputBatch(8, 64, 48, 4, VOCAB, torch.device("cpu"))
    forced = [[7, 9, 11], [6, 22, 7], [3, 3, 3], [7, 9, 13], [5, 5, 17]]  # what each row "samples"
    for step in range(3):
        inputs = b.prepare(_schedule(requests, first=step == 0))
        logits = _logits(len(requests), seed=40 + step)
        got = apply_sequence_processors(logits, inputs.sampling_metadata)
        rows = [
            _row(r.sampling_params, output=r.output_token_ids, prompt=r.prompt_token_ids) for r in requests
        ]
        expected = Sampler._apply_sequence_processors(logits, rows)
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), step
        torch.testing.assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)])
        sampled = torch.tensor([f[step] for f in forced])
        b.record_sampled_on_device(sampled)
        for r, t in zip(requests, sampled.tolist()):
            r.append_output_token(t)
    md = inputs.sampling_metadata
    assert md.bad_words is not None and md.logit_bias is not None and md.allowed is not None
    assert md.allowed.rows.tolist() == [1, 4]


def test_input_batch_rows_without_constraints_cost_nothing():
    b = InputBatch(8, 64, 48, 4, VOCAB, torch.device("cpu"))
    requests = [_request(f"p{i}", p, PROMPT) for i, p in enumerate(PLAIN)]
    md = b.prepare(_schedule(requests, first=True)).sampling_metadata
    assert md.allowed is None and md.bad_words is None and md.logit_bias is None
    assert b._disallowed is None  # the [rows, V] mask is only allocated for allowed_token_ids


def test_input_batch_reuses_a_row_without_its_old_constraints():
    b = InputBatch(2, 64, 48, 4, VOCAB, torch.device("cpu"))
    old = _request("old", _params([[5]], allowed_token_ids=[1, 2], logit_bias={3: 1.0}), PROMPT)
    b.prepare(_schedule([old], first=True))
    new = _request("new", SamplingParams(), PROMPT)
    step = _schedule([new], first=True)
    step.finished_req_ids = {"old"}
    md = b.prepare(step).sampling_metadata
    assert b.states["new"].row == 0 == np.flatnonzero(~b.has_allowed_token_ids).min()
    assert md.allowed is None and md.bad_words is None and md.logit_bias is None


class _Tokenizer:
    """encode() from a fixed table, as a tokenizer would split these strings."""

    TABLE = {
        "hello": [10],
        " hello": [11],
        "new york": [20, 21],
        " new york": [22, 21],
        "the": [30, 31],
        " the": [32],
    }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.TABLE.get(text, [])


def test_bad_words_are_tokenized_as_vllm_does():
    tokenizer = _Tokenizer()
    # Alone, and with a leading space when that is another first token and as many tokens.
    assert bad_words_token_ids(tokenizer, ["hello"]) == [[10], [11]]
    assert bad_words_token_ids(tokenizer, ["  new york"]) == [[20, 21], [22, 21]]
    assert bad_words_token_ids(tokenizer, ["the"]) == [[30, 31]]  # " the" is one token: not added
    with pytest.raises(ValueError, match="bad_words=\\['zzz'\\] is not valid"):
        bad_words_token_ids(tokenizer, ["zzz"])
