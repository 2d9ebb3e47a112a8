"""--chat-template and --default-chat-template-kwargs: read as vLLM reads them, rendered by the server
in place of the model's template, with a request's chat_template_kwargs over the defaults."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvllm.config.serving import ChatTemplateDefaults, load_chat_template
from kvllm.engine.llm_engine import LLMEngine
from kvllm.entrypoints.cli.main import build_parser
from kvllm.entrypoints.openai.server import build_app
from tests.unit.test_openai_server import tiny_engine

TEMPLATE = "{{ greeting }}:{% for m in messages %}[{{ m.role }}|{{ m['content'] }}]{% endfor %}"


def test_a_path_is_read_and_a_single_line_template_is_decoded(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE + "\n", encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE + "\n"
    assert load_chat_template(r"{{ a }}\n{{ b }}") == "{{ a }}\n{{ b }}"  # vLLM's single-line form
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_default_kwargs_must_be_a_json_object():
    assert ChatTemplateDefaults.from_cli(None, '{"enable_thinking": false}').kwargs == {
        "enable_thinking": False
    }
    for bad, text in (("{nope", "not valid JSON"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(ValueError, match=text):
            ChatTemplateDefaults.from_cli(None, bad)


def test_serve_parses_both_flags(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    args = build_parser().parse_args(
        ["serve", "m", "--chat-template", str(path), "--default-chat-template-kwargs", '{"greeting": "hey"}']
    )
    defaults = ChatTemplateDefaults.from_cli(args.chat_template, args.default_chat_template_kwargs)
    assert defaults == ChatTemplateDefaults(TEMPLATE, {"greeting": "hey"})


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path)


def _rendered_ids(client: TestClient, **extra) -> list[int]:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _prompt_tokens(client: TestClient, **extra) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_the_server_renders_its_template_and_the_request_overrides_defaults(engine):
    tokenizer = engine.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    defaults = ChatTemplateDefaults(TEMPLATE, {"greeting": "hey"})
    app = build_app(engine=engine, served_model_name="m", log_stats_interval=0, chat_defaults=defaults)
    with TestClient(app) as client:
        assert _rendered_ids(client) == tokenizer.encode("hey:[user|hi]", add_special_tokens=False)
        assert _prompt_tokens(client) == count("hey:[user|hi]")
        longer = "a much longer greeting than the default one"
        assert count(f"{longer}:[user|hi]") != count("hey:[user|hi]")
        assert _prompt_tokens(client, chat_template_kwargs={"greeting": longer}) == count(
            f"{longer}:[user|hi]"
        )
    # Without the defaults the model's own template renders.
    with TestClient(build_app(engine=engine, served_model_name="m", log_stats_interval=0)) as client:
        assert _rendered_ids(client) != tokenizer.encode("hey:[user|hi]", add_special_tokens=False)


def test_default_kwargs_may_not_set_what_the_server_sets(engine):
    for name in ("messages", "add_generation_prompt", "chat_template"):
        with pytest.raises(ValueError, match=f"may not set {name}"):
            build_app(
                engine=engine, chat_defaults=ChatTemplateDefaults(None, {name: 1}), log_stats_interval=0
            )
