"""The tool-call formats of the families kvllm serves (vLLM's parsers of the same names)."""

from __future__ import annotations

import json
import random
import re
import string

from kvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    arguments_json,
)


def _no_calls(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(False, [], text)


class Hermes2ProToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3); the
    text before the first block is the content."""

    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.start_marker not in text:
            return _no_calls(text)
        calls = []
        try:
            for closed, open_ in self._BLOCK.findall(text):
                body = json.loads(closed or open_)
                calls.append(ToolCall(body["name"], arguments_json(body.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            return _no_calls(text)  # not a well-formed call: the text as the model wrote it
        content = text[: text.find(self.start_marker)]
        return ExtractedToolCalls(bool(calls), calls, content or None)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`, several separated by `;`); anything else is content."""

    start_marker = "{"
    skip_special_tokens = False  # <|python_tag|> is a special token
    _PYTHON_TAG = "<|python_tag|>"

    def content_prefix_len(self, text: str) -> int:
        # Only an output that starts with a call is one; nothing is content until that is known.
        stripped = text.lstrip()
        if not stripped:
            return 0
        if stripped.startswith(("{", self._PYTHON_TAG)) or self._PYTHON_TAG.startswith(stripped):
            return 0
        return len(text)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(self._PYTHON_TAG).strip()
        if not body.startswith("{"):
            return _no_calls(text)
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                name = obj["name"]
                calls.append(ToolCall(name, arguments_json(obj.get("parameters", obj.get("arguments", {})))))
                at = end
                while at < len(body) and body[at] in " \n\t;":
                    at += 1
        except (json.JSONDecodeError, KeyError, TypeError):
            return _no_calls(text)
        return ExtractedToolCalls(True, calls, None)


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`
    (repeated); call ids are Mistral's 9 characters; the text before the marker is the content."""

    start_marker = "[TOOL_CALLS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        at = text.find(self.start_marker)
        if at < 0:
            return _no_calls(text)
        content = text[:at] or None
        rest = text[at:].replace(self.start_marker, "\n").strip()
        calls = []
        try:
            if rest.startswith("["):
                for obj in json.loads(rest):
                    calls.append(
                        ToolCall(obj["name"], arguments_json(obj.get("arguments", {})), _mistral_id())
                    )
            else:
                for part in filter(None, (p.strip() for p in rest.split("\n"))):
                    name, args = part.split("[ARGS]", 1)
                    json.loads(args)
                    calls.append(ToolCall(name.strip(), args.strip(), _mistral_id()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            return _no_calls(text)
        return ExtractedToolCalls(bool(calls), calls, content)
