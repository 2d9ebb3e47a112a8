"""`kvllm serve`: the OpenAI-compatible HTTP server for one model (see kvllm.entrypoints.openai.server)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli


def register(subparsers: Any) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        parents=[engine_arg_parser()],
        allow_abbrev=False,
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /version, /metrics).",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1; 0.0.0.0 for all)."
    )
    server.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    server.add_argument(
        "--api-key",
        "--api_key",
        dest="api_key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: the KVLLM_API_KEY environment variable).",
    )
    server.add_argument(
        "--served-model-name",
        "--served_model_name",
        dest="served_model_name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) clients send in 'model'; the first is reported (default: the model argument).",
    )
    server.add_argument(
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="shutdown_timeout",
        type=float,
        default=5.0,
        help="Seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted (default: 5).",
    )
    server.add_argument(
        "--log-stats-interval",
        "--log_stats_interval",
        dest="log_stats_interval",
        type=float,
        default=10.0,
        help="Seconds between throughput/KV-usage log lines; 0 disables them (default: 10).",
    )
    server.add_argument(
        "--uvicorn-log-level",
        "--uvicorn_log_level",
        dest="uvicorn_log_level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (default: info).",
    )
    server.add_argument(
        "--disable-uvicorn-access-log",
        "--disable_uvicorn_access_log",
        dest="disable_uvicorn_access_log",
        action="store_true",
        help="Do not log one line per HTTP request.",
    )
    parser.set_defaults(dispatch=run)


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit code."""
    engine_args = engine_args_from_cli(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is not valid; allowed: 1 to 65535")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} is not valid; allowed: >= 0 seconds")
    if args.log_stats_interval < 0:
        raise ValueError(
            f"--log-stats-interval {args.log_stats_interval} is not valid; allowed: >= 0 (0 = off)"
        )
    from kvllm.entrypoints.openai.server import run_server

    return run_server(
        engine_args,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("KVLLM_API_KEY") or None,
        served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
