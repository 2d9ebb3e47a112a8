"""`kvllm generate` builds LLM from the engine flags and SamplingParams from the sampling flags."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import kvllm
from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.entrypoints.cli.main import main


class FakeLLM:
    calls: list[tuple[str, Any, Any]] = []
    init_kwargs: dict[str, Any] = {}

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        FakeLLM.init_kwargs = {"model": model, **engine_args}

    def _out(self, text: str) -> list[Any]:
        return [SimpleNamespace(outputs=[SimpleNamespace(text=text)])]

    def generate(self, prompts: Any, sampling_params: Any, use_tqdm: bool = True) -> list[Any]:
        FakeLLM.calls.append(("generate", prompts, sampling_params))
        return self._out(" completion")

    def chat(self, messages: Any, sampling_params: Any) -> list[Any]:
        FakeLLM.calls.append(("chat", messages, sampling_params))
        return self._out("chat reply")


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture(autouse=True)
def fake_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(vars(kvllm), "LLM", FakeLLM)  # no lazy import of the real LLM
    monkeypatch.setitem(vars(kvllm), "SamplingParams", FakeSamplingParams)
    FakeLLM.calls.clear()


def test_generate(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "8",
            "-ac.backend=CPU_ATTN",
            "--top-k",
            "5",
            "--seed",
            "7",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out == " completion\n"
    kind, prompt, params = FakeLLM.calls[0]
    assert (kind, prompt) == ("generate", "Once upon a time")
    assert params.kwargs == {"max_tokens": 8, "temperature": 0.0, "top_k": 5, "seed": 7}
    assert FakeLLM.init_kwargs["model"] is None  # the engine's default model
    assert FakeLLM.init_kwargs["attention_config"].backend is B.CPU_ATTN
    assert FakeLLM.init_kwargs["seed"] == 7


def test_generate_chat_with_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["generate", "--model", "some/model", "--chat", "Hi", "--temperature", "0.7", "--top-p", "0.9"])
        == 0
    )
    assert capsys.readouterr().out == "chat reply\n"
    kind, messages, params = FakeLLM.calls[0]
    assert (kind, messages) == ("chat", [{"role": "user", "content": "Hi"}])
    assert params.kwargs == {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9}
    assert FakeLLM.init_kwargs == {"model": "some/model"}


def test_generate_rejects_bad_engine_args_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-p", "x", "--attention-backend", "NOPE"]) == 2
    assert "Unknown attention backend: 'NOPE'" in capsys.readouterr().err
    assert not FakeLLM.calls


def test_generate_prompt_given_twice_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hi", "-p", "Hello"]) == 2
    assert "prompt given twice" in capsys.readouterr().err
    assert not FakeLLM.calls
