"""StepResult: the one message back from the worker to the engine, once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvllm.outputs import PositionLogprobs
    from kvllm.sample.sampler import SamplerOutput

# Structured outputs: called by the worker between a step's forward pass and its sampling, with the
# positions in `scheduled` of the rows that sample; returns the packed allowed-token bits of those
# rows (int32 [rows, ceil(vocab / 32)] on the host, all bits set on unconstrained rows) or None, or a
# PendingMask: the masks are being filled elsewhere (the grammar process), and an in-process worker
# may then launch the step's sampling later (when the next step starts or the result is asked for).
PendingMask = Callable[[], "torch.Tensor | None"]
GrammarBitmaskFn = Callable[[list[int]], "torch.Tensor | PendingMask | None"]


@dataclass
class StepResult:
    """Sampled tokens of one step, for the requests that reached their last token."""

    request_indices: list[int]  # positions in the step's `scheduled` list
    sampler_output: SamplerOutput | None
    # scheduled index -> (prompt position of the first entry, logprobs of consecutive prompt tokens)
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # Pooling runner: scheduled index -> the embedding (float32, CPU) of each prompt that ended this step.
    pooled: dict[int, Any] = field(default_factory=dict)
    # Speculative decoding: scheduled index -> the tokens a request emits (its accepted drafts, then
    # the recovered or bonus token), replacing its one sampled token.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Drafts for the next step proposed by a draft model (scheduled index -> draft token ids).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)


class PendingStep(Protocol):
    """A launched step whose sampled tokens are on their way to the host."""

    def result(self) -> StepResult:
        """Wait for the step's tokens (on an event, not the whole device) and return them."""
        ...


class ResolvedStep:
    """A launched step whose result has been taken already (a PendingStep's result() is taken once)."""

    def __init__(self, step: StepResult) -> None:
        self.step = step

    def result(self) -> StepResult:
        return self.step
