"""`kvllm bench {latency,throughput,serve,attention}`: the benchmarks, with the shared engine arguments.

latency, throughput and serve take every engine argument (`--attention-backend`, `-ac.KEY VALUE`,
`--dtype`, `--load-format dummy`, ...), so backends and settings compare end to end. attention
passes its arguments on to the kernel benchmark, kvllm/benchmarks/attention/.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_kwargs_from_cli

ATTENTION_KERNELS_MODULE = "kvllm.benchmarks.attention.main"


def register(subparsers: Any) -> None:
    """Add the `bench` subcommand and its four benchmarks."""
    from kvllm.benchmarks import latency, serve, throughput

    parser = subparsers.add_parser(
        "bench",
        allow_abbrev=False,
        help="Benchmark latency, throughput, a server, or attention kernels.",
        description=__doc__.split("\n\n")[0],
    )
    benches = parser.add_subparsers(title="benchmarks", dest="bench_command", metavar="BENCHMARK")
    parser.set_defaults(dispatch=lambda _args: _print_help(parser))

    for name, module, run, text in (
        (
            "latency",
            latency,
            run_latency,
            "Latency of one batch end to end (vLLM's flags), prefill and decode rates.",
        ),
        (
            "throughput",
            throughput,
            run_throughput,
            "Offline throughput of kvllm or HF transformers on one workload.",
        ),
        (
            "serve",
            serve,
            run_serve,
            "Streaming client benchmark of an OpenAI-compatible server: TTFT, TPOT, ITL.",
        ),
    ):
        sub = benches.add_parser(
            name,
            parents=[engine_arg_parser()],
            allow_abbrev=False,
            help=text,
            description=module.__doc__.split("\n\n")[0],
        )
        module.add_cli_args(sub)
        sub.set_defaults(dispatch=run)

    attention = benches.add_parser(
        "attention",
        add_help=False,
        prefix_chars="\0",
        help="Attention kernels: every backend valid here "
        "and the reference kernels, correctness before timing (arguments go to the kernel benchmark).",
    )
    attention.add_argument("kernel_args", nargs=argparse.REMAINDER)
    attention.set_defaults(dispatch=run_attention)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_latency(args: argparse.Namespace) -> int:
    from kvllm.benchmarks import latency
    from kvllm.benchmarks.backend_flag import apply_latency_backend_alias

    apply_latency_backend_alias(args)
    return latency.main(args, engine_kwargs_from_cli(args))


def run_throughput(args: argparse.Namespace) -> int:
    from kvllm.benchmarks import throughput
    from kvllm.benchmarks.backend_flag import check_throughput_backend

    check_throughput_backend(args.backend)
    return throughput.main(args, engine_kwargs_from_cli(args))


def run_serve(args: argparse.Namespace) -> int:
    from kvllm.benchmarks import serve
    from kvllm.benchmarks.server_launcher import launched_server

    engine_kwargs = engine_kwargs_from_cli(args)
    model, tokenizer = engine_kwargs.get("model"), engine_kwargs.get("tokenizer")
    seed = engine_kwargs.get("seed", 0)
    if args.launch_server:
        if args.base_url is not None:
            raise ValueError("--launch-server starts its own server; drop --base-url")
        with launched_server(engine_kwargs, args.server_timeout) as base_url:
            result = serve.benchmark(args, base_url, model, tokenizer, seed)
    else:
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        result = serve.benchmark(args, base_url, model, tokenizer, seed)
    print(serve.format_result(result, args))
    if args.save_result:
        serve.save(result, args)
    return 0 if result["completed"] else 1


def run_attention(args: argparse.Namespace) -> int:
    if importlib.util.find_spec(ATTENTION_KERNELS_MODULE) is None:
        raise ValueError(f"this build has no attention kernel benchmark ({ATTENTION_KERNELS_MODULE})")
    module = importlib.import_module(ATTENTION_KERNELS_MODULE)
    return int(module.main(list(args.kernel_args)) or 0)
