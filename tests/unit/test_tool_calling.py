"""Tool calling pieces: the parsers (whole outputs and streamed in random chunks), the tool_choice
rules, and the messages the chat template sees."""

from __future__ import annotations

import json
import random

import pytest

from kvllm.config.serving import ChatTemplateDefaults
from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.tool_calling import (
    ToolCallStream,
    ToolPlan,
    extract,
    plan_tools,
    template_message,
)
from kvllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
AUTO = ChatTemplateDefaults(enable_auto_tool_choice=True, tool_call_parser="hermes")

OUTPUTS = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "Sure",
    ),
}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_parsers_find_both_calls_and_the_content(name):
    text, content = OUTPUTS[name]
    got = get_tool_parser(name)(None).extract_tool_calls(text)
    assert got.tools_called and got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_text_without_a_well_formed_call_is_content(name):
    parser = get_tool_parser(name)(None)
    for text in ("Just words, no calls.", OUTPUTS[name][0][:-12]):
        got = parser.extract_tool_calls(text)
        if not got.tools_called:
            assert got.content == text and got.tool_calls == []


def test_mistral_new_format_and_ids():
    got = get_tool_parser("mistral")(None).extract_tool_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": "Rome"})]
    assert len(got.tool_calls[0].id) == 9 and got.tool_calls[0].id.isalnum()


def _reassemble(plan: ToolPlan, text: str, rng: random.Random) -> tuple[str, list]:
    stream, content, calls = ToolCallStream(plan), "", []
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    for end in [*cuts, len(text)]:
        piece, deltas = stream.delta(text[:end], end == len(text))
        content += piece
        calls += deltas or []
    return content, calls


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streamed_deltas_reassemble_to_the_whole_result(name):
    rng = random.Random(name)
    plan = ToolPlan(parser=get_tool_parser(name)(None))
    for text in (OUTPUTS[name][0], "No calls here, only an answer that is long enough to cut."):
        whole = extract(plan, text)
        for _ in range(20):
            content, calls = _reassemble(plan, text, rng)
            assert content == (whole.content or "")
            assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                (i, t.name, t.arguments) for i, t in enumerate(whole.tool_calls)
            ]


def test_tool_choice_rules_follow_vllm():
    plan = plan_tools([WEATHER], None, AUTO, None, False)  # tools given: "auto"
    assert plan.parser is not None and plan.template_tools == [WEATHER]
    assert plan_tools([WEATHER], "none", ChatTemplateDefaults(), None, False).template_tools == [WEATHER]
    excluded = ChatTemplateDefaults(exclude_tools_when_tool_choice_none=True)
    assert plan_tools([WEATHER], "none", excluded, None, False).template_tools is None
    named = plan_tools(
        [WEATHER, TIME],
        {"type": "function", "function": {"name": "get_weather"}},
        ChatTemplateDefaults(),
        None,
        False,
    )
    assert named.constraint.json == WEATHER["function"]["parameters"] and named.named == "get_weather"
    required = plan_tools([WEATHER, TIME], "required", ChatTemplateDefaults(), None, False)
    assert required.required and required.constraint.json["minItems"] == 1
    assert extract(required, '[{"name": "get_time", "parameters": {}}]').tool_calls[0].name == "get_time"
    for tools, choice, defaults, message in (
        ([], None, AUTO, "must not be an empty array"),
        (None, "auto", AUTO, "`tools` must be set"),
        ([WEATHER], "auto", ChatTemplateDefaults(), "--enable-auto-tool-choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, AUTO, "has not been passed"),
        ([WEATHER], "sometimes", AUTO, "Invalid value for `tool_choice`"),
        ([{"type": "function"}], "auto", AUTO, "tools[0] is not valid"),
    ):
        with pytest.raises(OpenAIError, match=message.replace("[", r"\[")):
            plan_tools(tools, choice, defaults, None, False)
    with pytest.raises(OpenAIError, match="omit response_format"):
        plan_tools([WEATHER], "required", AUTO, None, True)


def test_template_messages_carry_calls_with_parsed_arguments():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    message = template_message("assistant", "", [call], None, None)
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert call["function"]["arguments"] == '{"city": "Oslo"}'  # the request is not changed
    assert template_message("tool", "12C", None, "c1", None) == {
        "role": "tool",
        "content": "12C",
        "tool_call_id": "c1",
    }
    with pytest.raises(OpenAIError, match="JSON object string"):
        template_message("assistant", "", [{"function": {"name": "f", "arguments": "{oops"}}], None, None)


# ---- reasoning ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("qwen3", "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
        ("qwen3", "Paris.", ("", "Paris.")),
        ("qwen3", "<think>still thinking", ("still thinking", "")),
        ("deepseek_r1", "hmm</think>Paris.", ("hmm", "Paris.")),
        ("deepseek_r1", "<think>hmm</think>Paris.", ("hmm", "Paris.")),
        ("deepseek_r1", "no end yet", ("no end yet", "")),
    ],
)
def test_reasoning_parsers_split_as_vllm(name, text, expected):
    from kvllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    assert REASONING_PARSERS[name]().split(text, True) == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_streamed_reasoning_adds_up_to_the_whole(name):
    from kvllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream

    parser = REASONING_PARSERS[name]()
    rng = random.Random(name)
    for text in ("<think>\nweigh a, b</think>\n\nThe answer.", "Just an answer.", "<thi", "a</thin"):
        for _ in range(20):
            stream, reasoning, content = ReasoningStream(parser), "", ""
            cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
            for end in [*cuts, len(text)]:
                delta, so_far = stream.feed(text[:end], end == len(text))
                assert so_far.startswith(content)  # content only grows
                reasoning, content = reasoning + delta, so_far
            assert (reasoning, content) == parser.split(text, True)


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools([WEATHER, TIME], "auto", AUTO, None, False, parallel_tool_calls=False)
    got = extract(plan, OUTPUTS["hermes"][0])
    assert [c.name for c in got.tool_calls] == ["get_weather"]
