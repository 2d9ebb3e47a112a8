"""SamplingParams: how one request turns logits into tokens and tokens into text.

Field names and defaults follow vLLM, so a vLLM user's code works unchanged. No torch is imported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any

# Below this temperature a request is greedy (vLLM's threshold): dividing by it would overflow.
_GREEDY_TEMPERATURE = 1e-5
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: everything so far (every step copies the whole output); DELTA: only what is new
    since the previous output; FINAL_ONLY: one output, when the request finishes (what `LLM.generate`
    asks for, so a step's host work does not grow with the outputs' length).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's form (vLLM's class and fields): exactly one of `json` (a JSON
    schema, as a dict or a JSON string), `regex`, `choice` (the output is one of these strings),
    `grammar` (EBNF, xgrammar's GBNF dialect), `json_object` (any JSON object) or `structural_tag`.

    `disable_any_whitespace` makes JSON compact; `disable_additional_properties` treats a schema's
    objects as closed unless they say otherwise; `whitespace_pattern` is refused (xgrammar has none).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"structured_outputs sets {', '.join(given)}: only one kind of constraint may be used; "
                f"allowed: one of {', '.join(CONSTRAINT_FIELDS)}"
            )
        if not given:
            raise ValueError(
                f"structured_outputs sets no constraint; allowed: one of {', '.join(CONSTRAINT_FIELDS)}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            _fail("structured_outputs.choice", self.choice, "a non-empty list of strings")
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                _fail(f"structured_outputs.{name}", value, "a string")
        if self.json is not None and not isinstance(self.json, str | dict):
            _fail("structured_outputs.json", self.json, "a JSON schema (a dict or a JSON string)")
        if self.json_object is not None and self.json_object is not True:
            _fail("structured_outputs.json_object", self.json_object, "true (or leave it unset)")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend (vLLM "
                "refuses it there too); use disable_any_whitespace=True for compact JSON, or omit it"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, json_object or structural_tag."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)


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

    Token constraints (applied to the logits before penalties, in vLLM's order): `allowed_token_ids`
    (only these may be sampled), `bad_words` (never completed: a one-token word is always banned, a
    longer word's last token is banned when the output ends with its other tokens; each word is
    tokenized with and without a leading space, as vLLM does), `logit_bias` (token id -> bias in
    [-100, 100] added to its logit). Token ids are checked against the model's vocabulary when the
    engine takes the request. `truncate_prompt_tokens` keeps the last k prompt tokens (-1: the last
    max_model_len), as vLLM's field of that name. `extra_args` is stored for custom processors and
    not read by kvllm. `structured_outputs` constrains the output to a JSON schema, regex, choice or
    grammar (`StructuredOutputsParams`).
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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The bad words' token sequences, set by the engine's input processor (it owns the tokenizer).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

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
        self.bad_words = [] if self.bad_words is None else self.bad_words
        if isinstance(self.bad_words, list | tuple):
            self.bad_words = list(self.bad_words)
        if isinstance(self.allowed_token_ids, tuple | range):
            self.allowed_token_ids = list(self.allowed_token_ids)
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
        self._validate_token_constraints()
        if self.truncate_prompt_tokens is not None and not (
            _is_int(self.truncate_prompt_tokens)
            and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            _fail(
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                "None, an integer >= 1 (keep the last k prompt tokens) or -1 (keep the last max_model_len)",
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            _fail("extra_args", self.extra_args, "None or a dict (passed through to custom processors)")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            _fail("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={self.stop!r} needs detokenize=True: stop strings are matched on the output text"
            )

    def _validate_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", self.logit_bias, "None or a dict of token id -> bias")
            # Only the offending entry is quoted: a bias dict may hold thousands.
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    _fail("logit_bias", {token_id: bias}, "token ids (the keys) that are integers >= 0")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or bias != bias:
                    _fail("logit_bias", {token_id: bias}, "biases (the values) that are numbers")
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    _fail(
                        "logit_bias",
                        {token_id: bias},
                        f"biases from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}",
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                _fail("allowed_token_ids", ids, "None or a non-empty list of token ids")
            bad = [t for t in ids if not (_is_int(t) and t >= 0)]
            if bad:
                _fail("allowed_token_ids", bad[:10], "a non-empty list of integers >= 0 (these are not)")
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            _fail(
                "bad_words", self.bad_words, "None or a list of strings that are not empty or only whitespace"
            )

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token sequences of `bad_words` (None until the engine has tokenized them)."""
        return self._bad_words_token_ids

    @property
    def has_token_constraints(self) -> bool:
        """Whether the sampler must process this request's logits for allowed ids, bad words or biases."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

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
        changes.setdefault("bad_words", list(self.bad_words))
        if "bad_words" in changes and changes["bad_words"] != self.bad_words:
            changes["_bad_words_token_ids"] = None  # tokenized again by the engine
        for name in ("logit_bias", "extra_args"):
            value = changes.get(name, getattr(self, name))
            changes[name] = dict(value) if isinstance(value, dict) else value
        if isinstance(self.allowed_token_ids, list):
            changes.setdefault("allowed_token_ids", list(self.allowed_token_ids))
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


@dataclass
class BeamSearchParams:
    """Settings of `LLM.beam_search` (vLLM's class): `beam_width` beams, up to `max_tokens` new tokens
    each; a beam ends at the tokenizer's EOS unless `ignore_eos`; beams are ranked by cumulative
    logprob / length**`length_penalty` (the length counts the prompt, as vLLM's). `temperature` is
    passed to the one-token steps; the logprobs that rank beams are the raw model's, before it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", self.temperature, "a number >= 0")
        _check_number("length_penalty", self.length_penalty)
