"""continue_final_message, add_generation_prompt and --chat-template-content-format, through the
server's /tokenize and chat route (vLLM's rules), against the text rendered by hand."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvllm.config.serving import ChatTemplateDefaults
from kvllm.entrypoints.openai.server import build_app
from kvllm.entrypoints.openai.serving_engine import content_format
from tests.unit.test_openai_server import tiny_engine

STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m['content'] }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}[{{ part.type }}:{{ part.text }}]"
    "{% endfor %}</{{ m.role }}>{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    {"role": "assistant", "content": "The answer starts"},
]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path):
    return tiny_engine(tiny_qwen3_path)


def _client(engine, template: str, fmt: str = "auto") -> TestClient:
    defaults = ChatTemplateDefaults(template, content_format=fmt)
    return TestClient(
        build_app(engine=engine, served_model_name="m", log_stats_interval=0, chat_defaults=defaults)
    )


def _text(client: TestClient, **body) -> str:
    r = client.post("/tokenize", json={"messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_continue_final_message_cuts_after_the_last_message(engine):
    with _client(engine, STRING_TEMPLATE) as client:
        full = _text(client, add_generation_prompt=False)
        assert full == "<user>one\ntwo</user><assistant>The answer starts</assistant>"
        assert _text(client, add_generation_prompt=False, continue_final_message=True) == (
            "<user>one\ntwo</user><assistant>The answer starts"
        )
        r = client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": MESSAGES, "continue_final_message": True, "max_tokens": 1},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        assert "add_generation_prompt" in r.json()["error"]["message"]
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": MESSAGES,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(("fmt", "template"), [("auto", PARTS_TEMPLATE), ("openai", PARTS_TEMPLATE)])
def test_openai_content_format_gives_the_template_parts(engine, fmt, template):
    with _client(engine, template, fmt) as client:
        assert _text(client, add_generation_prompt=False) == (
            "<user>[text:one][text:two]</user><assistant>[text:The answer starts]</assistant>"
        )


def test_string_format_and_detection():
    assert content_format(STRING_TEMPLATE, "auto") == "string"
    assert content_format(PARTS_TEMPLATE, "auto") == "openai"
    assert content_format(PARTS_TEMPLATE, "string") == "string"


def test_llm_chat_takes_tools_and_continue_final_message(tiny_qwen3_real_tokenizer_path):
    """LLM.apply_chat_template (so LLM.chat) against transformers on the real Qwen3 template."""
    from transformers import AutoTokenizer

    from kvllm import LLM

    llm = LLM(
        str(tiny_qwen3_real_tokenizer_path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 22
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_real_tokenizer_path)
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]
    got = llm.apply_chat_template(conversation, False, continue_final_message=True, tools=tools)
    text = tokenizer.apply_chat_template(
        conversation, tools=tools, continue_final_message=True, tokenize=False
    )
    assert got == tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(got).endswith("Hello th")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.apply_chat_template(conversation, True, continue_final_message=True)
