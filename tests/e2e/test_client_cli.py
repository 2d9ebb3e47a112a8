"""`kvllm chat` and `kvllm complete` against a real `kvllm serve` of the tiny model."""

from __future__ import annotations

import builtins
from collections.abc import Iterator

import openai
import pytest

from kvllm.entrypoints.cli import client as client_cli
from kvllm.entrypoints.cli.main import main
from tests.e2e.test_server_openai import API_KEY, MODEL_NAME, RemoteServer, free_port


@pytest.fixture(scope="module")
def server(tiny_qwen3_path) -> Iterator[RemoteServer]:
    # Greedy by default, so what the commands print can be compared with a greedy request.
    srv = RemoteServer(tiny_qwen3_path, "--override-generation-config", '{"temperature": 0}')
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=API_KEY, base_url=f"{server.url}/v1")


def flags(server: RemoteServer) -> list[str]:
    return ["--url", f"{server.url}/v1", "--api-key", API_KEY]


def feed_input(monkeypatch, lines: list[str]) -> None:
    """input() answers `lines` in turn, then raises EOFError (Ctrl-D)."""
    pending = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


def record_calls(monkeypatch, resource: type) -> list[dict]:
    """The keyword arguments of every `resource.create` call from here on (messages copied as sent)."""
    calls: list[dict] = []
    real_create = resource.create

    def record(self, **kwargs):
        if "messages" in kwargs:
            kwargs = {**kwargs, "messages": [dict(m) for m in kwargs["messages"]]}
        calls.append(kwargs)
        return real_create(self, **kwargs)

    monkeypatch.setattr(resource, "create", record)
    return calls


def test_chat_quick_prints_the_servers_reply(server, openai_client, capsys) -> None:
    assert main(["chat", *flags(server), "-q", "hi", "--system-prompt", "Be brief."]) == 0
    out = capsys.readouterr().out
    expected = openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    )
    assert expected.choices[0].message.content
    assert out == f"Using model: {MODEL_NAME}\n{expected.choices[0].message.content}\n"


def test_chat_session_keeps_the_conversation(server, capsys, monkeypatch) -> None:
    feed_input(monkeypatch, ["hello", "and again"])
    calls = record_calls(monkeypatch, openai.resources.chat.completions.Completions)
    assert main(["chat", *flags(server), "--model-name", MODEL_NAME]) == 0
    out = capsys.readouterr().out
    assert "Please enter a message for the chat model:" in out
    assert [m["content"] for m in calls[0]["messages"]] == ["hello"]
    second = calls[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] and f"{second[1]['content']}\n" in out
    assert second[2]["content"] == "and again"


def test_refused_turn_is_reported_and_the_session_goes_on(server, capsys, monkeypatch) -> None:
    # A message longer than the context: a 400 for that turn only.
    feed_input(monkeypatch, ["word " * 400, "hi"])
    calls = record_calls(monkeypatch, openai.resources.chat.completions.Completions)
    assert main(["chat", *flags(server), "--model-name", MODEL_NAME]) == 0
    captured = capsys.readouterr()
    assert "error: 400:" in captured.err and "Traceback" not in captured.err
    assert [m["content"] for m in calls[1]["messages"]] == ["hi"]  # the refused turn left the conversation


def test_complete_quick_with_stats(server, capsys) -> None:
    assert main(["complete", *flags(server), "-q", "Once upon a time", "--max-tokens", "5", "--stats"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"Using model: {MODEL_NAME}"
    assert out[-2].startswith("TTFT:") and out[-1].startswith("TPS:")
    assert "(5 tokens in" in out[-1]


def test_complete_session_reads_prompts_until_end_of_input(server, capsys, monkeypatch) -> None:
    feed_input(monkeypatch, ["one", "two"])
    calls = record_calls(monkeypatch, openai.resources.completions.Completions)
    assert main(["complete", *flags(server), "--max-tokens", "3"]) == 0
    assert [c["prompt"] for c in calls] == ["one", "two"]
    assert all(c["max_tokens"] == 3 and c["model"] == MODEL_NAME for c in calls)
    assert "Please enter prompt to complete:" in capsys.readouterr().out


def test_no_server_and_wrong_key_are_one_line_errors(server, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["chat", "--url", url, "-q", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"no server answered at {url}" in err and "Traceback" not in err
    assert main(["complete", "--url", f"{server.url}/v1", "--api-key", "wrong", "-q", "hi"]) == 1
    assert "refused the API key" in capsys.readouterr().err


def test_api_key_order() -> None:
    env = {"OPENAI_API_KEY": "o", "KVLLM_API_KEY": "k", "VLLM_API_KEY": "v"}
    assert client_cli.api_key("flag", env) == "flag"
    assert client_cli.api_key(None, env) == "o"
    assert client_cli.api_key(None, {"KVLLM_API_KEY": "k", "VLLM_API_KEY": "v"}) == "k"
    assert client_cli.api_key(None, {"VLLM_API_KEY": "v"}) == "v"
    assert client_cli.api_key(None, {}) == "EMPTY"
