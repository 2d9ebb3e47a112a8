"""`kvllm backends`: which attention backend can serve this model here, and why the others cannot.

Reads the model's config (never its weights), builds the same selector config the engine uses,
and prints every registered backend with ✅/❌ and its reasons, the platform's priority order
and what automatic (and, if given, manual) selection picks. `--platform/--capability` simulate
another machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvllm.attention import registry
from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.config.backend_names import BackendName
from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_args_from_cli
from kvllm.platforms.interface import DeviceInfo


def register(subparsers: Any) -> None:
    """Add the `backends` subcommand."""
    parser = subparsers.add_parser(
        "backends",
        parents=[engine_arg_parser()],
        allow_abbrev=False,
        help="Show which attention backends can serve a model on this (or a simulated) machine.",
        description=__doc__.split("\n\n")[0],
    )
    sim = parser.add_argument_group("simulation")
    sim.add_argument(
        "--platform",
        choices=("cuda", "rocm", "cpu"),
        help="Simulate this platform instead of the current machine.",
    )
    sim.add_argument(
        "--capability",
        metavar="MAJOR.MINOR",
        help="CUDA compute capability to simulate, e.g. 9.0 (implies --platform cuda).",
    )
    tune = parser.add_argument_group("auto-tune")
    tune.add_argument(
        "--tune",
        action="store_true",
        help="Time every valid backend on this machine on the model's shapes (what --attention-backend "
        "auto-tune does at start-up) and print the table; reads and fills the same cache.",
    )
    tune.add_argument(
        "--tune-time-cap",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Hard cap on the timing run (default: the engine's).",
    )
    tune.add_argument(
        "--retune", action="store_true", help="Time again even if a cached table exists (and overwrite it)."
    )
    tune.add_argument("--tune-json", metavar="PATH", help="Also write the table as JSON to PATH.")
    parser.set_defaults(dispatch=run)


def resolve_device(platform: str | None, capability: str | None) -> DeviceInfo:
    """The simulated device from --platform/--capability, or this machine's."""
    from kvllm.platforms import current_device_info, make_device_info

    if platform is None and capability is None:
        return current_device_info()
    return make_device_info(platform or "cuda", capability)


def resolve_model(model: str | None) -> str:
    """The model to describe: the user's, else the engine's default model folder."""
    if model is not None:
        return model
    try:
        from kvllm.models.default_model import default_model_path
    except ImportError as exc:
        raise ValueError(
            f"no default model in this build ({exc}); pass a model folder: kvllm backends MODEL"
        ) from None
    return str(default_model_path())


def backends_report(
    model: str,
    config: AttentionSelectorConfig,
    device: DeviceInfo,
    requested: BackendName | None = None,
    simulated: bool = False,
    mla_head_dims: tuple[int, int] | None = None,
    model_problem: str | None = None,
) -> str:
    """The text `kvllm backends` prints (selection itself logs to stderr). `model_problem`: why kvllm
    cannot load the model at all (then no backend is reported as simply "valid")."""
    from kvllm.attention.selector import NOT_IMPLEMENTED, backend_reasons, choose_attention_backend
    from kvllm.platforms import backend_priority, is_simulated

    lines = [
        f"Platform: {device.describe()}{' (simulated)' if simulated or is_simulated() else ''}",
        f"Model: {model}",
        f"Attention needs: {config}",
        *([f"Model support: ❌ kvllm cannot load this model: {model_problem}"] if model_problem else []),
        "",
        "Registered attention backends:",
    ]
    full_priority = backend_priority(device, config.use_mla, registered_only=False)
    in_priority = {n.name for n in full_priority}
    width = max(len(n) for n in registry.registered_backend_names())
    for name in registry.registered_backend_names():
        reasons = backend_reasons(name, config, device)
        if reasons:
            lines.append(f"  ❌ {name:<{width}}  " + "; ".join(reasons))
        elif model_problem:
            lines.append(f"  ⚠️ {name:<{width}}  attention valid, but kvllm cannot load the model (see above)")
        elif name in in_priority:
            lines.append(f"  ✅ {name:<{width}}  valid")
        else:
            lines.append(
                f"  ✅ {name:<{width}}  valid, but only when selected by name "
                f"(not in {device.platform}'s priority list)"
            )
    kind = "MLA" if config.use_mla else "standard"
    lines += ["", f"Priority order for {kind} attention on {device.describe()} (1 = tried first):"]
    for i, name in enumerate(full_priority, 1):
        note = "" if registry.is_registered(name.name) else f"  ({NOT_IMPLEMENTED})"
        lines.append(f"  {i}. {name.name}{note}")
    lines.append("")
    if model_problem:
        lines.append(f"Automatic selection: none. kvllm cannot load this model: {model_problem}")
        return "\n".join(lines)
    try:
        choice = choose_attention_backend(config, device)
        lines.append(f"Automatic selection: {choice.backend.name} (block size {choice.block_size})")
    except ValueError as exc:
        lines.append(f"Automatic selection: none. {exc}")
    if requested is not None:
        try:
            choice = choose_attention_backend(config, device, requested)
            lines.append(f"Your selection: {requested.name} is valid (block size {choice.block_size})")
        except ValueError as exc:
            lines.append(f"Your selection: {exc}")
    if config.use_mla:
        lines += mla_prefill_lines(config, device, mla_head_dims)
    return "\n".join(lines)


