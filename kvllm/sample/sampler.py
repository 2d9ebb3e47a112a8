"""Sampler: one token per row from [N, V] logits, with vLLM v1 semantics, without host reads.

Order (vLLM v1's): allowed_token_ids -> bad_words -> min_tokens suppression -> logit_bias ->
penalties -> greedy rows take argmax -> temperature -> top-k ->
top-p -> min-p -> sample. Reported logprobs (and ranks) come from the raw logits, before any
processing. Random rows sample by an exponential race (argmax of p / E with E ~ Exp(1)), which is
exact and needs no sorting; a seeded row draws its own E from its generator, V values per step, so
its tokens do not depend on what else is in the batch.

Every branch is decided by `SamplingMetadata`'s host-known flags, so sampling enqueues device work
only; the one device-to-host copy happens in `SampledTokens.to_host`, after everything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvllm.outputs import PositionLogprobs
from kvllm.sample.logprobs import logprob_tensors, position_entry
from kvllm.sample.metadata import AllowedTokenInputs, SamplingMetadata, penalty_inputs
from kvllm.sample.penalties import apply_penalties, suppress_tokens, token_counts
from kvllm.sample.structured import apply_grammar_bitmask
from kvllm.sample.token_constraints import (
    allowed_token_mask,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    bad_word_table,
    logit_bias_arrays,
    logit_bias_inputs,
    recent_from_lists,
)
from kvllm.sample.topk_topp import apply_min_p, apply_top_k_top_p
from kvllm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample a token for (the list-based interface, used by tests and tools).

    `generator` is the request's own generator when `params.seed` is set; None uses the default
    RNG. `eos_token_ids` (unless `params.ignore_eos`) and `params.stop_token_ids` are suppressed
    while len(output_token_ids) < params.min_tokens. `params.bad_words` need their token ids
    (`params.bad_words_token_ids`, set by the engine's input processor).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """Per row, on the host: the token, its raw logprob (or None), the requested top logprobs (or None)."""

    token_ids: list[int]
    sampled_logprobs: list[float] | None
    logprobs: list[PositionLogprobs | None]


@dataclass
class SampledTokens:
    """A step's sampling result still on the device; `to_host` copies it back in one go."""

    token_ids: torch.Tensor  # int64 [N]
    sampled_logprobs: torch.Tensor | None  # float32 [N]
    # Only when some row asked for logprobs: rank of the sampled token, and the top max_k values/ids.
    ranks: torch.Tensor | None = None  # int64 [N]
    top_values: torch.Tensor | None = None  # float32 [N, max_k]
    top_ids: torch.Tensor | None = None  # int64 [N, max_k]
    num_logprobs: list[int | None] | None = None

    def to_host(self) -> SamplerOutput:
        """Copy to the host and wait for it (see `copy_to_host` for the non-blocking half)."""
        return self.copy_to_host().wait()

    def copy_to_host(self) -> HostCopy:
        """Start the copies into pinned host memory without blocking; `wait()` on the result."""
        tensors = [
            t
            for t in (self.token_ids, self.sampled_logprobs, self.ranks, self.top_values, self.top_ids)
            if t is not None
        ]
        event = None
        if self.token_ids.device.type == "cuda":
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for dst, src in zip(host, tensors):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            tensors = host
        return HostCopy(self, tensors, event)


