"""`kvllm serve` argument handling (no server is started)."""

from __future__ import annotations

import pytest

from kvllm.entrypoints.cli import serve
from kvllm.entrypoints.cli.engine_args import engine_args_from_cli
from kvllm.entrypoints.cli.main import build_parser, main


def test_serve_is_registered_with_engine_and_server_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "some/model",
            "--dtype",
            "float32",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
            "--shutdown-timeout",
            "2.5",
        ]
    )
    assert args.dispatch is serve.run
    assert (args.host, args.port, args.api_key, args.served_model_name) == (
        None,  # all interfaces, as vLLM (run_server warns when no API key is set)
        9001,
        ["k"],
        ["a", "b"],
    )
    assert args.shutdown_timeout == 2.5 and args.log_stats_interval == 10.0
    engine_args = engine_args_from_cli(args)
    assert engine_args.model == "some/model" and engine_args.dtype == "float32"


def test_serve_without_model_uses_the_default_model():
    args = build_parser().parse_args(["serve"])
    assert engine_args_from_cli(args).model is None  # EngineArgs resolves None to the embedded SmolLM2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "0"], "--port 0 is not valid; allowed: 1 to 65535"),
        (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout -1.0 is not valid"),
        (["serve", "--dtype", "float64"], "dtype='float64' is not valid"),
    ],
)
def test_serve_rejects_bad_flags_before_loading_anything(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
