"""The engine-argument parser shared by every subcommand, generated from the EngineArgs fields.

Flags come from the dataclass fields (help from field metadata), so the CLI, `LLM(...)` keyword
arguments and the docs cannot drift. Every flag accepts `-` and `_` spellings; booleans come as
`--flag/--no-flag`; the model is an optional positional or `--model`.

Attention settings, two mutually exclusive ways (EngineArgs checks the exclusion):
`--attention-backend X`, or `--attention-config JSON` / `-ac JSON` / `--attention-config.KEY VALUE` /
`-ac.KEY VALUE` / `-ac.KEY=VALUE`. Dotted forms are rewritten into JSON by `preprocess_argv`
before argparse sees them, for every JSON flag as vLLM does (`-cc.cudagraph_mode NONE`,
`--hf-overrides.rope_theta 1e6`); all items of one flag merge in order (later keys win).

vLLM's other flags are in kvllm.entrypoints.cli.vllm_flags: the ones kvllm cannot honour get
hidden entries that fail with the reason. Sizes take vLLM's human-readable forms (`32k`, `1G`).
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from kvllm.config.attention import AttentionConfig
from kvllm.config.backend_names import BackendName
from kvllm.config.engine import MODEL_PROPERTY_ARGS, EngineArgs, model_property_error
from kvllm.config.sizes import parse_human_int, parse_human_int_or_auto
from kvllm.entrypoints.cli.vllm_flags import (
    ALIASES,
    ENGINE_FLAGS,
    FRONTEND_FLAGS,
    Unsupported,
    add_unsupported_flags,
    check_unsupported_flags,
)

# Flags whose value is a JSON object, so `--FLAG.KEY VALUE` means `--FLAG '{"KEY": VALUE}'`.
_JSON_FLAGS = {"--attention-config", "--compilation-config", "--hf-overrides", "--override-generation-config"}
_JSON_FLAGS |= {flag for flag in {**ENGINE_FLAGS, **FRONTEND_FLAGS} if flag.endswith("-config")}
_JSON_FLAGS -= {"--config", "--generation-config"}  # a file path and a word, not JSON


def _json_flag(name: str) -> str | None:
    """The long JSON flag that `name` (`-ac`, `--hf_overrides`, `--attention-config`) spells, if any;
    vLLM's unsupported flags that take a value count too, so `--limit-mm-per-prompt.image 2` gets
    their reason."""
    if not name.startswith("--"):
        name = ALIASES.get(name, "")
    name = "--" + name[2:].replace("_", "-")
    rule = ENGINE_FLAGS.get(name) or FRONTEND_FLAGS.get(name)
    unsupported = isinstance(rule, Unsupported) and not rule.boolean and not rule.engine_field
    return name if name in _JSON_FLAGS or unsupported else None


def preprocess_argv(argv: list[str]) -> list[str]:
    """vLLM's rewrites before argparse: dotted JSON keys (`-ac.KEY VALUE`, `-cc.KEY=VALUE`,
    `--hf-overrides.a.b VALUE`) into `--FLAG JSON`, and `-O3` / `-O=3` into `-O 3`."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out.extend(argv[i:])
            break
        if token.startswith("-O") and len(token) > 2 and not token.startswith("--"):
            out += ["-O", token[3:] if token[2] == "=" else token[2:]]
            i += 1
            continue
        name, dot, rest = token.partition(".")
        flag = _json_flag(name) if dot and token.startswith("-") else None
        if flag is None:
            out.append(token)
            i += 1
            continue
        keys, eq, value = rest.partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{token} needs a value, e.g. {token} VALUE or {token}=VALUE")
            value = argv[i + 1]
            i += 1
        if not keys or "" in keys.split("."):
            raise ValueError(f"{token!r} names no key of {flag}; use e.g. {name}.KEY VALUE")
        nested: Any = _json_or_text(value)
        for key in reversed(keys.split(".")):
            nested = {key: nested}
        out += [flag, json.dumps(nested)]
        i += 1
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


_SIZE_PARSERS = {"size": parse_human_int, "size_or_auto": parse_human_int_or_auto}


def _unwrap_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return functools.reduce(operator.or_, args)
    return hint


def _help_with_default(f: Any) -> str:
    text = f.metadata.get("help", "")
    if f.default is not MISSING and f.default is not None and not isinstance(f.default, bool):
        text += f" (default: {f.default})"
    return text


