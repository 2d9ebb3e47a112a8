"""Request outputs with vLLM's class and field names, and the Logprob entries they carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PositionLogprobs",
    "RequestOutput",
    "decode_logprobs",
]


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


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    # "stop", "length", "abort", "error" (the engine could not run it) or None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it; with finish_reason "error", what went wrong.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step: cumulative, or only what is new
    (SamplingParams.output_kind DELTA), or once when it finishes (FINAL_ONLY).

    `metrics` (what the serving metrics are computed from; over the request's n sequences):
    time.monotonic() stamps `arrival_time`, `queued_time` (the scheduler took it),
    `first_scheduled_time`, `first_token_time` (earliest of the sequences) and `last_token_time`
    (latest), each present once reached; counts `num_cached_tokens` (prompt tokens found in the
    prefix cache), `num_generation_tokens` (so far, all sequences, whatever the output kind),
    `max_num_generation_tokens` (the longest sequence) and `max_tokens` (resolved, per sequence).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top candidates
    # given the tokens before it (None for the first token, which nothing predicts).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's attribute)."""
        return int(self.metrics.get("num_cached_tokens", 0))


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt: a float32 tensor on the CPU [hidden_size or dimensions]."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (vLLM's class): `outputs.data` is the pooled tensor."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    prompt: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return 0


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's class): `outputs.embedding` is a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.num_cached_tokens,
            output.finished,
        )
