"""Structured outputs through `kvllm serve`: the openai client's `chat.completions.parse`, LangChain's
`with_structured_output`, response_format on /v1/completions, vLLM's `structured_outputs` field, and
400s for bad constraints. The model has random weights and the real Qwen3 tokenizer, so valid output
comes from the constraint."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.e2e.test_server_openai import API_KEY, MODEL_NAME


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[A-Z][a-z]{0,7}$")
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


# Random weights love whitespace tokens: compact JSON keeps the outputs short (vLLM's option, kept when
# response_format sets the constraint).
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture
def server(qwen3_server):
    return qwen3_server


def test_openai_parse_with_a_pydantic_model(server):
    client = server.client()
    for _ in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Who is it?"}],
            response_format=Person,
            temperature=1.0,
            max_completion_tokens=200,
            extra_body=COMPACT,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person), message.content


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME,
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        temperature=1.0,
        max_tokens=200,
        extra_body=COMPACT,
    )
    structured = llm.with_structured_output(Person, method="json_schema")
    person = structured.invoke("Who is it?", extra_body=COMPACT)
    assert isinstance(person, Person)


def test_completions_response_format_and_structured_outputs_field(server):
    client = server.client()
    schema = Person.model_json_schema()
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Person:",
        max_tokens=200,
        temperature=1.0,
        n=4,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
            **COMPACT,
        },
    )
    for choice in out.choices:
        Person.model_validate_json(choice.text)
    regex = r"[a-z]{3}-[0-9]{2}"
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Code:",
        max_tokens=20,
        temperature=1.0,
        n=4,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert all(re.fullmatch(regex, c.text) for c in out.choices)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=20,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("left", "right")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
            "bogus",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "allowed: text, json_object, json_schema"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex is not valid"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "only one kind"),
    ],
)
def test_bad_constraints_get_a_400_naming_them(server, body, param, message):
    for route, payload in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(
            server.url + route,
            json={"model": MODEL_NAME, **payload, **body},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
    # and the server keeps serving
    assert server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices


def test_structural_tag_response_format(server):
    """response_format type structural_tag (xgrammar's form, as vLLM takes it): the tag's begin and end
    around JSON of its schema; the legacy form with a missing field is a 400 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    tag = {"type": "tag", "begin": "<answer>", "content": content, "end": "</answer>"}
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "A number?"}],
        response_format={"type": "structural_tag", "format": tag},
        temperature=1.0,
        max_tokens=80,
        n=3,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        answer = re.fullmatch(r"<answer>(.*)</answer>", choice.message.content, re.DOTALL)
        assert answer is not None and isinstance(json.loads(answer.group(1))["n"], int), (
            choice.message.content
        )
    with pytest.raises(openai.BadRequestError, match="lacks end"):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "structural_tag",
                "structures": [{"begin": "<a>", "schema": schema}],
                "triggers": ["<a>"],
            },
        )


def test_json_object_response_format_gives_an_object(server):
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=100,
        n=3,
        extra_body=COMPACT,
    )
    finished = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(t, strict=False), dict) for t in finished)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], response_format={"type": "nope"}
        )
