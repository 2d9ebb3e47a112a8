"""ChatTemplateRenderer: the same text as transformers' apply_chat_template, inside bounds a template
(or the input driving it) cannot escape."""

from __future__ import annotations

import pytest

from kvllm.entrypoints.chat_utils import ChatTemplateError, ChatTemplateRenderer, RenderBounds

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And ünïcödé 😀?"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_renders_what_transformers_renders(
    tiny_qwen3_path, smollm2_path, conversation, add_generation_prompt
):
    from transformers import AutoTokenizer

    renderer = ChatTemplateRenderer()
    for path in (tiny_qwen3_path, smollm2_path):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        expected = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        ours = renderer.render(
            tokenizer.chat_template, conversation, add_generation_prompt, tokenizer.special_tokens_map
        )
        assert ours == expected


def test_transformers_globals_and_tags_work():
    renderer = ChatTemplateRenderer()
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}|{{ messages | tojson }}|{% generation %}{{ eos_token }}{% endgeneration %}|"
        "{% for i in range(3) | reverse %}{{ i }}{% endfor %}{{ range(4) | length }}|{{ strftime_now('%Y')[:2] }}"
    )
    text = renderer.render(template, [{"role": "user", "content": "é"}], False, {"eos_token": "</s>"})
    assert text == '1|[{"role": "user", "content": "é"}]|</s>|2104|20'
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        renderer.render("{{ raise_exception('Conversation roles must alternate') }}", [], False, {})


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "range() more than",
        ),
        ("{{ 'a' * 100000000 }}", "sequence of more than"),
        ("{% for m in messages * 100000000 %}{% endfor %}", "sequence of more than"),
        ("{{ 2 ** 100000000 }}", "power of more than"),
        ("{{ 'x' | center(1000000000) }}", "the number 1000000000"),
        ("{{ '%0999999999d' % 1 }}", "the number 999999999"),
        ("{{ '{:>999999999}'.format(1) }}", "the number 999999999"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
        ("{{ lipsum(100000) }}", "'lipsum' is undefined"),
        ("{% set ns = namespace(_secret=1) %}", "cannot hold the attribute '_secret'"),
        ("{{ messages.__class__.__mro__ }}", "access to attribute '__class__' of 'list' object is unsafe"),
        ("{% for %}", "not valid Jinja"),
    ],
)
def test_hostile_templates_stop_at_a_bound(template, message):
    renderer = ChatTemplateRenderer(RenderBounds(max_range_steps=100_000))
    with pytest.raises(ChatTemplateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        renderer.render(template, [{"role": "user", "content": "x"}], False, {})


def test_the_deadline_and_the_output_size_are_checked_as_the_template_runs():
    slow = ChatTemplateRenderer(RenderBounds(max_seconds=0.0))
    with pytest.raises(ChatTemplateError, match="took more than 0.0 s"):
        slow.render(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            [{"role": "user", "content": "x"}],
            False,
            {},
        )
    small = ChatTemplateRenderer(RenderBounds(max_chars=100))
    with pytest.raises(ChatTemplateError, match="rendered more than 100 characters"):
        small.render(
            "{% for i in range(50) %}{{ messages[0].content }}{% endfor %}", [{"content": "abc"}], False, {}
        )
