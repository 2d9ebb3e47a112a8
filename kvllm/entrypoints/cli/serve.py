"""`kvllm serve`: the OpenAI-compatible HTTP server for one model (see kvllm.entrypoints.openai.server)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvllm.config.serving import ServingLimits
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli
from kvllm.logger import init_logger

logger = init_logger(__name__)


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
        "--host",
        default=None,
        help="Address to listen on (default: all IPv4 interfaces, as vLLM; a warning is logged when no API key "
        "is set; 127.0.0.1 for this machine only).",
    )
    server.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    server.add_argument(
        "--api-key",
        "--api_key",
        dest="api_key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: the KVLLM_API_KEY environment "
        "variable, else VLLM_API_KEY, as vLLM reads it).",
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
    server.add_argument(
        "--keep-alive-on-engine-death",
        "--keep_alive_on_engine_death",
        dest="keep_alive_on_engine_death",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"),
        help="After the engine fails, keep answering 503 instead of exiting with code 1 (default: off, "
        "or the VLLM_KEEP_ALIVE_ON_ENGINE_DEATH environment variable, as in vLLM).",
    )
    _add_limit_flags(parser)
    parser.set_defaults(dispatch=run)


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServingLimits field, help and default from the field."""
    group = parser.add_argument_group("request limits", "What one request may ask of the server.")
    for f in fields(ServingLimits):
        names = dict.fromkeys([ServingLimits.flag(f.name), f"--{f.name}"])
        if isinstance(f.default, bool):
            group.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{f.metadata['help']} (default: {'on' if f.default else 'off'})",
            )
        else:
            group.add_argument(
                *names,
                dest=f.name,
                type=int,
                default=f.default,
                help=f"{f.metadata['help']} (default: {f.default})",
            )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """--api-key, else KVLLM_API_KEY, else VLLM_API_KEY (a vLLM user's setting must not open the server)."""
    if flag:
        return flag
    if environ.get("KVLLM_API_KEY"):
        return environ["KVLLM_API_KEY"]
    if environ.get("VLLM_API_KEY"):
        logger.info("Using the API key from VLLM_API_KEY")
        return environ["VLLM_API_KEY"]
    return None


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
    limits = ServingLimits.from_kwargs(vars(args))
    from kvllm.entrypoints.openai.server import run_server

    return run_server(
        engine_args,
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args.api_key, os.environ),
        served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        limits=limits,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
    )
