"""Tools in chat requests, by vLLM's rules.

- `tools` reach the chat template as sent (OpenAI's `{"type": "function", "function": {...}}`), and
  so do assistant `tool_calls` (their JSON-string arguments parsed to objects, as vLLM and
  transformers' templates expect) and `tool` messages with their `tool_call_id`.
- `tool_choice` defaults to "auto" when tools are given, else "none". "none" still renders the tools
  unless --exclude-tools-when-tool-choice-none; the output is not parsed.
- "auto" needs --enable-auto-tool-choice and --tool-call-parser: the parser finds the calls in the text.
- "required" and a named function constrain the output with structured outputs (a JSON array of
  `{"name", "parameters"}` objects, or the function's parameters), so the calls always parse. The
  JSON is compact (no free whitespace between tokens: vLLM allows it), since only programs read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvllm.config.serving import ChatTemplateDefaults
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from kvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ExtractedToolCalls, ToolCall
from kvllm.sampling_params import StructuredOutputsParams


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, its sampling and its response."""

    template_tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None  # "auto": calls parsed out of the text
    constraint: StructuredOutputsParams | None = None  # "required" / named: the output is the calls
    named: str | None = None
    required: bool = False
    tool_names: list[str] = field(default_factory=list)
    parallel_tool_calls: bool = True  # false: only the first call is returned

    @property
    def parses_output(self) -> bool:
        return self.parser is not None or self.constraint is not None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _check_tools(tools: list[Any]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise OpenAIError(
                f"tools[{i}] is not valid; allowed: {{'type': 'function', 'function': {{'name': ..., "
                "'description': ..., 'parameters': {...}}}}",
                param="tools",
            )
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names.append(function["name"])
    return names


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    defaults: ChatTemplateDefaults,
    tokenizer: Any,
    has_other_constraint: bool,
    parallel_tool_calls: bool = True,
) -> ToolPlan:
    """The request's ToolPlan; a 400 naming the field for what vLLM refuses."""
    plan = _plan_tools(tools, tool_choice, defaults, tokenizer, has_other_constraint)
    plan.parallel_tool_calls = parallel_tool_calls
    return plan


def _plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    defaults: ChatTemplateDefaults,
    tokenizer: Any,
    has_other_constraint: bool,
) -> ToolPlan:
    if tools is not None and len(tools) == 0:
        raise OpenAIError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice != "none":
            raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return ToolPlan()
    names = _check_tools(tools)
    if tool_choice == "none":
        return ToolPlan(
            None if defaults.exclude_tools_when_tool_choice_none else list(tools), tool_names=names
        )
    if tool_choice != "auto" and has_other_constraint:
        raise OpenAIError(
            f"tool_choice {json.dumps(tool_choice)} sets the output's structure; omit response_format and "
            "structured_outputs with it",
            param="tool_choice",
        )
    if tool_choice == "auto":
        if not (defaults.enable_auto_tool_choice and defaults.tool_call_parser):
            raise OpenAIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        parser = get_tool_parser(defaults.tool_call_parser)(tokenizer)
        return ToolPlan(list(tools), parser=parser, tool_names=names)
    if tool_choice == "required":
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": _parameters(t),
                        },
                        "required": ["name", "parameters"],
                    }
                    for t in tools
                ]
            },
        }
        return ToolPlan(
            list(tools),
            constraint=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
            required=True,
            tool_names=names,
        )
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise OpenAIError(f"Tool {name!r} has not been passed in `tools`.", param="tool_choice")
        tool = tools[names.index(name)]
        return ToolPlan(
            list(tools),
            constraint=StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True),
            named=name,
            tool_names=names,
        )
    raise OpenAIError(
        f'Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, "none", "auto" or '
        '"required" are supported.',
        param="tool_choice",
    )


def template_message(
    role: str, content: str, tool_calls: list[Any] | None, tool_call_id: str | None, name: str | None
) -> dict[str, Any]:
    """One message as the chat template sees it."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        calls = []
        for call in tool_calls:
            call = json.loads(json.dumps(call))  # a copy
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise OpenAIError(
                        f"tool_calls arguments must be a JSON object string, got {function['arguments']!r}",
                        param="messages",
                    ) from None
            calls.append(call)
        message["tool_calls"] = calls
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if name is not None:
        message["name"] = name
    return message


def extract(plan: ToolPlan, text: str) -> ExtractedToolCalls:
    """The calls in a finished output (none when the plan does not parse outputs)."""
    result = _extract(plan, text)
    if not plan.parallel_tool_calls:
        result.tool_calls = result.tool_calls[:1]
    return result


def _extract(plan: ToolPlan, text: str) -> ExtractedToolCalls:
    if plan.named is not None:
        return ExtractedToolCalls(True, [ToolCall(plan.named, text)], None)
    if plan.required:
        try:
            calls = [
                ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)
            ]
        except (json.JSONDecodeError, KeyError, TypeError):  # cut by max_tokens: not a complete array
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)
    if plan.parser is not None:
        return plan.parser.extract_tool_calls(text)
    return ExtractedToolCalls(False, [], text)


class ToolCallStream:
    """Streaming for one choice: content deltas while the text is certainly content, then the calls,
    one delta each with all their arguments, when the output ends (so the deltas reassemble to the
    non-streamed message)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(content to send now, tool-call deltas or None) for the output `text` so far."""
        plan = self.plan
        if not finished:
            if plan.constraint is not None:
                return "", None
            safe = plan.parser.content_prefix_len(text) if plan.parser is not None else len(text)
            out, self.sent = text[self.sent : max(safe, self.sent)], max(safe, self.sent)
            return out, None
        result = extract(plan, text)
        if not result.tools_called:
            out, self.sent = text[self.sent :], len(text)
            return out, None
        content = result.content or ""
        rest = content[self.sent :] if len(content) > self.sent else ""
        self.sent = len(text)
        deltas = [{"index": i, **call.to_openai()} for i, call in enumerate(result.tool_calls)]
        return rest, deltas
