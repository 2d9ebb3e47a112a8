"""Tool calling and reasoning through `kvllm serve --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` on a
random-weight Qwen3 with the real Qwen3 tokenizer and chat template: prompts with tools equal
transformers' `apply_chat_template`, named and required choices always give calls that parse,
streamed calls reassemble to the non-streamed ones, and LangChain's `bind_tools` gets its calls."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_server_openai import API_KEY, MODEL_NAME

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture
def server(qwen3_server):
    return qwen3_server


def _hf_prompt_ids(path, messages, tools) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    parsed = json.loads(json.dumps(messages))
    for m in parsed:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(parsed, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("tool_choice", ["none", "auto", "required"])
def test_prompt_with_tools_and_calls_equals_apply_chat_template(
    server, tiny_qwen3_real_tokenizer_path, tool_choice
):
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=HISTORY,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    expected = _hf_prompt_ids(tiny_qwen3_real_tokenizer_path, HISTORY, [WEATHER, TIME])
    assert out.prompt_token_ids == expected


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_named_and_required_choices_always_give_calls(server):
    client = server.client()
    named = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=60,
        n=4,
    )
    for choice in named.choices:
        ((name, args),) = _calls(choice.message)
        assert name == "get_weather" and args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
        assert choice.finish_reason == "tool_calls"
    required = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=1.0,
        max_tokens=120,
        n=4,
    )
    for choice in required.choices:
        if choice.finish_reason == "length":
            continue  # a long array cut by max_tokens
        calls = _calls(choice.message)
        assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    assert any(c.finish_reason == "tool_calls" for c in required.choices)


def test_streamed_calls_reassemble_to_the_non_streamed_ones(server):
    client = server.client()
    kwargs = dict(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=1.0,
        seed=7,
        max_tokens=120,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert content == (whole.message.content or "")


def test_auto_without_a_call_is_content_and_auto_needs_the_flag(tiny_qwen3_real_tokenizer_path, server):
    out = server.client().chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[:2], tools=[WEATHER], max_tokens=8, temperature=1.0
    )
    assert out.choices[0].message.tool_calls in (None, []) and out.choices[0].message.content


def test_langchain_bind_tools(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=1.0, max_tokens=60
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather?")
    ((call,),) = [message.tool_calls]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo", "Lima")


def test_reasoning_is_split_streamed_and_not_streamed(server):
    client = server.client()
    kwargs = dict(
        model=MODEL_NAME,
        messages=HISTORY[:2],
        temperature=1.0,
        seed=3,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[A-Z][a-z]{1,5}"}},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning and reasoning.isalpha() and reasoning.islower()
    assert message.content[0].isupper() and "<think>" not in message.content
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
    hidden = client.chat.completions.create(
        **{**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}}
    )
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None


def test_tokenize_honours_chat_template_kwargs(server, tiny_qwen3_real_tokenizer_path):
    import httpx
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_real_tokenizer_path)
    messages = HISTORY[:2]
    for kwargs in ({}, {"enable_thinking": False}):
        r = httpx.post(
            f"{server.url}/tokenize",
            json={
                "model": MODEL_NAME,
                "messages": messages,
                "chat_template_kwargs": kwargs,
                "tools": [WEATHER],
            },
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        text = tokenizer.apply_chat_template(
            messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    # reasoning_effort "none" maps to enable_thinking=false, as vLLM maps it
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=1,
        reasoning_effort="none",
        extra_body={"return_token_ids": True},
    )
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
