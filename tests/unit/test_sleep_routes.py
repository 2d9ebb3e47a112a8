"""vLLM's sleep-mode routes (/sleep, /wake_up, /is_sleeping): mounted with VLLM_SERVER_DEV_MODE only;
generation while asleep gets 503 naming /wake_up; the sleep-state gauge follows."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvllm.entrypoints.openai.server import build_app
from kvllm.entrypoints.openai.sleep_routes import dev_mode
from tests.unit.test_openai_server import assert_engine_idle, assert_openai_error, tiny_engine

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}


def _gauge(client: TestClient, state: str) -> float:
    line = next(
        line
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("vllm:engine_sleep_state{") and f'sleep_state="{state}"' in line
    )
    return float(line.rsplit(" ", 1)[1])


def test_dev_mode_reads_vllms_variable():
    assert dev_mode({"VLLM_SERVER_DEV_MODE": "1"}) and dev_mode({"KVLLM_SERVER_DEV_MODE": "true"})
    assert not dev_mode({}) and not dev_mode({"VLLM_SERVER_DEV_MODE": "0"})


def test_sleep_and_wake_up_through_the_routes(tiny_qwen3_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    engine = tiny_engine(tiny_qwen3_path)
    with TestClient(build_app(engine=engine, served_model_name="m", log_stats_interval=0)) as client:
        before = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert _gauge(client, "weights_offloaded") == 1 and _gauge(client, "awake") == 0
        assert_openai_error(client.post("/v1/completions", json=COMPLETION), 503, text="/wake_up")
        assert_openai_error(client.post("/sleep"), 409, text="already asleep")
        assert client.post("/wake_up").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False} and _gauge(client, "awake") == 1
        after = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        assert after == before
        assert_openai_error(client.post("/sleep", params={"level": 3}), 400, text="not a sleep level")
        assert_openai_error(client.post("/wake_up", params={"tags": "everything"}), 400, text="Unknown")
        assert_engine_idle(engine)


@pytest.mark.parametrize("path", ["/sleep", "/wake_up"])
def test_not_mounted_without_dev_mode(tiny_qwen3_path, monkeypatch, path):
    for name in ("VLLM_SERVER_DEV_MODE", "KVLLM_SERVER_DEV_MODE"):
        monkeypatch.delenv(name, raising=False)
    engine = tiny_engine(tiny_qwen3_path)
    with TestClient(build_app(engine=engine, served_model_name="m", log_stats_interval=0)) as client:
        assert client.post(path).status_code == 404
        assert client.get("/is_sleeping").status_code == 404
