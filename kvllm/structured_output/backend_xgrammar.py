"""The xgrammar backend (vLLM's default): a request's constraint -> an xgrammar grammar.

`validate` parses the constraint without the tokenizer (cheap, done when a request arrives, so a bad
schema is refused at once); `compile` builds the tokenizer-dependent grammar (cached by xgrammar's
compiler, run in the manager's thread pool).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# Batches with fewer constrained rows fill their masks on the calling thread (vLLM's threshold for its
# parallel fill is the same order: 128 rows).
THREADED_FILL_MIN_ROWS = 128

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] [^:]+:\d+: ")


class StructuredOutputError(ValueError):
    """A constraint xgrammar cannot use (a bad schema, regex or grammar); the message says why."""


def _clean(exc: Exception) -> str:
    return _XGRAMMAR_LOCATION.sub("", str(exc).strip())


def schema_text(params: StructuredOutputsParams) -> str:
    """The JSON schema of a `json` constraint, as a JSON string."""
    if isinstance(params.json, str):
        try:
            json.loads(params.json)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {exc}") from None
        return params.json
    return json.dumps(params.json)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (each a JSON-escaped string literal, as GBNF reads them)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _grammar_args(params: StructuredOutputsParams) -> tuple[str, Any]:
    """(kind, argument) of the xgrammar call that builds this constraint."""
    kind = params.kind
    if kind == "json":
        return "json", schema_text(params)
    if kind == "json_object":
        # Any JSON object. (vLLM compiles xgrammar's built-in JSON grammar, which also lets a bare array
        # through; an object is what json_object and OpenAI's JSON mode promise.)
        return "json", '{"type": "object"}'
    if kind == "regex":
        return "regex", params.regex
    if kind == "choice":
        assert params.choice is not None
        return "grammar", choice_grammar(params.choice)
    if kind == "grammar":
        return "grammar", params.grammar
    assert params.structural_tag is not None
    return "structural_tag", structural_tag_args(params.structural_tag)


# xgrammar's message when a structural tag names tokens, which only a tokenizer resolves.
_NEEDS_TOKENIZER = "requires tokenizer_info"


def structural_tag_args(text: str) -> tuple[Any, ...]:
    """xgrammar's arguments for a structural tag given as JSON, in either of vLLM's two forms:
    `{"type": "structural_tag", "format": {...}}` (xgrammar's StructuralTag, passed on as the text) or
    the legacy `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}` (tags and triggers)."""
    import xgrammar as xgr

    where = "structured_outputs.structural_tag"
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise StructuredOutputError(f"{where} must be a JSON object, got {type(payload).__name__}")
    if "structures" not in payload:
        return (text,)
    structures, triggers = payload["structures"], payload.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise StructuredOutputError(f"{where}.structures must be a list of objects with begin, schema, end")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) for t in triggers):
        raise StructuredOutputError(f"{where}.triggers must be a non-empty list of strings")
    tags = []
    for i, structure in enumerate(structures):
        missing = [k for k in ("begin", "schema", "end") if k not in structure]
        if missing:
            raise StructuredOutputError(f"{where}.structures[{i}] lacks {', '.join(missing)}")
        if not isinstance(structure["begin"], str) or not isinstance(structure["end"], str):
            raise StructuredOutputError(f"{where}.structures[{i}]: begin and end must be strings")
        schema = structure["schema"]
        tags.append(
            xgr.StructuralTagItem(
                begin=structure["begin"],
                schema=schema if isinstance(schema, str) else json.dumps(schema),
                end=structure["end"],
            )
        )
    return (tags, triggers)


def _json_kwargs(params: StructuredOutputsParams) -> dict[str, Any]:
    # xgrammar's strict mode (its default, which vLLM keeps) already closes objects that do not
    # declare additionalProperties, which is what disable_additional_properties asks for.
    return {"any_whitespace": not params.disable_any_whitespace, "strict_mode": True}


def validate(params: StructuredOutputsParams) -> None:
    """Raise StructuredOutputError naming what is wrong with the constraint (tokenizer-free parse)."""
    import xgrammar as xgr

    kind, arg = _grammar_args(params)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(arg, **_json_kwargs(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(arg)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(arg)
        else:
            xgr.Grammar.from_structural_tag(*arg)
    except StructuredOutputError:
        raise
    except Exception as exc:
        if kind == "structural_tag" and _NEEDS_TOKENIZER in str(exc):
            return  # token names: checked when it compiles, with the tokenizer
        raise StructuredOutputError(f"structured_outputs.{params.kind} is not valid: {_clean(exc)}") from None


class XgrammarBackend:
    """Owns the tokenizer's xgrammar view and a compiler with its grammar cache (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (xgrammar.CompiledGrammar); raises StructuredOutputError."""
        kind, arg = _grammar_args(params)
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(arg, **_json_kwargs(params))
            if kind == "regex":
                return self.compiler.compile_regex(arg)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(*arg)
            return self.compiler.compile_grammar(arg)
        except Exception as exc:
            raise StructuredOutputError(
                f"structured_outputs.{params.kind} is not valid: {_clean(exc)}"
            ) from None

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


class BitmaskFiller:
    """Fills the rows of a token bitmask from their matchers in one xgrammar call: on the calling thread
    below THREADED_FILL_MIN_ROWS rows, through xgrammar's thread pool (`fill_threads` threads) from there."""

    def __init__(self, fill_threads: int) -> None:
        self.fill_threads = fill_threads
        self._batch_matchers: dict[int, Any] = {}  # threads -> xgrammar BatchGrammarMatcher
        self.num_threaded_fills = 0  # fills that went through xgrammar's thread pool (tests count them)

    def fill(self, bitmask: torch.Tensor, matchers: Sequence[Any]) -> bool:
        """Row i of `bitmask` from matchers[i]; a row whose matcher is None gets every bit set.
        False (the bitmask untouched) when no row has a matcher."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return False
        if len(rows) < len(matchers):
            # Every bit set on the rows left unconstrained (xgrammar writes the others), row by row: a
            # row is under torch's parallel grain, so no intra-op thread pool wakes up on the step path.
            for i, matcher in enumerate(matchers):
                if matcher is None:
                    bitmask[i].fill_(-1)
        # One thread below the threshold: a row costs microseconds (about 2 us at batch 64 with Qwen3's
        # vocabulary on this project's CPU), so handing rows to a pool costs more than it saves, and a
        # pool thread that is not scheduled at once stalls the whole step. Still one call for the batch:
        # 15% less than a Python loop over the rows' fill_next_token_bitmask at 64 rows
        # (benchmarks/xgrammar_gil.py: 0.126 against 0.149 ms, docs/benchmarks/cpu/xgrammar_gil.json).
        threads = self.fill_threads if len(rows) >= THREADED_FILL_MIN_ROWS else 1
        if threads > 1:
            self.num_threaded_fills += 1
        batch_matcher = self._batch_matchers.get(threads)
        if batch_matcher is None:
            import xgrammar as xgr

            batch_matcher = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        return True