def add_engine_args(
    parser: argparse.ArgumentParser, positional_model: bool = True
) -> argparse.ArgumentParser:
    """Add one flag per EngineArgs field to `parser`; unset flags stay out of the namespace.

    With `positional_model`, the model may also be given as the first positional argument
    (`kvllm serve MODEL`); commands whose positional is something else pass False.
    """
    group = parser.add_argument_group("engine arguments", "Settings of the engine (see EngineArgs).")
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        flags += list(f.metadata.get("aliases", ()))
        common: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": _help_with_default(f)}
        hint = _unwrap_optional(hints[f.name])
        parse = f.metadata.get("parse")
        if f.name == "model" and positional_model:
            group.add_argument(
                "model_tag",
                nargs="?",
                default=argparse.SUPPRESS,
                metavar="MODEL",
                help="Model (same as --model). Default: the embedded SmolLM2-135M-Instruct.",
            )
            group.add_argument(*flags, **common)
        elif f.name == "attention_config":
            group.add_argument(
                *flags,
                "-ac",
                action="append",
                metavar="JSON|KEY=VALUE",
                **{
                    **common,
                    "help": f"{f.metadata.get('help', '')} Fields: "
                    + ", ".join(AttentionConfig.__dataclass_fields__)
                    + ". Use --attention-config.KEY VALUE or -ac.KEY=VALUE for one field.",
                },
            )
        elif hint is bool:
            default = "on" if f.default else "off"
            group.add_argument(
                *flags,
                action=argparse.BooleanOptionalAction,
                **{
                    **common,
                    "help": f"{common['help']} (default: {default})",
                },
            )
        elif hint == BackendName:
            group.add_argument(*flags, metavar="NAME", **common)
        elif parse in ("size", "size_or_auto"):
            # Converted in engine_kwargs_from_cli, so a bad size is a one-line error, not a usage dump.
            group.add_argument(*flags, metavar="N", **common)
        elif parse == "json":
            group.add_argument(*flags, action="append", metavar="JSON", **common)
        elif hint in (int, float, str):
            group.add_argument(*flags, type=hint, **common)
        elif hint == list[int]:
            group.add_argument(*flags, type=int, nargs="+", metavar="N", **common)
        else:
            raise TypeError(f"EngineArgs.{f.name}: no CLI mapping for type {hint!r}; extend add_engine_args")
    # Hidden flags for model properties (e.g. a guide's "--num-heads 32 --head-dim 128"): argparse
    # would only say "unrecognized arguments"; these say why they cannot be set.
    for name in MODEL_PROPERTY_ARGS:
        flags = [f"--{name.replace('_', '-')}", f"--{name}"]
        group.add_argument(
            *dict.fromkeys(flags),
            dest=f"_model_property_{name}",
            nargs="?",
            action=_ModelPropertyFlag,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    add_unsupported_flags(group, ENGINE_FLAGS)
    return parser


class _ModelPropertyFlag(argparse.Action):
    """Rejects a model-property flag with the reason (raised as ValueError: `kvllm: error: ...`)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        name = self.dest.removeprefix("_model_property_")
        raise model_property_error(name, values if values is not None else "", flag=True)


def engine_arg_parser(positional_model: bool = True) -> argparse.ArgumentParser:
    """A parent parser holding the engine arguments: `add_parser(..., parents=[engine_arg_parser()])`."""
    return add_engine_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False), positional_model)


def engine_kwargs_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs keyword arguments the user set on the command line (validated).

    Raises ValueError with the user-facing message for invalid values, including
    `attention_backend and attention_config.backend are mutually exclusive`.
    """
    check_unsupported_flags(args)
    kwargs: dict[str, Any] = {}
    parse = {f.name: f.metadata.get("parse") for f in fields(EngineArgs)}
    for name in EngineArgs.field_names():
        if hasattr(args, name):
            kwargs[name] = value = getattr(args, name)
            flag = f"--{name.replace('_', '-')}"
            if parse[name] == "json":
                kwargs[name] = merge_json_objects(flag, value)
            elif parse[name] in _SIZE_PARSERS and isinstance(value, str):
                kwargs[name] = _SIZE_PARSERS[parse[name]](value, flag)
    positional = getattr(args, "model_tag", None)
    if positional is not None:
        if kwargs.get("model") not in (None, positional):
            raise ValueError(
                f"model given twice ({positional!r} and --model {kwargs['model']!r}); give it once"
            )
        kwargs["model"] = positional
    if "attention_config" in kwargs:
        kwargs["attention_config"] = merge_attention_config(kwargs["attention_config"])
    EngineArgs(**kwargs)  # validates, with the same messages as the Python API
    return kwargs


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from a namespace parsed with the engine arguments (serve and bench reuse this)."""
    return EngineArgs(**engine_kwargs_from_cli(args))


def merge_json_objects(flag: str, items: list[str]) -> dict[str, Any]:
    """Merge the JSON objects given to one flag, in order; nested objects merge key by key."""
    merged: dict[str, Any] = {}
    for item in items:
        try:
            data = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {item!r} is not valid JSON ({exc.msg}); write a JSON object") from None
        if not isinstance(data, dict):
            raise ValueError(f"{flag} {item!r} must be a JSON object such as '{{\"key\": 1}}'")
        _deep_update(merged, data)
    return merged


def _deep_update(target: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def merge_attention_config(items: list[str]) -> AttentionConfig:
    """Merge `-ac` values (JSON objects, in order; later keys win) into one AttentionConfig."""
    merged: dict[str, Any] = {}
    for item in items:
        try:
            data = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--attention-config {item!r} is not valid JSON ({exc.msg}); write it as "
                """'{"backend": "FLASH_ATTN"}' or use -ac.backend FLASH_ATTN"""
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f'--attention-config {item!r} must be a JSON object such as \'{{"backend": "X"}}\''
            )
        merged.update(data)
    return AttentionConfig.from_dict(merged)
