"""Tool-call parsers (vLLM's `--tool-call-parser` names): the calls a model wrote, out of its text."""

from __future__ import annotations

from kvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ExtractedToolCalls, ToolParser
from kvllm.entrypoints.openai.tool_parsers.parsers import (
    Hermes2ProToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,  # Qwen2.5, Qwen3, Hermes 2/3
    "llama3_json": Llama3JsonToolParser,  # Llama 3.1 / 3.2 / 3.3 JSON tool calls
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of a --tool-call-parser name; ValueError naming the choices otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not available; allowed: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolParser", "get_tool_parser"]
