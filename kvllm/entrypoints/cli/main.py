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

from kvllm.entrypoints.cli.config_file import expand_config_file
from kvllm.entrypoints.cli.engine_args import preprocess_argv
from kvllm.entrypoints.cli.vllm_flags import check_unsupported_flags

SUBCOMMAND_MODULES: list[str] = [
    "kvllm.entrypoints.cli.serve",
    "kvllm.entrypoints.cli.generate",
    "kvllm.entrypoints.cli.bench",
    "kvllm.entrypoints.cli.backends",
    "kvllm.entrypoints.cli.collect_env",
    "kvllm.entrypoints.cli.run_batch",
    "kvllm.entrypoints.cli.client",
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
        args = parser.parse_args(preprocess_argv(expand_config_file(argv, _option_strings(parser, argv))))
        check_unsupported_flags(args)
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


def _option_strings(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings of the subcommand `argv` starts with (for --config's false values)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None or not argv or argv[0] not in sub.choices:
        return set()
    return set(sub.choices[argv[0]]._option_string_actions)


if __name__ == "__main__":
    sys.exit(main())
