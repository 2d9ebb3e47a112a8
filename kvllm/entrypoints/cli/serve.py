"""`kvllm serve`: the OpenAI-compatible HTTP server for one model (see kvllm.entrypoints.openai.server)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from kvllm.config.serving import (
    ChatTemplateDefaults,
    HttpOptions,
    ResponseOptions,
    ServingLimits,
    parse_json_list,
)
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli
from kvllm.entrypoints.cli.vllm_flags import FRONTEND_FLAGS, add_unsupported_flags
from kvllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from kvllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvllm.logger import init_logger

if TYPE_CHECKING:
    from kvllm.entrypoints.openai.request_logger import RequestLogger

logger = init_logger(__name__)


def register(subparsers: Any) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        parents=[engine_arg_parser()],
        allow_abbrev=False,
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /ping, /invocations, /reset_prefix_cache, "
        "/version, /load, /metrics).",
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
        nargs="+",
        default=None,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* with one of these keys (default: the "
        "KVLLM_API_KEY environment variable, else VLLM_API_KEY, as vLLM reads it).",
    )
    add_served_model_name_flag(server)
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
    add_chat_flags(server)
    add_response_flags(server)
    add_request_log_flags(server)
    server.add_argument(
        "--config",
        metavar="YAML",
        help="Read flags from a YAML file, as vLLM does: keys are flag names (tensor-parallel-size: 1), "
        "flags on the command line win.",
    )
    _add_http_flags(parser)
    add_limit_flags(parser)
    add_unsupported_flags(server, FRONTEND_FLAGS)
    parser.set_defaults(dispatch=run)


def add_served_model_name_flag(group: Any) -> None:
    group.add_argument(
        "--served-model-name",
        "--served_model_name",
        dest="served_model_name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model name(s) requests give in 'model'; the first is reported (default: the model argument).",
    )


def add_chat_flags(group: Any) -> None:
    """The chat-template, tool-calling and reasoning flags (read back by `chat_defaults_from_cli`)."""
    group.add_argument(
        "--chat-template",
        "--chat_template",
        dest="chat_template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="The chat template to render instead of the model's: a Jinja file's path, or the template "
        "itself in single-line form (backslash escapes decoded), as vLLM reads it.",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        "--default_chat_template_kwargs",
        dest="default_chat_template_kwargs",
        default=None,
        metavar="JSON",
        help='Template variables for every chat request, as a JSON object (e.g. \'{"enable_thinking": '
        "false}'); a request's chat_template_kwargs override them.",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        "--enable_auto_tool_choice",
        dest="enable_auto_tool_choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='Let requests use tool_choice "auto": the calls are parsed out of the output by '
        "--tool-call-parser (as vLLM's flag).",
    )
    group.add_argument(
        "--tool-call-parser",
        "--tool_call_parser",
        dest="tool_call_parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="The model family's tool-call format: hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
        "(Llama 3.x), mistral.",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        "--exclude_tools_when_tool_choice_none",
        dest="exclude_tools_when_tool_choice_none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='Leave the tools out of the prompt when tool_choice is "none" (by default they are rendered '
        "and the output is not parsed, as in vLLM).",
    )
    group.add_argument(
        "--chat-template-content-format",
        "--chat_template_content_format",
        dest="chat_template_content_format",
        default="auto",
        choices=("auto", "string", "openai"),
        help="How message content reaches the chat template: a string, or OpenAI's list of "
        '{"type": "text", "text": ...} parts; auto looks at whether the template loops over content '
        "(as vLLM's flag).",
    )
    group.add_argument(
        "--reasoning-parser",
        "--reasoning_parser",
        dest="reasoning_parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Split the model's thinking into the response's reasoning (reasoning_content) field: qwen3, "
        "deepseek_r1 (as vLLM's flag).",
    )


def add_response_flags(group: Any) -> None:
    """What the answers carry, server-wide (vLLM's flags; read back by `response_options_from_cli`)."""
    _flag(
        group,
        "enable-prompt-tokens-details",
        action="store_true",
        help="Add usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache) "
        "when there are any.",
    )
    _flag(
        group,
        "enable-force-include-usage",
        action="store_true",
        help="End every stream with a usage chunk, as if the request set stream_options.include_usage.",
    )
    _flag(
        group,
        "response-role",
        default="assistant",
        help="The role of a chat reply after a generation prompt (default: assistant); without one, the reply "
        "takes the last message's role.",
    )
    _flag(
        group,
        "return-tokens-as-token-ids",
        action="store_true",
        help='Show logprob tokens as "token_id:N" in every answer (as if each request set '
        "return_tokens_as_token_ids, vLLM's flag).",
    )


def add_request_log_flags(group: Any) -> None:
    """vLLM's request logs (read back by `request_logger_from_cli`)."""
    _flag(
        group,
        "enable-log-requests",
        action="store_true",
        help="Log each request's prompt and sampling parameters when the engine takes it (off by default: "
        "prompts are users' data).",
    )
    _flag(
        group,
        "enable-log-outputs",
        action="store_true",
        help="With --enable-log-requests, also log each request's output when it finishes.",
    )
    _flag(
        group,
        "max-log-len",
        type=int,
        default=None,
        help="Most characters of a logged prompt or output, and most ids of a logged token list (default: all).",
    )


def request_logger_from_cli(args: argparse.Namespace) -> RequestLogger | None:
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs needs --enable-log-requests (as in vLLM)")
    if not args.enable_log_requests:
        return None
    from kvllm.entrypoints.openai.request_logger import RequestLogger

    return RequestLogger(log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len)


def response_options_from_cli(args: argparse.Namespace) -> ResponseOptions:
    return ResponseOptions(
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        response_role=args.response_role,
    )


def _flag(group: Any, name: str, **kwargs: Any) -> None:
    names = dict.fromkeys([f"--{name}", f"--{name.replace('-', '_')}"])
    group.add_argument(*names, dest=name.replace("-", "_"), **kwargs)


def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's HTTP-level flags (see HttpOptions)."""
    group = parser.add_argument_group("http", "Socket, TLS, CORS and proxy settings (vLLM's flags).")
    _flag(group, "uds", metavar="PATH", help="Listen on this unix socket instead of --host/--port.")
    _flag(group, "root-path", default="", help="The path prefix a proxy serves the API under (e.g. /llm).")
    _flag(group, "ssl-keyfile", metavar="FILE", help="TLS private key file (with --ssl-certfile).")
    _flag(group, "ssl-certfile", metavar="FILE", help="TLS certificate file: serve HTTPS.")
    _flag(group, "ssl-ca-certs", metavar="FILE", help="CA certificates for client certificates.")
    _flag(
        group,
        "ssl-cert-reqs",
        type=int,
        default=0,
        help="Client certificates: 0 not asked (default), 1 optional, 2 required (Python's ssl module).",
    )
    _flag(group, "ssl-ciphers", help="TLS 1.2 cipher suites, e.g. ECDHE-RSA-AES256-GCM-SHA384.")
    _flag(
        group,
        "allowed-origins",
        metavar="JSON",
        help="CORS: origins that may call the API from a browser, as a JSON list ('[\"*\"]' for all). "
        "Default: no CORS headers (vLLM's default is all origins; kvllm keeps browsers' same-origin rule "
        "unless told otherwise).",
    )
    _flag(
        group, "allowed-methods", metavar="JSON", help='CORS: allowed methods, a JSON list (default ["*"]).'
    )
    _flag(
        group, "allowed-headers", metavar="JSON", help='CORS: allowed headers, a JSON list (default ["*"]).'
    )
    _flag(group, "allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth).")
    _flag(
        group,
        "disable-fastapi-docs",
        action="store_true",
        help="Do not serve /docs, /redoc and /openapi.json.",
    )
    _flag(
        group,
        "h11-max-incomplete-event-size",
        type=int,
        metavar="BYTES",
        help="Largest incomplete HTTP event (headers) the h11 parser buffers (default: uvicorn's).",
    )
    _flag(
        group,
        "middleware",
        action="append",
        default=[],
        metavar="IMPORT.PATH",
        help="ASGI middleware to add, by import path (repeat for several): a class is added with "
        "app.add_middleware, an async function with @app.middleware('http'), as vLLM does.",
    )
    _flag(
        group,
        "enable-server-load-tracking",
        action="store_true",
        help="Count the requests being served on the generation and embedding routes; GET /load reports it.",
    )
    _flag(
        group,
        "enable-request-id-headers",
        action="store_true",
        help="Answer every request with an X-Request-Id header: the request's own, else a fresh id.",
    )
    _flag(
        group,
        "disable-access-log-for-endpoints",
        metavar="PATHS",
        help="Comma-separated paths left out of the access log, e.g. /health,/metrics.",
    )


def http_options_from_cli(args: argparse.Namespace) -> HttpOptions:
    """HttpOptions from the parsed `kvllm serve` flags."""
    cors_given = (
        any(v is not None for v in (args.allowed_origins, args.allowed_methods, args.allowed_headers))
        or args.allow_credentials
    )
    lists = {
        name: parse_json_list(f"--{name.replace('_', '-')}", getattr(args, name))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers")
        if getattr(args, name) is not None
    }
    if cors_given:
        lists.setdefault("allowed_origins", ("*",))
    endpoints = tuple(
        p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()
    )
    if args.middleware:  # fail before the model loads
        from kvllm.entrypoints.openai.http_options import resolve_middleware

        for path in args.middleware:
            resolve_middleware(path)
    return HttpOptions(
        uds=args.uds,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        allow_credentials=args.allow_credentials,
        disable_fastapi_docs=args.disable_fastapi_docs,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        disable_access_log_for_endpoints=endpoints,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        middleware=tuple(args.middleware),
        **lists,
    )


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
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


def chat_defaults_from_cli(args: argparse.Namespace) -> ChatTemplateDefaults:
    """ChatTemplateDefaults from the flags `add_chat_flags` added."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes for Qwen3)")
    return ChatTemplateDefaults.from_cli(
        args.chat_template,
        args.default_chat_template_kwargs,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        content_format=args.chat_template_content_format,
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_api_key(flag: str | list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The accepted keys: --api-key's, else KVLLM_API_KEY, else VLLM_API_KEY (a vLLM user's setting must
    not open the server)."""
    keys = [flag] if isinstance(flag, str) else list(flag or [])
    if keys:
        if not all(keys):
            raise ValueError("--api-key got an empty key; allowed: one or more non-empty keys")
        return tuple(keys)
    if environ.get("KVLLM_API_KEY"):
        return (environ["KVLLM_API_KEY"],)
    if environ.get("VLLM_API_KEY"):
        logger.info("Using the API key from VLLM_API_KEY")
        return (environ["VLLM_API_KEY"],)
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
    chat_defaults = chat_defaults_from_cli(args)
    http = http_options_from_cli(args)
    log_stats_interval = 0.0 if engine_args.disable_log_stats else args.log_stats_interval
    from kvllm.entrypoints.openai.server import run_server

    return run_server(
        engine_args,
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args.api_key, os.environ),
        served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=log_stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        limits=limits,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
        http=http,
        chat_defaults=chat_defaults,
        response_options=response_options_from_cli(args),
        request_logger=request_logger_from_cli(args),
    )
