"""Attention backend selection: manual choices are validated, automatic ones walk the priority list.

A manual choice is honoured or fails with every reason; it is never silently replaced, on any
platform. The automatic choice logs at INFO which backend it took and why every higher-priority
backend was rejected. Choices are cached per (config, device, requested).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvllm.attention import registry
from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig
from kvllm.config.backend_names import AttentionBackendEnum, BackendName, is_auto_tune
from kvllm.logger import init_logger
from kvllm.platforms import backend_priority, get_platform
from kvllm.platforms.interface import DeviceInfo

logger = init_logger(__name__)

NOT_IMPLEMENTED = "not implemented in this build of kvllm"


@dataclass(frozen=True)
class BackendChoice:
    """The backend selection picked and the KV-cache block size to use with it."""

    backend: type[AttentionBackend]
    block_size: int


_cache: dict[tuple, BackendChoice] = {}


def backend_reasons(
    name: BackendName | str, config: AttentionSelectorConfig, device: DeviceInfo
) -> list[str]:
    """Every reason backend `name` cannot serve `config` on `device` (empty = valid).

    An unregistered name or a declarations module that fails to import is a reason, not a crash.
    """
    name = str(name)
    if not registry.is_registered(name):
        return [NOT_IMPLEMENTED]
    try:
        backend = registry.get_backend_class(name)
    except ImportError as exc:
        return [str(exc)]
    return backend.validate_configuration(config, device)


def choose_attention_backend(
    config: AttentionSelectorConfig, device: DeviceInfo, requested: BackendName | str | None = None
) -> BackendChoice:
    """Pick the attention backend for `config` on `device`.

    With `requested`, validate that backend and raise ValueError with its reasons if it cannot
    serve the configuration. Without, take the first valid backend of the platform's priority
    list, or raise ValueError listing every backend's reasons.
    """
    if requested is not None:
        requested = AttentionBackendEnum.from_name(requested)
        if is_auto_tune(requested):
            raise ValueError(
                "auto-tune is not a backend: it needs the model's shapes to time the valid backends; "
                "use kvllm.attention.autotune.autotune_attention_backend (the engine does)"
            )
    key = (config, device, requested, registry.generation())
    if key not in _cache:
        if requested is not None:
            _cache[key] = _choose_manual(config, device, requested)
        else:
            _cache[key] = _choose_automatic(config, device)
    return _cache[key]


def clear_selection_cache() -> None:
    """Forget cached choices (tests; or after changing installed packages at run time)."""
    _cache.clear()


def _block_size(backend: type[AttentionBackend], config: AttentionSelectorConfig) -> int:
    return config.block_size if config.block_size is not None else backend.preferred_block_size


def _choose_manual(
    config: AttentionSelectorConfig, device: DeviceInfo, requested: BackendName
) -> BackendChoice:
    if not registry.is_registered(requested.name):
        # An enum member with no implementation: the same error as an unknown name.
        AttentionBackendEnum.from_name(requested.name)
    reasons = backend_reasons(requested, config, device)
    if reasons:
        raise ValueError(
            f"Selected backend {requested.name} is not valid for this configuration. Reason: {reasons}"
            + _head_size_alternatives(config, device, requested.name, reasons)
        )
    backend = registry.get_backend_class(requested.name)
    logger.info("Using %s attention backend (selected by the user).", requested.name)
    return BackendChoice(backend, _block_size(backend, config))


def _head_size_alternatives(
    config: AttentionSelectorConfig, device: DeviceInfo, rejected: str, reasons: list[str]
) -> str:
    """When the head size is among the reasons: the registered backends whose declarations allow it,
    and which of them are valid for the whole configuration here."""
    if not any(r.startswith(f"head_size {config.head_size} ") for r in reasons):
        return ""
    allowing, valid = [], []
    for name in registry.registered_backend_names():
        if name == rejected:
            continue
        try:
            backend = registry.get_backend_class(name)
        except ImportError:
            continue
        if backend.is_mla == config.use_mla and backend.head_sizes.allows(config.head_size):
            allowing.append(f"{name} ({', '.join(backend.platforms)})")
            if not backend_reasons(name, config, device):
                valid.append(name)
    if not allowing:
        return f"\nNo registered backend supports head_size {config.head_size}."
    text = f"\nBackends that support head_size {config.head_size}: {', '.join(allowing)}."
    priority = [n.name for n in backend_priority(device, config.use_mla)]
    valid.sort(key=lambda n: priority.index(n) if n in priority else len(priority))
    if valid:
        text += f" Valid for this configuration: {', '.join(valid)} (e.g. --attention-backend {valid[0]})."
    else:
        text += " None of them is valid for the rest of this configuration here; see `kvllm backends`."
    return text


def _choose_automatic(config: AttentionSelectorConfig, device: DeviceInfo) -> BackendChoice:
    candidates = backend_priority(device, config.use_mla)
    rejected: dict[str, list[str]] = {}
    for name in candidates:
        reasons = backend_reasons(name, config, device)
        if reasons:
            rejected[name.name] = reasons
            continue
        backend = registry.get_backend_class(name.name)
        logger.info(
            "Using %s attention backend out of potential backends: %s",
            name.name,
            [c.name for c in candidates],
        )
        for other, other_reasons in rejected.items():
            logger.info(
                "Attention backend %s (higher priority) rejected: %s", other, "; ".join(other_reasons)
            )
        _warn_if_block_size_knocked_out(config, device, rejected, name.name)
        return BackendChoice(backend, _block_size(backend, config))
    # Name the unimplemented backends of the platform's list too, so the user sees the whole list.
    full = get_platform(device).backend_priority(device, config.use_mla)
    listing = ", ".join(f"{n.name}: {rejected.get(n.name, [NOT_IMPLEMENTED])}" for n in full)
    raise ValueError(
        f"No valid attention backend found for {device.describe()} with {config}. Reasons: {{{listing}}}. "
        "Change the configuration (e.g. --block-size, --kv-cache-dtype, --dtype) or run "
        "`kvllm backends` to see what each backend supports."
    )


def _warn_if_block_size_knocked_out(
    config: AttentionSelectorConfig, device: DeviceInfo, rejected: dict[str, list[str]], chosen: str
) -> None:
    if config.block_size is None or not rejected:
        return
    unpinned = replace(config, block_size=None)
    knocked_out = [name for name in rejected if not backend_reasons(name, unpinned, device)]
    if knocked_out:
        logger.warning(
            "block_size %d rules out higher-priority attention backend(s) %s; using %s instead. "
            "Leave --block-size unset to let the backend choose.",
            config.block_size,
            ", ".join(knocked_out),
            chosen,
        )


def explain_kv_cache_dtype(model_dtype: str, kv_cache_dtype: str, device: DeviceInfo) -> None:
    """Log the consequences of a KV-cache dtype choice (call once per engine).

    fp8 with a 16-bit model is an explicit accuracy-for-memory trade; on CUDA below SM 8.9 fp8
    saves memory but gives no speed-up (no native fp8 arithmetic there).
    """
    if not kv_cache_dtype.startswith("fp8"):
        return
    if model_dtype in ("float16", "bfloat16", "float32"):
        logger.warning(
            "Using an fp8 KV cache (%s) with a %s model: keys and values are stored in 8 bits, which halves "
            "KV-cache memory at some accuracy cost (larger with fp8_e5m2 and without calibrated k/v scales). "
            "Use --kv-cache-dtype auto to keep the model's precision.",
            kv_cache_dtype,
            model_dtype,
        )
    if device.platform == "cuda" and device.capability is not None and device.capability < (8, 9):
        major, minor = device.capability
        logger.warning(
            "fp8 KV cache on compute capability %d.%d (below 8.9): it saves memory but gives no speed-up, "
            "since this GPU has no native fp8 support and values are converted on every read.",
            major,
            minor,
        )
