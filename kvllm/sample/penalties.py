"""Logits processors that depend on a sequence's tokens: min_tokens suppression and penalties.

All work on a [n, V] float32 logits tensor, vectorised over rows; token ids are counted with one
scatter_add into [n, V + 1] (the extra column absorbs padding and ids outside the logits' vocab).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvllm.sample.metadata import PenaltyInputs


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[n, vocab_size] float32 counts of each token id in each row's list (float: used in arithmetic)."""
    num_rows = len(token_lists)
    lengths = [len(tokens) for tokens in token_lists]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    total = sum(lengths)
    if total == 0:
        return counts[:, :vocab_size]
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64)
    flat = torch.where((flat >= 0) & (flat < vocab_size), flat, vocab_size)
    rows = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths))
    flat_index = (rows * (vocab_size + 1) + flat).to(device)
    counts.view(-1).scatter_add_(
        0, flat_index, torch.ones(flat_index.shape, dtype=torch.float32, device=device)
    )
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """Penalise `logits` ([P, V] float32, the penalised rows; may be modified in place: use the result).

    Repetition (HF/vLLM semantics) applies to tokens seen in the prompt or the output: positive
    logits are divided by the penalty, negative ones multiplied. Frequency subtracts
    penalty * count and presence subtracts penalty * (count > 0), over output tokens only. Which
    penalties are active is host-known (`penalties.any_*`), so nothing here reads the device.
    """
    prompt_counts, output_counts = penalties.token_counts(logits.shape[-1])
    if penalties.any_repetition:
        seen = (prompt_counts + output_counts) > 0
        penalty = penalties.repetition.unsqueeze(1)
        # Divide (not multiply by the reciprocal) so results match HF/vLLM bit for bit.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if penalties.any_frequency:
        logits.sub_(output_counts * penalties.frequency.unsqueeze(1))
    if penalties.any_presence:
        logits.sub_((output_counts > 0) * penalties.presence.unsqueeze(1))
    return logits


def suppress_tokens(logits: torch.Tensor, token_ids_per_row: Sequence[tuple[int, Sequence[int]]]) -> None:
    """Set logits[row, token] = -inf in place for each (row, tokens) pair (ids outside V ignored)."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in token_ids_per_row:
        for token_id in token_ids:
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
