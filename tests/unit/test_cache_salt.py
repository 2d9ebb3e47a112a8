"""vLLM's `cache_salt`: prefix-cache blocks shared only between requests with the same salt, from the
Python API (a prompt dict's key) and from the server's completions, chat and responses bodies."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvllm.engine.llm_engine import LLMEngine
from kvllm.sampling_params import SamplingParams
from tests.unit.test_openai_server import assert_openai_error, post, tiny_client, tiny_engine

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine(tiny_qwen3_path) -> LLMEngine:
    return tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)


def prompt_ids(engine: LLMEngine, seed: int) -> list[int]:
    """A fresh prompt of three full KV blocks and a bit (nothing cached for it yet)."""
    rng = random.Random(seed)
    return [rng.randrange(10, engine.model_config.vocab_size) for _ in range(3 * engine.block_size + 5)]


def cached_tokens(engine: LLMEngine, prompt: dict, request_id: str) -> int:
    """Prompt tokens the prefix cache served for one greedy 2-token request."""
    before = engine.kv_cache_manager.prefix_cache_hits
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.kv_cache_manager.prefix_cache_hits - before


def test_prompt_dict_salt_isolates_the_prefix_cache(tiny_qwen3_path) -> None:
    engine = tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)  # its own: stepped here, not by a server
    ids = prompt_ids(engine, 1)
    full = 3 * engine.block_size
    assert cached_tokens(engine, {"prompt_token_ids": ids, "cache_salt": "a"}, "s1") == 0
    assert cached_tokens(engine, {"prompt_token_ids": ids, "cache_salt": "b"}, "s2") == 0
    assert cached_tokens(engine, {"prompt_token_ids": ids}, "s3") == 0
    assert cached_tokens(engine, {"prompt_token_ids": ids, "cache_salt": "a"}, "s4") == full
    assert cached_tokens(engine, {"prompt_token_ids": ids, "cache_salt": "b"}, "s5") == full
    assert cached_tokens(engine, {"prompt_token_ids": ids}, "s6") == full


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_bad_salt_is_refused(tiny_qwen3_path, salt) -> None:
    engine = tiny_engine(tiny_qwen3_path, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="cache_salt=.* is not valid; allowed: a non-empty string"):
        engine.add_request("bad", {"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, SamplingParams())
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def client(engine) -> Iterator[TestClient]:
    with tiny_client(engine) as c:
        yield c


def server_cached_tokens(client: TestClient, engine: LLMEngine, path: str, body: dict) -> int:
    before = engine.kv_cache_manager.prefix_cache_hits
    response = post(client, path, body)
    assert response.status_code == 200, response.text
    return engine.kv_cache_manager.prefix_cache_hits - before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"max_tokens": 2}),
        ("/v1/chat/completions", {"max_tokens": 2}),
        ("/v1/responses", {"max_output_tokens": 2}),
    ],
)
def test_server_bodies_salt_the_prefix_cache(client, engine, path, body) -> None:
    text = path + " ".join(f"word{i}" for i in range(12))  # more than two full blocks, its own
    if path == "/v1/completions":
        body = {**body, "prompt": text}
    elif path == "/v1/chat/completions":
        body = {**body, "messages": [{"role": "user", "content": text}]}
    else:
        body = {**body, "input": text}
    body = {"model": "tiny", "temperature": 0, **body}
    assert server_cached_tokens(client, engine, path, {**body, "cache_salt": "a"}) == 0
    assert server_cached_tokens(client, engine, path, {**body, "cache_salt": "b"}) == 0
    assert server_cached_tokens(client, engine, path, {**body, "cache_salt": "a"}) > 0
    assert server_cached_tokens(client, engine, path, body) == 0  # unsalted: its own cache
    assert server_cached_tokens(client, engine, path, body) > 0


def test_server_refuses_an_empty_salt(client) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": ""}
    assert_openai_error(post(client, "/v1/completions", body), 400, param="cache_salt")
    assert_openai_error(post(client, "/v1/completions", {**body, "cache_salt": 3}), 400)
