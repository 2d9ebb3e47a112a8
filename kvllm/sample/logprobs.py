"""Logprobs of chosen tokens and top candidates, from a step's log-probabilities (kvllm.outputs.Logprob)."""

from __future__ import annotations

import torch

from kvllm.outputs import Logprob, PositionLogprobs


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
