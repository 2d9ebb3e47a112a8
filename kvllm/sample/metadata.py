"""SamplingMetadata: one step's sampling inputs as device tensors, plus what the host already knows.

Every decision that would otherwise need a device-to-host read (is any row random? the largest top-k?
does any row use top-p?) is taken from the host's copy of the requests' parameters, so the sampler
never synchronises with the device. Per-row tensors live on the logits' device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvllm.sample.structured import GrammarBitmaskInputs
from kvllm.sampling_params import SamplingParams


@dataclass
class PenaltyInputs:
    """Penalties for a subset of rows: `rows` (None = every row) and their per-row penalty values.

    `token_counts()` returns (prompt_counts, output_counts), each float32 [len(rows), vocab]: how often
    each token id occurs in the row's prompt and in its output so far. It is a callable so the tensors
    are built only when a penalised row is sampled, from wherever the caller keeps the tokens.
    """

    rows: torch.Tensor | None  # int64 [P] on the device, or None for all rows
    repetition: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    any_repetition: bool
    any_frequency: bool
    any_presence: bool
    token_counts: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AllowedTokenInputs:
    """allowed_token_ids of a subset of rows: `rows` (None = every row) and what they may not sample."""

    rows: torch.Tensor | None  # int64 [A] on the device, or None for all rows
    disallowed: torch.Tensor  # bool [A, V]: True where the token may not be sampled


@dataclass
class BadWordInputs:
    """One entry per (row, bad word) that could complete this step (its other tokens fit in the output).

    The entry bans `last_token_ids` when the row's last L tokens (`recent`) equal `prefixes` wherever
    `prefixes` is not -1 (words are right-aligned, shorter ones padded with -1 on the left; a word of
    one token is all padding, so it is always banned).
    """

    rows: torch.Tensor  # int64 [W]
    last_token_ids: torch.Tensor  # int64 [W]
    prefixes: torch.Tensor  # int64 [W, L]
    recent: torch.Tensor  # int64 [W, L]: the row's last L tokens (anything where prefixes is -1)


@dataclass
class LogitBiasInputs:
    """logit_bias of every row that has one, flattened: logits[rows[k], token_ids[k]] += biases[k]."""

    rows: torch.Tensor  # int64 [K]
    token_ids: torch.Tensor  # int64 [K]
    biases: torch.Tensor  # float32 [K]


@dataclass
class SamplingMetadata:
    """Sampling inputs of N rows. Tensors are None where no row needs them (a host-known fact)."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # bool [N]; only for batches mixing greedy and random rows
    temperature: torch.Tensor | None  # float32 [N] (1.0 on greedy rows); None when all rows are 1.0/greedy
    top_k: torch.Tensor | None  # int64 [N] in [1, V], V = disabled; None when no row uses top-k
    max_top_k: int  # largest active top-k (host-known), 0 when top_k is None
    all_top_k: bool  # every row has an active top-k
    top_p: torch.Tensor | None  # float32 [N], 1.0 = disabled
    min_p: torch.Tensor | None  # float32 [N], 0.0 = disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its seeded generator
    penalties: PenaltyInputs | None = None
    suppressed: list[tuple[int, Sequence[int]]] = field(default_factory=list)  # min_tokens: row -> ids
    allowed: AllowedTokenInputs | None = None
    bad_words: BadWordInputs | None = None
    logit_bias: LogitBiasInputs | None = None
    num_logprobs: list[int | None] | None = None  # per row, None when no row asks for logprobs
    need_sampled_logprobs: bool = False  # the chosen tokens' raw logprobs (for cumulative_logprob)
    grammar: GrammarBitmaskInputs | None = None  # structured outputs: set by the runner before sampling

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device,
        vocab_size: int,
        *,
        generators: dict[int, torch.Generator] | None = None,
        penalties: PenaltyInputs | None = None,
        suppressed: list[tuple[int, Sequence[int]]] | None = None,
        allowed: AllowedTokenInputs | None = None,
        bad_words: BadWordInputs | None = None,
        logit_bias: LogitBiasInputs | None = None,
        need_sampled_logprobs: bool | None = None,
    ) -> SamplingMetadata:
        """Metadata for rows with these parameters; per-row tensors uploaded once each."""
        num_rows = len(params)
        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def upload(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        temperature = None
        if not all_greedy and any(not g and p.temperature != 1.0 for p, g in zip(params, greedy)):
            temperature = upload([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
        top_k = None
        max_top_k = 0
        all_top_k = False
        active_k = [0 < p.top_k < vocab_size and not g for p, g in zip(params, greedy)]
        if any(active_k):
            ks = [p.top_k if a else vocab_size for p, a in zip(params, active_k)]
            top_k = upload(ks, torch.int64)
            max_top_k = max(k for k, a in zip(ks, active_k) if a)
            all_top_k = all(active_k)
        top_p = None
        if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
            top_p = upload([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32)
        min_p = None
        if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
            min_p = upload([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)
        wants_logprobs = any(p.logprobs is not None for p in params)
        return cls(
            num_rows=num_rows,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else upload(greedy, torch.bool),
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            all_top_k=all_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators or {},
            penalties=penalties,
            suppressed=suppressed or [],
            allowed=allowed,
            bad_words=bad_words,
            logit_bias=logit_bias,
            num_logprobs=[p.logprobs for p in params] if wants_logprobs else None,
            need_sampled_logprobs=wants_logprobs if need_sampled_logprobs is None else need_sampled_logprobs,
        )


def penalty_inputs(
    params: Sequence[SamplingParams],
    rows: list[int],
    num_rows: int,
    device: torch.device,
    token_counts: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> PenaltyInputs:
    """PenaltyInputs for `rows` (indices into `params`); `rows` covering every row becomes None."""
    chosen = [params[i] for i in rows]

    def upload(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    return PenaltyInputs(
        rows=None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.int64).to(device),
        repetition=upload([p.repetition_penalty for p in chosen]),
        frequency=upload([p.frequency_penalty for p in chosen]),
        presence=upload([p.presence_penalty for p in chosen]),
        any_repetition=any(p.repetition_penalty != 1.0 for p in chosen),
        any_frequency=any(p.frequency_penalty != 0.0 for p in chosen),
        any_presence=any(p.presence_penalty != 0.0 for p in chosen),
        token_counts=token_counts,
    )
