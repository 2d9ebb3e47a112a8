"""Logprobs of chosen tokens and top candidates, from a step's log-probabilities (kvllm.outputs.Logprob)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvllm.outputs import Logprob, PositionLogprobs


@dataclass
class LogprobTensors:
    """Device-side logprobs of N rows: the chosen tokens' values and ranks, and the top max_k."""

    chosen: torch.Tensor  # float32 [N]
    ranks: torch.Tensor  # int64 [N], 1 = the most likely token
    top_values: torch.Tensor  # float32 [N, max_k]
    top_ids: torch.Tensor  # int64 [N, max_k]


def logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, max_k: int) -> LogprobTensors:
    """From [N, V] log-probabilities and the chosen ids, without reading anything back."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)
    return LogprobTensors(chosen, ranks, top.values, top.indices)


def position_entry(
    token_id: int, logprob: float, rank: int, top_values: list[float], top_ids: list[int], k: int
) -> PositionLogprobs:
    """The chosen token's Logprob with its rank, plus the `k` most likely tokens (ranks from 1)."""
    entry = {token_id: Logprob(logprob, rank)}
    for r in range(min(k, len(top_values))):
        entry.setdefault(top_ids[r], Logprob(top_values[r], r + 1))
    return entry


def position_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[PositionLogprobs]:
    """Per row of `logprobs` ([N, V] log-probabilities): the chosen token's Logprob with its rank,
    plus the `ks[row]` most likely tokens (ranks from 1)."""
    t = logprob_tensors(logprobs, token_ids, max(ks, default=0))
    rows = zip(
        token_ids.tolist(), t.chosen.tolist(), t.ranks.tolist(), t.top_values.tolist(), t.top_ids.tolist(), ks
    )
    return [position_entry(*row) for row in rows]
