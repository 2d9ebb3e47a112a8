"""The engine's side of speculative decoding: who may speculate, drafts in, verification results out.

After each step the engine hands the step's result here: every verified request's rejected drafts
are rolled back in the scheduler (their KV positions count as not computed again), the acceptance
counts are tallied under vLLM's metric names, and the next drafts are proposed for the requests
that will decode next (n-gram lookup over their tokens, on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvllm.config.speculative import SpeculativeConfig
from kvllm.core.request import Request
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.scheduler import Scheduler
from kvllm.core.step_result import StepResult
from kvllm.spec_decode.ngram import NgramProposer


@dataclass(frozen=True)
class SpecDecodeCounts:
    """A snapshot of SpecDecodingStats (in EngineStats)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]


@dataclass
class SpecDecodingStats:
    """Cumulative acceptance counts: vllm:spec_decode_num_drafts, _num_draft_tokens,
    _num_accepted_tokens and _num_accepted_tokens_per_pos (entry j: drafts accepted at position j)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def snapshot(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.num_accepted_tokens_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens may be drafted. Verification samples each draft position
    from the target's temperature / top-k / top-p / min-p distribution; the features whose logits
    depend on the tokens before each position (penalties, bad words, min_tokens suppression, a
    grammar's token mask) or that report per-token logprobs are served one token per step instead."""
    p = request.sampling_params
    return (
        p.logprobs is None
        and p.structured_outputs is None
        and not p.has_penalties
        and not p.bad_words
        and not p.logit_bias
        and p.allowed_token_ids is None
        and request.num_output_tokens >= p.min_tokens
    )


class SpecDecodeCoordinator:
    """Proposes host-side drafts and applies verification results (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.proposer = None
        if config.method == "ngram":
            self.proposer = NgramProposer(
                config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
            )

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats(self.config.num_speculative_tokens)

    def max_drafts(self, request: Request) -> int:
        """Drafts worth verifying: each emits one token more than it accepts, so never past max_tokens,
        and their positions stay inside max_model_len."""
        return min(
            self.config.num_speculative_tokens,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )

    def after_step(self, plan: SchedulerOutput, result: StepResult, scheduler: Scheduler) -> None:
        """Roll back rejected drafts, count acceptance, and propose the next drafts."""
        for index, run in result.spec_token_ids.items():
            item = plan.scheduled[index]
            num_accepted = len(run) - 1
            self.stats.observe(len(item.spec_token_ids), num_accepted)
            scheduler.reject_drafts(item.request, len(item.spec_token_ids) - num_accepted)
        for index, item in enumerate(plan.scheduled):
            request = item.request
            if request.finish_reason is not None or request.num_computed_tokens != request.num_tokens - 1:
                continue  # finished, or a prompt still being prefilled
            k = self.max_drafts(request)
            if k <= 0 or not can_speculate(request):
                continue
            if self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(request.all_token_ids, k)
            else:  # the draft model's, proposed by the worker at the end of the step
                request.spec_token_ids = result.draft_token_ids.get(index, [])[:k]
