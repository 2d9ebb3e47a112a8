"""The `kvllm` command: subcommands plugged in from their own modules.

Each module in SUBCOMMAND_MODULES defines `register(subparsers)`, which adds its parser (with
`parents=[engine_arg_parser()]` when it takes engine arguments) and sets `dispatch=<callable>`
taking the parsed namespace and returning an exit code. Modules not present in this build
(e.g. serve before the server exists) are skipped.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from kvllm.entrypoints.cli.engine_args import preprocess_argv

SUBCOMMAND_MODULES: list[str] = [
    "kvllm.entrypoints.cli.serve",
    "kvllm.entrypoints.cli.generate",
    "kvllm.entrypoints.cli.bench",
    "kvllm.entrypoints.cli.backends",
    "kvllm.entrypoints.cli.collect_env",
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    from kvllm import __version__

    parser = argparse.ArgumentParser(
        prog="kvllm",
        description="kvllm: LLM inference and serving with self-explaining attention backends.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvllm {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvllm` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(preprocess_argv(argv))
        if getattr(args, "dispatch", None) is None:
            parser.print_help()
            return 2
        return int(args.dispatch(args) or 0)
    except ValueError as exc:
        # User errors are ValueErrors with a message that says what to do.
        if os.environ.get("KVLLM_TRACEBACK") == "1":
            raise
        print(f"kvllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