@dataclass
class HostCopy:
    """Sampled results on their way to the host: `wait()` blocks on an event, not on the stream."""

    sampled: SampledTokens
    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None

    def wait(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        it = iter(self.tensors)
        token_ids = next(it).tolist()
        sampled = next(it).tolist() if self.sampled.sampled_logprobs is not None else None
        logprobs: list[PositionLogprobs | None] = [None] * len(token_ids)
        num_logprobs = self.sampled.num_logprobs
        if self.sampled.ranks is not None and num_logprobs is not None:
            ranks, values, ids = next(it).tolist(), next(it).tolist(), next(it).tolist()
            assert sampled is not None  # computed whenever logprobs are
            for row, k in enumerate(num_logprobs):
                if k is not None:
                    logprobs[row] = position_entry(
                        token_ids[row], sampled[row], ranks[row], values[row], ids[row], k
                    )
        return SamplerOutput(token_ids=token_ids, sampled_logprobs=sampled, logprobs=logprobs)


class Sampler:
    """Turns logits into tokens for a batch of rows; stateless (generators live in the metadata).

    `fused`: sample rows that need no truncation and no per-request generator with one Triton pass
    over the logits (`gumbel.py`); None = on CUDA devices only (tests force it under the interpreter).
    """

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The list-based interface: every row's sampled logprob is reported, as before."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        return self.sample(logits, metadata_from_rows(rows, logits, need_sampled_logprobs=True)).to_host()

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SampledTokens:
        """Sample one token per row; enqueues device work only (no host reads)."""
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"logits must be [num_rows={md.num_rows}, vocab], got {tuple(logits.shape)}")
        # Structured outputs: the grammar's mask goes first, so logprobs are the constrained ones. A draw that
        # needs nothing else of the logits (the fused pass, no penalties, no logprobs) reads the mask itself.
        bitmask = None
        if md.grammar is not None:
            if self._fused_reads_mask(logits, md):
                bitmask = md.grammar.bitmask
            else:
                logits = apply_grammar_bitmask(logits, md.grammar)
        # Penalties and the torch path work in float32; the fused pass reads the model's dtype.
        needs_float = has_sequence_processors(md) or not self._can_fuse(logits, md)
        raw = logits.float() if needs_float else logits
        work = apply_sequence_processors(raw, md)
        if self._can_fuse(work, md):
            from kvllm.sample.gumbel import gumbel_sample

            # A fresh Philox seed per step from the host generator (seeded by the engine's seed).
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if not md.all_greedy else 0
            token_ids = gumbel_sample(
                work, md.temperature, md.is_greedy, seed, all_greedy=md.all_greedy, bitmask=bitmask
            )
        elif md.all_greedy:
            token_ids = work.argmax(dim=-1)
        else:
            token_ids = draw(random_probs(work, md), md)
            if md.is_greedy is not None:
                token_ids = torch.where(md.is_greedy, work.argmax(dim=-1), token_ids)
        out = SampledTokens(token_ids=token_ids, sampled_logprobs=None)
        if md.num_logprobs is not None or md.need_sampled_logprobs:
            raw = raw.float()  # only then: a float32 copy of [rows, vocab] costs a pass over the logits
        if md.num_logprobs is not None:
            t = logprob_tensors(raw.log_softmax(dim=-1), token_ids, max((k or 0) for k in md.num_logprobs))
            out.sampled_logprobs, out.ranks, out.top_values, out.top_ids = (
                t.chosen,
                t.ranks,
                t.top_values,
                t.top_ids,
            )
            out.num_logprobs = md.num_logprobs
        elif md.need_sampled_logprobs:
            out.sampled_logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - raw.logsumexp(dim=-1)
        return out

    def _fused_reads_mask(self, logits: torch.Tensor, md: SamplingMetadata) -> bool:
        """Whether the grammar's mask can be left to the fused pass: nothing before or after the draw
        reads the masked logits."""
        return (
            self._can_fuse(logits, md)
            and not has_sequence_processors(md)
            and md.num_logprobs is None
            and not md.need_sampled_logprobs
        )

    def _can_fuse(self, logits: torch.Tensor, md: SamplingMetadata) -> bool:
        enabled = logits.is_cuda if self.fused is None else self.fused
        return (
            enabled
            and md.top_k is None
            and md.top_p is None
            and md.min_p is None
            and not md.generators
            and logits.stride(-1) == 1
        )

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[N, V] distribution each row's token is drawn from (one-hot at the argmax for greedy rows).

        For tests and debugging; `sample` computes the same thing without materialising greedy rows.
        """
        md = metadata_from_rows(rows, logits)
        work = apply_sequence_processors(logits.float(), md)
        probs = torch.zeros_like(work).scatter_(1, work.argmax(dim=-1, keepdim=True), 1.0)
        for i, row in enumerate(rows):
            if not row.params.is_greedy:
                probs[i] = Sampler._random_probs(work[i : i + 1], [row])[0]
        return probs

    # Row-based views of the two processing stages (tests compare them with references).
    @staticmethod
    def _apply_sequence_processors(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return apply_sequence_processors(raw, metadata_from_rows(rows, raw))

    @staticmethod
    def _random_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return random_probs(logits, metadata_from_rows(rows, logits))


def metadata_from_rows(
    rows: list[SamplingRow], logits: torch.Tensor, need_sampled_logprobs: bool | None = None
) -> SamplingMetadata:
    """SamplingMetadata for list-based rows (token counts for penalties built from the lists)."""
    params = [row.params for row in rows]
    device, vocab_size = logits.device, logits.shape[-1]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    penalties = None
    if penalised:

        def counts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
            prompt = token_counts([rows[i].prompt_token_ids for i in penalised], vocab, device)
            output = token_counts([rows[i].output_token_ids for i in penalised], vocab, device)
            return prompt, output

        penalties = penalty_inputs(params, penalised, len(rows), device, counts)
    suppressed = [
        (i, [*(() if row.params.ignore_eos else row.eos_token_ids), *row.params.stop_token_ids])
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
    ]
    allowed = None
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if restricted:
        masks = [allowed_token_mask(params[i].allowed_token_ids or [], vocab_size) for i in restricted]
        allowed = AllowedTokenInputs(
            rows=None if len(restricted) == len(rows) else torch.tensor(restricted, device=device),
            disallowed=torch.stack(masks).to(device),
        )
    bad_words = None
    banning = [i for i, p in enumerate(params) if p.bad_words]
    if banning:
        for i in banning:
            if params[i].bad_words_token_ids is None:
                raise ValueError(
                    f"bad_words={params[i].bad_words!r} have not been tokenized: the engine's input "
                    "processor sets bad_words_token_ids"
                )
        table = bad_word_table(
            [(i, params[i].bad_words_token_ids or [], len(rows[i].output_token_ids)) for i in banning]
        )
        if table is not None:
            recent = recent_from_lists(table, [rows[i].output_token_ids for i in banning])
            bad_words = table.inputs(recent.to(device), device)
    biased = [(i, logit_bias_arrays(p.logit_bias)) for i, p in enumerate(params) if p.logit_bias]
    return SamplingMetadata.from_params(
        params,
        device,
        vocab_size,
        # A greedy row ignores the noise: its generator is not drawn from (as in the input batch).
        generators={
            i: row.generator
            for i, row in enumerate(rows)
            if row.generator is not None and not row.params.is_greedy
        },
        penalties=penalties,
        suppressed=suppressed,
        allowed=allowed,
        bad_words=bad_words,
        logit_bias=logit_bias_inputs(biased, device) if biased else None,
        need_sampled_logprobs=need_sampled_logprobs,
    )


def has_sequence_processors(md: SamplingMetadata) -> bool:
    """Whether some row's logits are changed before sampling (host-known)."""
    return (
        bool(md.suppressed)
        or md.penalties is not None
        or md.allowed is not None
        or md.bad_words is not None
        or md.logit_bias is not None
    )


