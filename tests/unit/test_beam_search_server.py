"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions: the same beams as LLM.beam_search
(itself checked against a brute-force search over HF transformers in tests/e2e/test_beam_search.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm import LLM, BeamSearchParams
from kvllm.engine.llm_engine import LLMEngine
from tests.unit.test_openai_server import (
    assert_engine_idle,
    assert_openai_error,
    post,
    tiny_client,
    tiny_engine,
)

MAX_MODEL_LEN = 128
PROMPT = [17, 101, 230, 58, 9]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with tiny_client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_qwen3_path) -> list[list[int]]:
    """LLM.beam_search's beams for PROMPT (width 3, 4 tokens), generated tokens only, best first."""
    llm = LLM(
        model=str(tiny_qwen3_path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 21,
    )
    out = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=3, max_tokens=4))
    return [seq.tokens[len(PROMPT) :] for seq in out[0].sequences]


def test_completion_beams_equal_llm_beam_search(client, engine, reference) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "n": 3,
        "use_beam_search": True,
        "return_token_ids": True,
    }
    response = post(client, "/v1/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["token_ids"] for c in answer["choices"]] == reference
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert len({tuple(t) for t in reference}) == 3  # three different beams, not one sample three times
    assert answer["usage"]["completion_tokens"] == sum(len(t) for t in reference)
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)
    assert all(c["finish_reason"] in ("length", "stop") for c in answer["choices"])
    # Two prompts: each its own n beams, indices prompt-major.
    two = post(client, "/v1/completions", {**body, "prompt": [PROMPT, PROMPT]}).json()
    assert [c["index"] for c in two["choices"]] == list(range(6))
    assert [c["token_ids"] for c in two["choices"][3:]] == reference
    assert_engine_idle(engine)


def test_chat_beams(client, engine) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "n": 2,
        "use_beam_search": True,
        "return_token_ids": True,
    }
    answer = post(client, "/v1/chat/completions", body).json()
    assert (
        len(answer["choices"]) == 2 and answer["choices"][0]["token_ids"] != answer["choices"][1]["token_ids"]
    )
    assert all(c["message"]["role"] == "assistant" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])
    # Beam search is deterministic: the same request gives the same beams.
    again = post(client, "/v1/chat/completions", body).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in answer["choices"]]
    assert_engine_idle(engine)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stream": True}, "stream"),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"stop": ["x"]}, "stop"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"length_penalty": "long"}, None),
    ],
)
def test_what_beam_search_does_not_apply_is_refused(client, engine, path, extra, param) -> None:
    body = {"model": "tiny", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
    body.update(
        {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    error = assert_openai_error(post(client, path, body), 400, param)
    if param is not None:
        assert "use_beam_search" in error["message"]
    assert_engine_idle(engine)
