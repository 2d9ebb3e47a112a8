"""Logprob: the log probability of one candidate token, as reported to users (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """Log probability of a token under the raw model distribution.

    `rank` is 1 for the most likely token; `decoded_token` is filled in by the output side
    (see `decode_logprobs`), since the sampler has no tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: token id -> Logprob, or None when the request asked for no logprobs.
PositionLogprobs = dict[int, Logprob]


def decode_logprobs(tokenizer: Any, logprobs: PositionLogprobs) -> PositionLogprobs:
    """Fill `decoded_token` of each entry in place (ids outside the tokenizer decode to "")."""
    vocab_size = len(tokenizer)
    for token_id, entry in logprobs.items():
        if entry.decoded_token is None:
            entry.decoded_token = tokenizer.decode([token_id]) if 0 <= token_id < vocab_size else ""
    return logprobs
