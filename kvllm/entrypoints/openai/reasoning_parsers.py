"""Reasoning parsers (vLLM's `--reasoning-parser` names): the thinking of a model, apart from its answer.

`split(text, finished)` is the one rule, a function of the output so far: it returns the reasoning and
the content known for certain (a tail that may still become a marker is held back until the output
ends), so streamed deltas always add up to the non-streamed result.
"""

from __future__ import annotations


class ReasoningParser:
    """`<think>reasoning</think>content`. `starts_in_reasoning`: the output begins inside the thinking
    even without `<think>` (DeepSeek-R1's template puts it in the prompt)."""

    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far."""
        lead = text.lstrip()
        body, in_reasoning = text, self.starts_in_reasoning
        if lead.startswith(self.start):
            body, in_reasoning = lead[len(self.start) :], True
        elif lead and self.start.startswith(lead) and not finished:
            return "", ""  # could still become <think>
        if not in_reasoning:
            return "", text
        at = body.find(self.end)
        if at >= 0:
            return body[:at], body[at + len(self.end) :]
        if finished:
            return body, ""
        for keep in range(min(len(self.end) - 1, len(body)), 0, -1):
            if self.end.startswith(body[-keep:]):
                return body[:-keep], ""
        return body, ""


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: thinking only when the output opens with `<think>` (with enable_thinking=false the
    template closes an empty block in the prompt, and the whole output is content)."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: everything up to `</think>` is reasoning, `<think>` or not."""

    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


class ReasoningStream:
    """Per choice: the reasoning and content deltas since the previous call."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent_reasoning = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content so far)."""
        reasoning, content = self.parser.split(text, finished)
        delta = reasoning[self.sent_reasoning :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        return delta, content
