"""`--config FILE.yaml`: flags read from a YAML file, with vLLM's semantics.

Keys are flag names without dashes (`tensor-parallel-size: 1`, `max_model_len: 32k`); values are
flag values: `true` gives the bare flag, a list gives its items, a mapping gives JSON. The file's
flags go right after the subcommand (and the model, when the command line has one, which then
wins over the file's `model`), so flags on the command line come later and win. One difference, on purpose: `false` gives `--no-KEY` where
the flag has that form (vLLM drops false values, so `enable-prefix-caching: false` would do
nothing there); for flags without it, false is their default and is dropped, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any


def expand_config_file(argv: list[str], known_options: Collection[str]) -> list[str]:
    """`argv` with `--config FILE` (or `--config=FILE`) replaced by the flags in FILE."""
    positions = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not positions:
        return argv
    if len(positions) > 1:
        raise ValueError("--config is given more than once; give one YAML file")
    index = positions[0]
    if argv[index] == "--config":
        if index + 1 >= len(argv):
            raise ValueError("--config needs a file: --config FILE.yaml")
        path, rest = argv[index + 1], argv[index + 2 :]
    else:
        path, rest = argv[index].partition("=")[2], argv[index + 1 :]
    before = argv[:index]
    from_file = config_file_args(path, known_options)
    # [subcommand] [model] FILE-FLAGS CLI-FLAGS: the command line keeps the last word.
    head = 0
    if before and not before[0].startswith("-"):
        head = 1
        if len(before) > 1 and not before[1].startswith("-"):
            head = 2  # a positional model: it wins over the file's `model`, as in vLLM
            from_file = _without_model(from_file)
    return before[:head] + from_file + before[head:] + rest


def _without_model(words: list[str]) -> list[str]:
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--model":
            skip = True
        elif not word.startswith("--model="):
            out.append(word)
    return out


def config_file_args(path: str, known_options: Collection[str]) -> list[str]:
    """The flags a YAML config file stands for, as command-line words."""
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        raise ValueError(f"--config {path!r}: the config file must be YAML (.yaml or .yml)")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--config {path!r}: cannot read the file ({exc.strerror or exc})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path!r} is not valid YAML: {exc}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(
            f"--config {path!r} must hold a mapping of flag names to values (e.g. 'port: 8000'), "
            f"not a {type(config).__name__}"
        )
    words: list[str] = []
    for key, value in config.items():
        if not isinstance(key, str) or not key or key.startswith("-"):
            raise ValueError(f"--config {path!r}: key {key!r} is not a flag name (write e.g. max-model-len)")
        flag = f"--{key}"
        if isinstance(value, bool):
            negated = f"--no-{key}"
            if value:
                words.append(flag)
            elif negated in known_options or negated.replace("_", "-") in known_options:
                words.append(negated)
        elif isinstance(value, list):
            if value:
                words += [flag, *(_word(v) for v in value)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        elif value is None:
            continue
        else:
            words += [flag, _word(value)]
    return words


def _word(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)
