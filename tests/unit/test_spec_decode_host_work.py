"""The host work serialised behind each verification step, pinned by counted work (never by time).

Speculation schedules without overlap, so whatever the host does between a verification's result
and the next launch adds to every step: the n-gram lookup's scan of the context and the reads of
device results are counted here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvllm.spec_decode.ngram import NgramProposer


def reference_propose(p: NgramProposer, token_ids: list[int], max_drafts: int | None) -> list[int]:
    """The lookup by its definition: every window of each n, longest n first."""
    k = p.k if max_drafts is None else min(p.k, max_drafts)
    num = len(token_ids)
    if k <= 0 or num <= p.min_n:
        return []
    for n in range(min(p.max_n, num - 1), p.min_n - 1, -1):
        suffix = token_ids[num - n :]
        ends = [e for e in range(n, num) if token_ids[e - n : e] == suffix]
        if ends:
            full = [e for e in ends if e <= num - k]
            start = full[-1] if full else ends[0]
            return token_ids[start : start + k]
    return []


def test_ngram_lookup_matches_its_definition():
    rng = random.Random(0)
    for _ in range(3000):
        min_n = rng.randint(1, 3)
        p = NgramProposer(min_n, rng.randint(min_n, 5), rng.randint(1, 5))
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        max_drafts = rng.choice([None, rng.randint(0, 5)])
        assert p.propose(tokens, max_drafts) == reference_propose(p, tokens, max_drafts), (tokens, max_drafts)


@pytest.mark.parametrize("repeats", [8, 32])
def test_ngram_lookup_scans_the_context_once(repeats):
    """One compare per context token, plus the candidates' backward extension: on the benchmark's
    repetitive prompt (a 64-token run repeated) at most 3 extra compares per occurrence of the last
    token, where comparing every window of n = 4..1 costs 10 per token."""
    rng = random.Random(1)
    run = [rng.randrange(3, 100000) for _ in range(64)]
    tokens = run * repeats + run[:5]
    p = NgramProposer(1, 4, 3)
    assert p.propose(tokens) == run[5:8]
    num = len(tokens)
    occurrences = int((np.asarray(tokens[:-1]) == tokens[-1]).sum())
    assert p.num_compared <= (num - 1) + 3 * occurrences
    assert p.num_compared < 1.1 * num
