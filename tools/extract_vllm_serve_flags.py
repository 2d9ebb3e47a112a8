"""Write the option strings of vLLM's `serve` parser, read from vLLM's source (no vLLM import).

    python tools/extract_vllm_serve_flags.py /path/to/site-packages/vllm > tests/data/vllm_serve_flags.txt

Sources, as `vllm serve` builds its parser (vllm/entrypoints/openai/cli_args.py: make_arg_parser):
- every `add_argument("--x", "-y", ...)` literal in make_arg_parser and in EngineArgs.add_cli_args /
  AsyncEngineArgs.add_cli_args (vllm/engine/arg_utils.py);
- one `--field-name` per field of BaseFrontendArgs and FrontendArgs (cli_args.py), which vLLM turns
  into flags with `--{name.replace('_', '-')}`.
One line per flag: the long name, then its short aliases, space-separated. `--no-X` forms of boolean
flags are not listed: they are the same flag.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ADD_ARGUMENT = re.compile(r"add_argument\(\s*((?:\"-[^\"]+\",\s*)+)")
_OPTION = re.compile(r"\"(-[^\"]+)\"")
_FIELD = re.compile(r"^    ([a-z_][a-z0-9_]*): ", re.MULTILINE)


def _function_body(source: str, header: str) -> str:
    start = source.index(header)
    indent = len(source[:start].rsplit("\n", 1)[-1])
    end = re.compile(rf"^ {{0,{indent}}}\S", re.MULTILINE).search(source, source.index("\n", start) + 1)
    return source[start : end.start() if end else len(source)]


def _class_body(source: str, name: str) -> str:
    start = source.index(f"class {name}(") if f"class {name}(" in source else source.index(f"class {name}:")
    end = re.compile(r"^\S", re.MULTILINE).search(source, source.index("\n", start) + 1)
    body = source[start : end.start() if end else len(source)]
    return body.split("    @classmethod", 1)[0]


def extract(vllm_dir: Path) -> list[tuple[str, ...]]:
    """(long flag, *aliases) for every option of `vllm serve`, in the order vLLM adds them."""
    cli_args = (vllm_dir / "entrypoints/openai/cli_args.py").read_text()
    arg_utils = (vllm_dir / "engine/arg_utils.py").read_text()
    bodies = [_function_body(cli_args, "def make_arg_parser(")]
    frontend = [_class_body(cli_args, "BaseFrontendArgs"), _class_body(cli_args, "FrontendArgs")]
    engine = [body for body in arg_utils.split("def add_cli_args(")[1:]]
    flags: list[tuple[str, ...]] = []
    for body in bodies:
        flags += [tuple(_OPTION.findall(m.group(1))) for m in _ADD_ARGUMENT.finditer(body)]
    for body in frontend:
        flags += [(f"--{name.replace('_', '-')}",) for name in _FIELD.findall(body)]
    for body in engine:
        body = body.split("\n    def ", 1)[0].split("\n    @classmethod", 1)[0]
        flags += [tuple(_OPTION.findall(m.group(1))) for m in _ADD_ARGUMENT.finditer(body)]
    out: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for names in flags:
        long = next(n for n in names if n.startswith("--"))
        if long not in seen:
            seen.add(long)
            out.append((long, *(n for n in names if n != long)))
    return out


if __name__ == "__main__":
    for names in extract(Path(sys.argv[1])):
        print(" ".join(names))
