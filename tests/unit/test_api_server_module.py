"""`python -m kvllm.entrypoints.openai.api_server` is `kvllm serve` (vLLM's module entry point)."""

from __future__ import annotations

import subprocess
import sys

from kvllm.entrypoints.cli import serve
from kvllm.entrypoints.cli.engine_args import engine_args_from_cli
from kvllm.entrypoints.openai import api_server


def test_api_server_module_dispatches_to_serve_with_the_same_flags(monkeypatch):
    seen = {}

    def fake_run(args) -> int:
        seen["args"] = args
        return 7

    monkeypatch.setattr(serve, "run", fake_run)
    code = api_server.main(
        ["--model", "some/model", "--port", "9001", "--dtype", "float32", "--api-key", "k"]
    )
    assert code == 7
    args = seen["args"]
    assert engine_args_from_cli(args).model == "some/model"
    assert (args.port, args.api_key, args.host) == (9001, ["k"], None)


def test_api_server_module_reports_bad_flags_as_serve_does():
    assert api_server.main(["--model", "m", "--port", "70000"]) == 2


def test_python_dash_m_runs_it():
    result = subprocess.run(
        [sys.executable, "-m", "kvllm.entrypoints.openai.api_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--served-model-name" in result.stdout and "--host" in result.stdout
