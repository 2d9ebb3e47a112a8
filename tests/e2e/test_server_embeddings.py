"""`kvllm serve` of the real all-MiniLM-L6-v2 with --runner pooling: /v1/embeddings through the openai
client and LangChain's OpenAIEmbeddings, and --middleware (a class and a function)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from kvllm import LLM
from tests.e2e.test_server_openai import API_KEY, MODEL_NAME, RemoteServer, series
from tests.model_factory import minilm_path

TEXTS = ["A man is eating food.", "The new movie is awesome!", "Paris is the capital of France."]
ATOL = 1e-6  # the same engine in another process; float32 both ways (base64 is exact)


@pytest.fixture(scope="module")
def model_path() -> str:
    return minilm_path()


@pytest.fixture(scope="module")
def reference(model_path: str) -> np.ndarray:
    """The offline engine's embeddings (LLM.embed equals sentence-transformers: test_pooling_engine)."""
    outputs = LLM(model_path, dtype="float32").embed(TEXTS, use_tqdm=False)
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float32)


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[RemoteServer]:
    server = RemoteServer(
        model_path,
        "--runner",
        "pooling",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--middleware",
        "tests.e2e.middleware_fixtures.StampMiddleware",
        "--middleware",
        "tests.e2e.middleware_fixtures.stamp_function",
    )
    yield server
    server.stop()


def test_openai_client_embeddings(server: RemoteServer, reference: np.ndarray, model_path: str) -> None:
    from transformers import AutoTokenizer

    client = server.client()
    # The client asks for base64 unless told otherwise, and decodes it as float32.
    result = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == MODEL_NAME
    np.testing.assert_allclose(np.array([d.embedding for d in result.data]), reference, atol=ATOL, rtol=0)
    token_ids = [AutoTokenizer.from_pretrained(model_path)(t).input_ids for t in TEXTS]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, token_ids))
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, reference[0], atol=ATOL, rtol=0)
    # Token ids, one list or several, embed as the text they spell.
    ids = token_ids[1]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, reference[1], atol=ATOL, rtol=0)
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    single = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    assert single.data[0].embedding == by_ids.data[0].embedding
    # Every input counted as a prompt and a successful request in vLLM's series.
    prompt_tokens = (
        result.usage.prompt_tokens
        + floats.usage.prompt_tokens
        + by_ids.usage.prompt_tokens
        + single.usage.prompt_tokens
    )
    metrics = server.metrics()
    assert metrics[series("vllm:prompt_tokens_total")] == prompt_tokens
    assert metrics[series("vllm:request_success_total", finished_reason="stop")] == 3 + 1 + 2 + 1
    assert "A stat recorder failed" not in server.log()


def test_embedding_errors(server: RemoteServer) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka"):
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="maximum context length of 256"):
        client.embeddings.create(model=MODEL_NAME, input="Paris " * 300)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="other", input="hi")
    # A pooling model has no generation APIs (vLLM mounts none for it).
    with pytest.raises(openai.NotFoundError, match="does not support the Completions API"):
        client.completions.create(model=MODEL_NAME, prompt="hi")
    with pytest.raises(openai.NotFoundError, match="does not support the Chat Completions API"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    # SageMaker's /invocations takes an embeddings body for a pooling model.
    response = httpx.post(
        f"{server.url}/invocations",
        json={"input": ["hi", "there"], "encoding_format": "float"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 200 and [d["index"] for d in response.json()["data"]] == [0, 1]
    # Still serving after the errors.
    assert len(client.embeddings.create(model=MODEL_NAME, input="hi").data[0].embedding) == 384


def test_langchain_openai_embeddings(server: RemoteServer, reference: np.ndarray) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=MODEL_NAME,
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        check_embedding_ctx_length=False,  # vLLM's docs: the server tokenizes, not tiktoken
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS)
    np.testing.assert_allclose(np.array(documents), reference, atol=ATOL, rtol=0)
    np.testing.assert_allclose(embeddings.embed_query(TEXTS[2]), reference[2], atol=ATOL, rtol=0)


def test_middleware_class_and_function(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    assert response.headers["x-stamp"] == "class"
    assert response.headers["x-stamp-function"] == "/health"


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("tests.e2e.middleware_fixtures.NOT_MIDDLEWARE", "Must be a function or a class"),
        ("tests.e2e.middleware_fixtures.Missing", "cannot be imported"),
        ("nomodule", "is not an import path"),
    ],
)
def test_bad_middleware_is_refused_before_loading(path: str, reason: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvllm.entrypoints.cli.main",
            "serve",
            "--middleware",
            path,
            "--load-format",
            "dummy",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert reason in result.stderr
