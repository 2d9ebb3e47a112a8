"""`kvllm run-batch`: answer an OpenAI Batch API file offline (see kvllm.entrypoints.openai.run_batch)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli
from kvllm.entrypoints.cli.serve import (
    add_chat_flags,
    add_limit_flags,
    add_request_log_flags,
    add_response_flags,
    add_served_model_name_flag,
    chat_defaults_from_cli,
    request_logger_from_cli,
    response_options_from_cli,
)
from kvllm.logger import init_logger

logger = init_logger(__name__)


def register(subparsers: Any) -> None:
    """Add the `run-batch` subcommand."""
    parser = subparsers.add_parser(
        "run-batch",
        parents=[engine_arg_parser()],
        allow_abbrev=False,
        help="Answer a file of OpenAI Batch API requests (JSONL) without a server.",
        description="Answer a file of OpenAI Batch API requests (one JSON object per line: custom_id, method "
        "POST, url, body) through the server's routes in-process, writing one answer per line in input "
        "order, as vLLM's run-batch does. URLs served: /v1/chat/completions, /v1/completions, "
        "/v1/embeddings, /v1/responses.",
    )
    batch = parser.add_argument_group("batch")
    batch.add_argument(
        "-i",
        "--input-file",
        "--input_file",
        dest="input_file",
        required=True,
        help="The requests: a local JSONL path, or an http(s) URL to GET.",
    )
    batch.add_argument(
        "-o",
        "--output-file",
        "--output_file",
        dest="output_file",
        required=True,
        help="Where the answers go: a local path, or an http(s) URL to PUT the file to once complete.",
    )
    batch.add_argument(
        "--output-tmp-dir",
        "--output_tmp_dir",
        dest="output_tmp_dir",
        default=None,
        help="The folder for the output before it is PUT to an output URL (default: the system's).",
    )
    add_served_model_name_flag(batch)
    batch.add_argument(
        "--max-concurrent-requests",
        dest="max_concurrent_requests",
        type=int,
        default=None,
        help="Requests in the engine at once (default: twice --max-num-seqs, as vLLM's runner).",
    )
    batch.add_argument(
        "--enable-metrics",
        "--enable_metrics",
        dest="enable_metrics",
        action="store_true",
        help="Serve Prometheus metrics at --url:--port while the batch runs.",
    )
    batch.add_argument(
        "--url",
        default="0.0.0.0",
        help="Address of the metrics server (with --enable-metrics; default 0.0.0.0).",
    )
    batch.add_argument(
        "--port",
        type=int,
        default=8000,
        help="Port of the metrics server (with --enable-metrics; default 8000).",
    )
    batch.add_argument(
        "--disable-progress-bar",
        dest="disable_progress_bar",
        action="store_true",
        help="Do not show the progress bar.",
    )
    add_chat_flags(batch)
    add_response_flags(batch)
    add_request_log_flags(batch)
    add_limit_flags(parser)
    parser.set_defaults(dispatch=run)


def run(args: argparse.Namespace) -> int:
    """Answer the batch; 0 when every request got an answer line (refusals included), 1 when the engine
    failed during the run."""
    from prometheus_client import start_http_server

    from kvllm.config.serving import ServingLimits
    from kvllm.entrypoints.openai import run_batch as batch
    from kvllm.entrypoints.openai.server import build_app

    engine_args = engine_args_from_cli(args)
    limits = ServingLimits.from_kwargs(vars(args))
    chat_defaults = chat_defaults_from_cli(args)
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise ValueError(
            f"--max-concurrent-requests {args.max_concurrent_requests} is not valid; allowed: >= 1"
        )
    if args.enable_metrics and not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is not valid; allowed: 1 to 65535")
    if (
        not batch.is_url(args.output_file)
        and Path(args.output_file).resolve() == Path(args.input_file).resolve()
    ):
        raise ValueError(
            "--output-file is the input file; give another path (the input is read while answering)"
        )
    with batch.local_input(args.input_file) as input_path:
        total = batch.check_batch_file(input_path)  # every line checked before the model loads
        logger.info("%d requests in %s", total, args.input_file)
        app = build_app(
            engine_args,
            served_model_name=args.served_model_name,
            log_stats_interval=0,
            limits=limits,
            chat_defaults=chat_defaults,
            response_options=response_options_from_cli(args),
            request_logger=request_logger_from_cli(args),
        )
        if args.enable_metrics:
            start_http_server(args.port, addr=args.url, registry=app.state.registry)
            logger.info("Prometheus metrics at http://%s:%d/metrics", args.url, args.port)
        max_in_flight = args.max_concurrent_requests or 2 * app.state.llm.engine.args.max_num_seqs
        with batch.output_target(args.output_file, args.output_tmp_dir) as out:
            summary = asyncio.run(
                batch.run_batch_app(
                    app, input_path, out, total, max_in_flight, show_progress=not args.disable_progress_bar
                )
            )
    refused = ", ".join(f"{n} x {status}" for status, n in sorted(summary.statuses.items()) if status != 200)
    logger.info(
        "Batch done: %d of %d requests answered with 200%s; answers in %s",
        summary.succeeded,
        summary.total,
        f", the others with errors ({refused})" if refused else "",
        args.output_file,
    )
    if summary.engine_failed:
        logger.error(
            "The engine failed during the batch: the answers after its failure are errors (exit code 1)"
        )
        return 1
    return 0
