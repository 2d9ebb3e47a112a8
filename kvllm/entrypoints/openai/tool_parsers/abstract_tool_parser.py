"""ToolParser: turns a model's text into OpenAI tool calls, whole or as a stream of deltas."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call in OpenAI's shape: `arguments` is a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=random_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def arguments_json(value: Any) -> str:
    """A call's arguments as OpenAI sends them: a JSON string (the model may have written an object)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolParser:
    """Base of the parsers. `extract_tool_calls` reads a whole output; streaming uses `start_marker`:
    text before it is content, streamed as it comes; from the marker on, text is held and the calls
    are sent once the output ends (each call one delta: id, name and all its arguments), so the
    deltas always reassemble to the non-streamed result."""

    start_marker: str = ""
    skip_special_tokens: bool = True  # False when the markers are special tokens the text must keep

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def content_prefix_len(self, text: str) -> int:
        """How much of `text` (the output so far) is content for certain: up to the marker, or up to
        a tail that could be the marker's beginning."""
        at = text.find(self.start_marker)
        if at >= 0:
            return at
        for keep in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