def mla_prefill_lines(
    config: AttentionSelectorConfig, device: DeviceInfo, head_dims: tuple[int, int] | None = None
) -> list[str]:
    """The MLA prefill backends in automatic order with their reasons, and which one would be used."""
    from kvllm.attention.backends.mla.prefill import DECLARATIONS, PRIORITY, choose_prefill_backend

    lines = ["", "MLA prefill backends (automatic order; -ac.mla_prefill_backend picks one):"]
    for i, name in enumerate(PRIORITY, 1):
        reasons = DECLARATIONS[name].reasons(device, config.dtype, head_dims)
        lines.append(f"  {i}. {'❌' if reasons else '✅'} {name:<14} " + ("; ".join(reasons) or "valid"))
    try:
        lines.append(
            f"MLA prefill selection: {choose_prefill_backend(device, config.dtype, None, head_dims).name}"
        )
    except ValueError as exc:
        lines.append(f"MLA prefill selection: none. {exc}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit code 1 when neither automatic nor requested selection would work."""
    from kvllm.attention.selector import choose_attention_backend
    from kvllm.config.backend_names import is_auto_tune
    from kvllm.models.hf_config import load_hf_config, selector_config_from_hf_config
    from kvllm.models.registry import unsupported_model_reason

    engine_args = engine_args_from_cli(args)
    if args.tune or is_auto_tune(engine_args.backend):
        if args.platform is not None or args.capability is not None:
            raise ValueError("--tune times backends on this machine; leave out --platform/--capability")
        return run_tune(engine_args, args.tune_time_cap, args.retune, args.tune_json)
    device = resolve_device(args.platform, args.capability)
    model = resolve_model(engine_args.model)
    hf_config = load_hf_config(model, engine_args.trust_remote_code, engine_args.revision)
    config = selector_config_from_hf_config(
        hf_config,
        device,
        dtype=engine_args.dtype,
        kv_cache_dtype=engine_args.kv_cache_dtype,
        block_size=engine_args.block_size,
        attention_config=engine_args.attention_config,
    )
    simulated = args.platform is not None or args.capability is not None
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    mla_head_dims = None
    if config.use_mla:
        mla_head_dims = (text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim)
    model_problem = unsupported_model_reason(hf_config)
    print(
        backends_report(
            model, config, device, engine_args.backend, simulated, mla_head_dims, model_problem=model_problem
        )
    )
    if model_problem:
        return 1
    try:
        choose_attention_backend(config, device, engine_args.backend)
    except ValueError:
        return 1
    return 0


def run_tune(engine_args: Any, time_cap_s: float | None, retune: bool, json_path: str | None) -> int:
    """`kvllm backends --tune`: the auto-tune table for the model on this machine (exit 1: nothing valid)."""
    from kvllm.attention.autotune import (
        DEFAULT_TIME_CAP_S,
        autotune_attention_backend,
        machine_name,
        model_shapes_from_engine,
    )
    from kvllm.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from kvllm.models.hf_config import selector_config_from_hf_config
    from kvllm.models.model_config import ModelConfig
    from kvllm.platforms import current_device_info, resolve_device
    from kvllm.utils.dtypes import dtype_name

    device = resolve_device(engine_args.device)
    engine_args = engine_args.with_changes(model=resolve_model(engine_args.model))
    model_config = ModelConfig.from_engine_args(engine_args, device)
    device_info = current_device_info()
    config = selector_config_from_hf_config(
        model_config.hf_config,
        device_info,
        dtype=dtype_name(model_config.dtype),
        kv_cache_dtype=engine_args.kv_cache_dtype,
        block_size=engine_args.block_size,
        attention_config=engine_args.attention_config,
    )
    # The engine's token budget (LLMEngine): the same shapes, so the same cache entry.
    tokens = engine_args.max_num_batched_tokens or (
        DEFAULT_MAX_NUM_BATCHED_TOKENS
        if engine_args.enable_chunked_prefill
        else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, model_config.max_model_len)
    )
    shapes = model_shapes_from_engine(model_config, engine_args, tokens)
    try:
        result = autotune_attention_backend(
            config, device_info, shapes, device,
            time_cap_s=DEFAULT_TIME_CAP_S if time_cap_s is None else time_cap_s, refresh=retune,
        )  # fmt: skip
    except ValueError as exc:
        print(f"auto-tune: {exc}")
        return 1
    print(f"Model: {model_config.model}\nAttention needs: {config}\n")
    print(result.format_table())
    if json_path:
        report = {"model": model_config.model, "config": str(config), "device": machine_name(device),
                  **result.to_json()}  # fmt: skip
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 0
