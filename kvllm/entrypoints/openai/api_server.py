"""`python -m kvllm.entrypoints.openai.api_server --model M ...`: vLLM's module entry point.

The same server, flags and exit codes as `kvllm serve M ...` (kvllm.entrypoints.cli.serve), so a
deployment that starts vLLM's API server module starts kvllm's by changing the package name.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvllm.entrypoints.cli.main import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvllm serve` with these arguments (default: the command line's); returns the exit code."""
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
