"""The default bind address: all interfaces as vLLM, with a warning when no API key is set."""

from __future__ import annotations

import logging

import pytest

from kvllm.config.engine import EngineArgs
from kvllm.entrypoints.cli.main import build_parser
from kvllm.entrypoints.openai import server
from kvllm.entrypoints.openai.server import bind_warning


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::", "10.1.2.3", "example.internal"])
def test_reachable_hosts_without_a_key_warn(host):
    warning = bind_warning(host, None)
    assert warning is not None and "no API key" in warning and "--api-key" in warning
    assert bind_warning(host, "sk-set") is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_hosts_do_not_warn(host):
    assert bind_warning(host, None) is None


def test_serve_defaults_to_all_interfaces_and_warns(tiny_qwen3_path, monkeypatch, caplog):
    assert build_parser().parse_args(["serve"]).host is None
    seen = {}

    class NoServe(server._GracefulServer):
        def run(self, sockets=None) -> None:
            seen["host"] = self.config.host

    monkeypatch.setattr(server, "_GracefulServer", NoServe)
    args = EngineArgs(
        model=str(tiny_qwen3_path), dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20
    )
    with caplog.at_level(logging.WARNING, logger="kvllm.entrypoints.openai.server"):
        server.run_server(args, port=8123, log_stats_interval=0)
    assert seen["host"] == "0.0.0.0"
    assert any("Listening on all interfaces with no API key" in r.getMessage() for r in caplog.records)
