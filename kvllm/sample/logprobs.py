"""Logprob: the log probability of one candidate token, as reported to users (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


def position_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[PositionLogprobs]:
    """Per row of `logprobs` ([N, V] log-probabilities): the chosen token's Logprob with its rank,
    plus the `ks[row]` most likely tokens (ranks from 1)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    max_k = min(max(ks, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, (token_id, value, rank, k) in enumerate(zip(token_ids.tolist(), chosen.tolist(), ranks, ks)):
        entry = {token_id: Logprob(value, rank)}
        for r in range(min(k, max_k)):
            entry.setdefault(top_ids[row][r], Logprob(top_values[row][r], r + 1))
        out.append(entry)
    return out
