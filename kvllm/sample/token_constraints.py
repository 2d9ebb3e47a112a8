"""Logits processors set by a request's token constraints: allowed_token_ids, bad_words, logit_bias.

Each works in place on a [N, V] float32 logits tensor and enqueues device work only: which rows and
entries take part is decided on the host from the requests' parameters, and the one data-dependent
choice (does a bad word's prefix match the output?) is made on the device. The builders below turn
host-side lists into the inputs (`kvllm.sample.metadata`); the input batch and the list-based
sampler interface both use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvllm.sample.metadata import AllowedTokenInputs, BadWordInputs, LogitBiasInputs

_NO_TOKEN = -1  # padding in bad-word prefixes: matches any token


def apply_allowed_token_ids(logits: torch.Tensor, allowed: AllowedTokenInputs) -> None:
    """-inf for every token a row's allowed_token_ids leaves out."""
    if allowed.rows is None:
        logits.masked_fill_(allowed.disallowed, float("-inf"))
        return
    subset = logits.index_select(0, allowed.rows).masked_fill_(allowed.disallowed, float("-inf"))
    logits.index_copy_(0, allowed.rows, subset)


def apply_bad_words(logits: torch.Tensor, bad: BadWordInputs) -> None:
    """-inf for each bad word's last token where the row's output ends with the word's other tokens."""
    matches = ((bad.recent == bad.prefixes) | (bad.prefixes == _NO_TOKEN)).all(dim=-1)
    # Accumulated, so entries that share (row, token) (two words ending alike) cannot overwrite each
    # other: a matching one adds -inf, the others add 0.
    penalty = torch.where(matches, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((bad.rows, bad.last_token_ids), penalty, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBiasInputs) -> None:
    """logits[row, token] += bias for every (row, token, bias) entry."""
    logits.index_put_((bias.rows, bias.token_ids), bias.biases.to(logits.dtype), accumulate=True)


# ---- builders from host-side values ---------------------------------------------------------------


def allowed_token_mask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """bool [V] on the host: True for the tokens `token_ids` leaves out (ids are checked upstream)."""
    mask = torch.ones(vocab_size, dtype=torch.bool)
    mask[torch.tensor(list(token_ids), dtype=torch.int64)] = False
    return mask


def logit_bias_arrays(logit_bias: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, biases float32) of one request's logit_bias, computed once when it joins."""
    return (
        np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias)),
        np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias)),
    )


def logit_bias_inputs(
    entries: Sequence[tuple[int, tuple[np.ndarray, np.ndarray]]], device: torch.device
) -> LogitBiasInputs:
    """LogitBiasInputs from (step row, (token ids, biases)) per biased row."""
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, (ids, _) in entries])
    ids = np.concatenate([ids for _, (ids, _) in entries])
    biases = np.concatenate([values for _, (_, values) in entries])

    def upload(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device, non_blocking=True)

    return LogitBiasInputs(upload(rows), upload(ids), upload(biases))


@dataclass
class BadWordTable:
    """The host half of BadWordInputs: the entries that could complete this step, before `recent`."""

    rows: np.ndarray  # int64 [W]: step row of each entry
    sources: np.ndarray  # int64 [W]: which input of `bad_word_table` the entry came from
    last_token_ids: np.ndarray  # int64 [W]
    prefixes: np.ndarray  # int64 [W, L], right-aligned, -1 on the left

    @property
    def width(self) -> int:
        return self.prefixes.shape[1]

    def inputs(self, recent: torch.Tensor, device: torch.device) -> BadWordInputs:
        def upload(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device, non_blocking=True)

        return BadWordInputs(upload(self.rows), upload(self.last_token_ids), upload(self.prefixes), recent)


def bad_word_table(
    rows: Sequence[tuple[int, Sequence[Sequence[int]], int]],
) -> BadWordTable | None:
    """The entries of (step row, its bad words' token ids, its number of output tokens) per row.

    A word whose other tokens outnumber the output so far cannot complete this step and is left out
    (vLLM matches against the output only, never the prompt). None when no entry is left.
    """
    kept: list[tuple[int, int, Sequence[int]]] = []
    for source, (row, words, num_output) in enumerate(rows):
        kept.extend((row, source, word) for word in words if len(word) - 1 <= num_output)
    if not kept:
        return None
    width = max(len(word) for _, _, word in kept) - 1
    prefixes = np.full((len(kept), width), _NO_TOKEN, dtype=np.int64)
    for i, (_, _, word) in enumerate(kept):
        if len(word) > 1:
            prefixes[i, width - len(word) + 1 :] = word[:-1]
    return BadWordTable(
        rows=np.array([row for row, _, _ in kept], dtype=np.int64),
        sources=np.array([source for _, source, _ in kept], dtype=np.int64),
        last_token_ids=np.array([word[-1] for _, _, word in kept], dtype=np.int64),
        prefixes=prefixes,
    )


def recent_from_lists(table: BadWordTable, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """int64 [W, L] on the host: each entry's last L output tokens, from per-source output lists."""
    width = table.width
    recent = np.full((len(table.rows), width), _NO_TOKEN, dtype=np.int64)
    if width:
        for i, source in enumerate(table.sources.tolist()):
            tail = list(outputs[source])[-width:]
            if tail:
                recent[i, width - len(tail) :] = tail
    return torch.from_numpy(recent)
