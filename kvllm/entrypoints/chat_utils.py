"""ChatTemplateRenderer: chat templates rendered for the server, sandboxed as transformers does and bounded.

A chat template is Jinja code from the model's tokenizer config (or, with
--trust-request-chat-template, from a request). It runs in jinja2's ImmutableSandboxedEnvironment
with the options, filters and globals transformers gives it, so the text equals
`tokenizer.apply_chat_template(..., tokenize=False)`. On top of the sandbox, one render is bounded so
that no template (or input that drives it) can hold the tokenizer thread or fill memory:
- wall time: at most `RenderBounds.max_seconds`, checked at every attribute or item access, call,
  filter, operator, range() step and output chunk (a template that does anything reaches one);
- range(): at most `max_range_steps` iterations over all its ranges;
- size: the output, and any string or list that `*` builds, at most `max_chars`; `**` at most
  `max_power_bits` bits; calls, filters and `%` / str.format refuse numbers (widths, counts) above
  `max_chars`.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template failed on the request's messages, or went over a render bound."""


@dataclass(frozen=True)
class RenderBounds:
    """What one render may spend (see the module docstring)."""

    max_seconds: float = 2.0
    max_range_steps: int = 1_000_000
    max_chars: int = 16 << 20
    max_power_bits: int = 1 << 16


class ChatTemplateRenderer:
    """Renders chat templates (compiled once each, up to 32 kept) within `RenderBounds`. Thread-safe."""

    def __init__(self, bounds: RenderBounds = RenderBounds()) -> None:
        self.bounds = bounds
        self._env = _BoundedSandbox(bounds)
        self._compile: Callable[[str], jinja2.Template] = functools.lru_cache(maxsize=32)(
            self._env.from_string
        )

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as text. `variables` are the template's other inputs (special tokens,
        chat_template_kwargs). Raises ChatTemplateError."""
        try:
            compiled = self._compile(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"The chat template is not valid Jinja: {exc}") from None
        budget = _Budget(self.bounds)
        token = _budget.set(budget)
        try:
            chunks, size = [], 0
            for chunk in compiled.generate(
                **variables,
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            ):
                size += len(chunk)
                if size > self.bounds.max_chars:
                    raise ChatTemplateError(
                        f"The chat template rendered more than {self.bounds.max_chars} characters"
                    )
                budget.tick()
                chunks.append(chunk)
            return "".join(chunks)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template, undefined names, ...
            raise ChatTemplateError(f"The chat template failed on these messages: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("The chat template recursed too deeply") from None
        except Exception as exc:  # errors of the template's own expressions (TypeError, ...)
            raise ChatTemplateError(
                f"The chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            _budget.reset(token)


class _Budget:
    __slots__ = ("bounds", "deadline", "range_steps")

    def __init__(self, bounds: RenderBounds) -> None:
        self.bounds = bounds
        self.deadline = time.monotonic() + bounds.max_seconds
        self.range_steps = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"Rendering the chat template took more than {self.bounds.max_seconds} s")

    def range_step(self) -> None:
        self.range_steps += 1
        if self.range_steps > self.bounds.max_range_steps:
            raise ChatTemplateError(
                f"The chat template iterated range() more than {self.bounds.max_range_steps} times"
            )
        if self.range_steps % 1024 == 0:
            self.tick()

    def check_number(self, value: Any) -> None:
        if (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and abs(value) > self.bounds.max_chars
        ):
            raise ChatTemplateError(
                f"The chat template used the number {value}; numbers given to calls, filters and "
                f"formatting are limited to {self.bounds.max_chars}"
            )


# The budget of the render running in this thread (renders run in worker threads).
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("kvllm_chat_template_budget")
# Widths and precisions: inside str.format fields ("{:>99}") and %-specs ("%099.5d").
_FORMAT_FIELD = re.compile(r"\{[^{}]*\}")
_PERCENT_SPEC = re.compile(r"%[#0 +\-]*(\d*)(?:\.(\d*))?")
_NUMBER = re.compile(r"\d+")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, bounds: RenderBounds) -> None:
        # transformers' options: trim_blocks, lstrip_blocks, loop controls and the generation tag.
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        self.bounds = bounds
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # generates text of any size
        self.globals.update(
            range=_bounded_range,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            namespace=_Namespace,
        )

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget.get().tick()
        if attribute in ("format", "format_map") and isinstance(obj, str):
            _check_format_fields(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget.get().tick()
        if argument in ("format", "format_map") and isinstance(obj, str):
            _check_format_fields(obj)
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget.get()
        budget.tick()
        for value in (*args, *kwargs.values()):
            budget.check_number(value)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget.get()
        budget.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    if len(seq) * count > self.bounds.max_chars:
                        raise ChatTemplateError(
                            f"The chat template built a sequence of more than {self.bounds.max_chars} items"
                        )
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if left.bit_length() * right > self.bounds.max_power_bits:
                    raise ChatTemplateError(
                        f"The chat template computed a power of more than {self.bounds.max_power_bits} bits"
                    )
        elif operator == "%" and isinstance(left, str):
            for spec in _PERCENT_SPEC.finditer(left):
                for number in spec.groups():
                    if number:
                        budget.check_number(int(number))
            for value in right if isinstance(right, tuple) else (right,):
                budget.check_number(value)
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedRange:
    """range() whose iteration draws on the render's budget; len, indexing and `in` stay free."""

    def __init__(self, r: range) -> None:
        self._range = r

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        value = self._range[index]
        return _BoundedRange(value) if isinstance(value, range) else value

    def __contains__(self, value: Any) -> bool:
        return value in self._range

    def __iter__(self) -> Iterator[int]:
        return self._counted(iter(self._range))

    def __reversed__(self) -> Iterator[int]:
        return self._counted(reversed(self._range))

    @staticmethod
    def _counted(values: Iterator[int]) -> Iterator[int]:
        budget = _budget.get()
        for value in values:
            budget.range_step()
            yield value


def _bounded_range(*args: int) -> _BoundedRange:
    return _BoundedRange(range(*args))


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment markers
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget.get()
        budget.tick()
        # The filtered value (first argument, after any context/environment) is data; the rest
        # are parameters such as widths and counts.
        skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1
        for value in (*args[skip:], *kwargs.values()):
            budget.check_number(value)
        return f(*args, **kwargs)

    return bounded


def _check_format_fields(text: str) -> None:
    budget = _budget.get()
    for field in _FORMAT_FIELD.findall(text):
        for number in _NUMBER.findall(field):
            budget.check_number(int(number))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, and json.dumps' options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that stores no underscore-prefixed attribute (as transformers hardens it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"A chat template namespace cannot hold the attribute {name!r}")
