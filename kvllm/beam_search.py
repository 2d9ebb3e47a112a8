"""Beam search on top of generate (vLLM's LLM.beam_search algorithm and output types).

Each step runs every live beam of every prompt as a one-token `generate` request asking for the top
2 * beam_width logprobs (as HF transformers and vLLM do); each beam grows into one candidate per
returned token, a candidate ending in EOS (unless ignore_eos) is set aside as completed, and the
beam_width best of the rest by `get_beam_search_score` live on. After max_tokens steps (or when no
beam is left) the completed and live beams are ranked together and the best beam_width returned.
The beams of a prompt share their prefix, so the prefix cache makes each step cost one new token per
beam, not a whole prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvllm.outputs import Logprob, RequestOutput
from kvllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (prompt included), the logprobs of each step and their sum; `text` (the
    tokens decoded, prompt included, as vLLM's) is filled in when it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The search state of one prompt: its live beams and the completed ones.

    A step: `retire_full(max_model_len)`, run each of `beams` as a one-token request with
    `step_params(params)`, then `advance(those requests' outputs, ...)`; at the end `best(...)`.
    """

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence(tokens=list(prompt_tokens))]
        self.completed: list[BeamSearchSequence] = []

    def retire_full(self, max_model_len: int) -> None:
        """A beam at max_model_len cannot grow: it ends (with "length")."""
        self.completed += [b for b in self.beams if len(b.tokens) >= max_model_len]
        self.beams = [b for b in self.beams if len(b.tokens) < max_model_len]

    def advance(
        self,
        outputs: Sequence[RequestOutput],
        params: BeamSearchParams,
        eos_token_id: int | None,
        sort_key: Callable[[BeamSearchSequence], float],
    ) -> None:
        """Grow each live beam by each token of its one-token request's logprobs (`outputs[i]` for
        `beams[i]`), set EOS-ended ones aside, keep the beam_width best others."""
        candidates = []
        for beam, output in zip(self.beams, outputs, strict=True):
            step = output.outputs[0].logprobs
            logprobs = step[0] if step else {}
            for token_id, entry in logprobs.items():
                grown = BeamSearchSequence(
                    tokens=beam.tokens + [token_id],
                    logprobs=beam.logprobs + [logprobs],
                    cum_logprob=beam.cum_logprob + entry.logprob,
                )
                if token_id == eos_token_id and not params.ignore_eos:
                    grown.finish_reason = "stop"
                    self.completed.append(grown)
                else:
                    candidates.append(grown)
        self.beams = sorted(candidates, key=sort_key, reverse=True)[: params.beam_width]

    def best(
        self, beam_width: int, sort_key: Callable[[BeamSearchSequence], float]
    ) -> list[BeamSearchSequence]:
        """The beam_width best of the completed and live beams, best first (live ones end with "length")."""
        ranked = sorted(self.completed + self.beams, key=sort_key, reverse=True)[:beam_width]
        for beam in ranked:
            beam.finish_reason = beam.finish_reason or "length"
        return ranked


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request each beam runs per step: the top 2 * beam_width logprobs (HF's and vLLM's)."""
    return SamplingParams(
        logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature, detokenize=False
    )


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """cumulative logprob / length**length_penalty; the length counts the prompt, not a final EOS."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def create_sort_beams_key_function(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key
