"""Sampler: one token per row from [N, V] logits, with vLLM v1 semantics.

Order: min_tokens suppression -> penalties -> greedy rows take argmax -> temperature -> top-k ->
top-p -> min-p -> sample. Reported logprobs (and ranks) come from the raw logits, before any
processing. Random rows sample by an exponential race (argmax of p / E with E ~ Exp(1)), which is
exact and needs no sorting; a seeded row draws its own E from its generator, V values per step, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvllm.outputs import PositionLogprobs
from kvllm.sample.logprobs import position_logprobs
from kvllm.sample.penalties import apply_penalties, suppress_tokens
from kvllm.sample.topk_topp import apply_min_p, apply_top_k_top_p
from kvllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample a token for.

    `generator` is the request's own generator when `params.seed` is set (the engine creates it
    once: `torch.Generator(device=logits.device).manual_seed(seed)` and keeps it across steps);
    None uses the default RNG. `eos_token_ids` (unless `params.ignore_eos`) and
    `params.stop_token_ids` are suppressed while len(output_token_ids) < params.min_tokens.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """Per row: the token, its raw logprob, and the requested top logprobs (or None)."""

    token_ids: list[int]
    sampled_logprobs: list[float]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Turns logits into tokens for a batch of rows; stateless (generators live in the rows)."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        raw = logits.float()
        work = self._apply_sequence_processors(raw, rows)

        token_ids = work.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            if len(random_rows) == len(rows):
                token_ids = self._draw(self._random_probs(work, rows), rows)
            else:
                index = torch.tensor(random_rows, device=raw.device)
                subset_rows = [rows[i] for i in random_rows]
                sampled = self._draw(self._random_probs(work[index], subset_rows), subset_rows)
                token_ids = token_ids.index_copy(0, index, sampled)

        want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if want_logprobs:
            raw_logprobs = raw.log_softmax(dim=-1)
            sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        else:
            sampled_logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - raw.logsumexp(dim=-1)
        out_logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if want_logprobs:
            self._fill_logprobs(out_logprobs, raw_logprobs, token_ids, rows, want_logprobs)
        return SamplerOutput(
            token_ids=token_ids.tolist(), sampled_logprobs=sampled_logprobs.tolist(), logprobs=out_logprobs
        )

    @staticmethod
    def _apply_sequence_processors(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """min_tokens suppression and penalties; returns `raw` itself when no row needs either."""
        suppress = [
            (i, [*(() if row.params.ignore_eos else row.eos_token_ids), *row.params.stop_token_ids])
            for i, row in enumerate(rows)
            if len(row.output_token_ids) < row.params.min_tokens
        ]
        penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if not suppress and not penalised:
            return raw
        work = raw.clone()
        suppress_tokens(work, suppress)
        if penalised:
            device = raw.device
            params = [rows[i].params for i in penalised]
            subset = work if len(penalised) == len(rows) else work[penalised]
            subset = apply_penalties(
                subset,
                [rows[i].prompt_token_ids for i in penalised],
                [rows[i].output_token_ids for i in penalised],
                torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
                torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
                torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
            )
            if len(penalised) == len(rows):
                work = subset
            else:
                work[penalised] = subset
        return work

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[N, V] distribution each row's token is drawn from (one-hot at the argmax for greedy rows).

        For tests and debugging; `__call__` computes the same thing without materialising greedy rows.
        """
        work = self._apply_sequence_processors(logits.float(), rows)
        probs = torch.zeros_like(work).scatter_(1, work.argmax(dim=-1, keepdim=True), 1.0)
        for i, row in enumerate(rows):
            if not row.params.is_greedy:
                probs[i] = self._random_probs(work[i : i + 1], [row])[0]
        return probs

    @staticmethod
    def _random_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, then softmax: the distribution to sample from."""
        device = logits.device
        vocab_size = logits.shape[-1]
        params = [row.params for row in rows]
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            logits = logits / torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1)
        top_k = None
        if any(0 < p.top_k < vocab_size for p in params):
            values = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_k = torch.tensor(values, dtype=torch.int64, device=device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(
                logits, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            )
        return logits.softmax(dim=-1)

    @staticmethod
    def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row by exponential race; seeded rows draw their noise from their generator."""
        # E = -log(U) with U ~ U[0, 1) is Exp(1) and never 0, so p / E is never 0 / 0 (masked
        # tokens stay at 0); uniform_ + log is several times faster than exponential_ on CPU.
        noise = torch.empty_like(probs)
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if len(seeded) < len(rows):
            noise.uniform_()
        for i in seeded:
            noise[i].uniform_(generator=rows[i].generator)
        return (probs / noise.log_().neg_()).argmax(dim=-1)

    @staticmethod
    def _fill_logprobs(
        out: list[PositionLogprobs | None],
        raw_logprobs: torch.Tensor,
        token_ids: torch.Tensor,
        rows: list[SamplingRow],
        wanted: list[int],
    ) -> None:
        index = torch.tensor(wanted, device=raw_logprobs.device)
        ks = [rows[i].params.logprobs or 0 for i in wanted]
        for i, entry in zip(wanted, position_logprobs(raw_logprobs[index], token_ids[index], ks)):
            out[i] = entry