def apply_sequence_processors(raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token constraints, min_tokens suppression and penalties, in vLLM's order; returns `raw` itself
    when no row needs any."""
    if not has_sequence_processors(md):
        return raw
    work = raw.clone()
    if md.allowed is not None:
        apply_allowed_token_ids(work, md.allowed)
    if md.bad_words is not None:
        apply_bad_words(work, md.bad_words)
    suppress_tokens(work, md.suppressed)
    if md.logit_bias is not None:
        apply_logit_bias(work, md.logit_bias)
    pen = md.penalties
    if pen is not None:
        subset = work if pen.rows is None else work.index_select(0, pen.rows)
        subset = apply_penalties(subset, pen)
        if pen.rows is None:
            work = subset
        else:
            work.index_copy_(0, pen.rows, subset)
    return work


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then softmax: the distribution to sample from."""
    if md.temperature is not None:
        logits = logits / md.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k, md.all_top_k)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One token per row by exponential race; seeded rows draw their noise from their generator."""
    # E = -log(U) with U ~ U[0, 1) is Exp(1) and never 0, so p / E is never 0 / 0 (masked tokens
    # stay at 0); uniform_ + log is several times faster than exponential_ on CPU.
    noise = torch.empty_like(probs)
    if len(md.generators) < md.num_rows:
        noise.uniform_()
    for i, generator in md.generators.items():
        noise[i].uniform_(generator=generator)
    return (probs / noise.log_().neg_()).argmax(dim=-1)
