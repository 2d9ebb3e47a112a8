"""SamplingParams: how one request turns logits into tokens and tokens into text.

Field names and defaults follow vLLM, so a vLLM user's code works unchanged. No torch is imported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any

# Below this temperature a request is greedy (vLLM's threshold): dividing by it would overflow.
_GREEDY_TEMPERATURE = 1e-5
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: everything so far (every step copies the whole output); DELTA: only what is new
    since the previous output; FINAL_ONLY: one output, when the request finishes (what `LLM.generate`
    asks for, so a step's host work does not grow with the outputs' length).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How the sampler picks a token for a request."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Sampling and output settings for one request (vLLM's names and defaults).

    `temperature=0` means greedy decoding. `top_k` of 0 or -1 disables top-k (stored as 0).
    `stop` and `stop_token_ids` are normalised to lists. `max_tokens=None` means "up to the
    model's context length", which the engine resolves. Invalid values raise ValueError naming
    the field, the value and what is allowed.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                _fail("output_kind", self.output_kind, "a RequestOutputKind: CUMULATIVE, DELTA or FINAL_ONLY")
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            _fail("repetition_penalty", self.repetition_penalty, "> 0 (1 = no penalty)")
        _check_number("temperature", self.temperature)
        if not self.temperature >= 0.0:
            _fail("temperature", self.temperature, ">= 0 (0 = greedy)")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "(0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        _check_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and _MIN_SEED <= self.seed <= _MAX_SEED):
            _fail(
                "seed", self.seed, "an integer from -2**63 to 2**64 - 1 (what torch.Generator takes), or None"
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, allowed="an integer >= 1 or None")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            if self.logprobs == -1:
                raise ValueError(
                    "logprobs=-1 (full vocabulary) is not supported in this version; "
                    "allowed: None or an integer >= 0 (0 = only the sampled token)"
                )
            _check_int("logprobs", self.logprobs, minimum=0, allowed="None or an integer >= 0")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, allowed="None or an integer >= 0")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={self.stop!r} needs detokenize=True: stop strings are matched on the output text"
            )

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy below temperature 1e-5 (top-k/top-p/min-p/seed are then ignored), else random."""
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> SamplingParams:
        """A deep-enough copy: list fields are copied, so the clone can be changed independently."""
        return self.replace()

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed, e.g. `params.replace(max_tokens=100)`."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        changes.setdefault("stop", list(self.stop))
        changes.setdefault("stop_token_ids", list(self.stop_token_ids))
        return replace(self, **changes)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is not valid; allowed: {allowed}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        _fail(name, value, "a number")


def _check_range(name: str, value: Any, low: float, high: float, allowed: str) -> None:
    _check_number(name, value)
    if not low <= value <= high:
        _fail(name, value, allowed)


def _check_int(name: str, value: Any, minimum: int, allowed: str | None = None) -> None:
    if not _is_int(value) or value < minimum:
        _fail(name, value, allowed or f"an integer >= {minimum}")
