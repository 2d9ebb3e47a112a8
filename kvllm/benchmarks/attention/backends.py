"""Backend rows of the attention kernel benchmark: every registered backend through its own contract.

For each registered backend (TRITON_ATTN excepted: the benchmark has its own row for it, timed
through its ops, with tile sweeps) the configuration of the shape (head size, dtype, KV-cache dtype,
block size) is validated on `current_device_info()`. A backend with reasons gets one "skipped" row
carrying them. A valid one is run exactly as the model runner runs it:

1. `kvllm.attention.testing.prepare_backend_case` allocates its KV cache with `get_kv_cache_shape`
   and writes the cached context (not the step's new tokens) through `kv_cache_views`, which finds
   the K and V pages of any layout that is a permutation of (2, num_blocks, block_size,
   num_kv_heads, head_size) - TRITON/FLASH_ATTN's (2, nb, bs, h, d), FlashInfer's (nb, 2, bs, h, d),
   an HND (.., h, bs, d) one alike;
2. its metadata builder turns the PagedBatch's CommonAttentionMetadata into backend metadata;
3. `impl.forward` runs with k_scale/v_scale 1.0 and no sinks, is checked against the float32
   reference, then timed.
   The timed call includes the KV write of the step's new tokens (every backend writes the cache
   inside forward); the builder's `build()` is timed separately as host wall time (synchronized),
   since per-step metadata work is paid once per step, not per layer. Work a backend defers to the
   first forward of a step (FlexAttention's block mask, for one) is in neither: extra.first_layer_ms
   times build() plus a forward on the fresh metadata.

Nothing here is backend-specific: a new backend gets a row by registering.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig
    from kvllm.attention.reference import PagedBatch

# Backends whose row the benchmark builds elsewhere (no duplicate generic row).
OWN_ROWS = {"TRITON_ATTN": "has its own row (its ops, called directly)"}


@dataclass
class BackendResult:
    """One backend row before the benchmark adds its throughput columns."""

    kernel: str
    status: str  # ok, wrong, skipped, error
    ms: float | None = None
    build_ms: float | None = None
    rel_error: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def resolve_backend_names(spec: str | None) -> list[str]:
    """`--backends` text to registered backend names: None/"all" = every one, "none" = no one."""
    from kvllm.attention.registry import registered_backend_names

    known = registered_backend_names()
    if spec is None or spec.strip().lower() == "all":
        return known
    if spec.strip().lower() == "none":
        return []
    names = [n.strip().upper() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"unknown attention backend(s) {', '.join(unknown)} (registered: {', '.join(known)})"
        )
    return names


def selector_config(
    head_size: int, dtype: torch.dtype, kv_cache_dtype: str, block_size: int
) -> AttentionSelectorConfig:
    from kvllm.attention.backend import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=head_size,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
    )


def shorten_reasons(reasons: list[str], each: int = 90, total: int = 240) -> str:
    parts = [r if len(r) <= each else r[: each - 3] + "..." for r in reasons]
    text = "; ".join(parts)
    return text if len(text) <= total else text[: total - 3] + "..."


def host_ms(fn: Callable[[], object], sync: Callable[[], None], budget_ms: float) -> float:
    """Median wall time of fn() followed by a device sync: what a step waits for on the host."""
    fn()
    sync()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_ms * 1e-3
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 1000):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def backend_results(
    names: list[str],
    batch: PagedBatch,
    *,
    kv_cache_dtype: str,
    ref: torch.Tensor,
    tol: float,
    time_ms: Callable[[Callable[[], object]], float],
    sync: Callable[[], None],
    build_budget_ms: float,
    on_result: Callable[[BackendResult], None] | None = None,
) -> list[BackendResult]:
    """One result per backend in `names` (those with OWN_ROWS are left out)."""
    from kvllm.attention.selector import backend_reasons
    from kvllm.platforms import current_device_info

    config = selector_config(batch.query.shape[2], batch.query.dtype, kv_cache_dtype, batch.block_size)
    device_info = current_device_info()
    results = []
    for name in names:
        if name in OWN_ROWS:
            continue
        reasons = backend_reasons(name, config, device_info)
        if reasons:
            result = BackendResult(
                name, "skipped", note=f"not valid on {device_info.describe()}: {shorten_reasons(reasons)}"
            )
        else:
            result = _run_backend(name, batch, kv_cache_dtype, ref, tol, time_ms, sync, build_budget_ms)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _run_backend(name, batch, kv_cache_dtype, ref, tol, time_ms, sync, build_budget_ms) -> BackendResult:
    from kvllm.attention.registry import get_backend_class
    from kvllm.attention.testing import kv_cache_views, prepare_backend_case

    backend = get_backend_class(name)
    num_kv_heads, head_size = batch.new_keys.shape[1:]
    try:
        kv_cache_views(backend, _probe_tensor(backend))
    except ValueError as exc:
        return BackendResult(name, "skipped", note=f"benchmark cannot fill this KV layout: {exc}")
    extra = {
        "path": "backend: builder.build + impl.forward",
        "kv_cache_shape": list(backend.get_kv_cache_shape(batch.num_blocks, batch.block_size, num_kv_heads, head_size)),
        "kv_cache_layout": backend.kv_cache_layout,
    }  # fmt: skip
    try:
        case = prepare_backend_case(backend, batch, kv_cache_dtype=kv_cache_dtype)
        out = case.forward()
        sync()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < tol:
            return BackendResult(
                name, "wrong", rel_error=err, note=f"tolerance {tol:g}; not timed", extra=extra
            )
        ms = time_ms(case.forward)
        build_ms = host_ms(case.build, sync, build_budget_ms)
        # build_ms ends with a device sync. FLEX's measured 8 / 24 ms here (in exact 8 ms steps) against
        # 0.2 / 0.4 ms in a fresh process, with no synchronizing call in its build: these two say whether
        # the time is the build's own or the sync's.
        extra["build_ms_without_sync"] = host_ms(case.build, lambda: None, build_budget_ms)
        extra["sync_alone_ms"] = host_ms(lambda: None, sync, build_budget_ms)
        # Per-step work some backends do lazily in the first layer's forward (masks, plans) shows here.
        extra["first_layer_ms"] = host_ms(case.first_layer, sync, build_budget_ms)
    except Exception as exc:  # a backend that cannot run this shape is a result, not a crash
        return BackendResult(name, "error", note=f"{type(exc).__name__}: {str(exc)[:200]}", extra=extra)
    note = f"forward incl. the step's KV write; first layer of a step (build + forward) {extra['first_layer_ms']:.3f} ms"
    return BackendResult(name, "ok", ms=ms, build_ms=build_ms, rel_error=err, note=note, extra=extra)


def _probe_tensor(backend: type[AttentionBackend]) -> torch.Tensor:
    import torch

    return torch.empty(backend.get_kv_cache_shape(11, 13, 5, 7), dtype=torch.uint8, device="meta")


def build_ms(
    backend_name: str,
    batch: PagedBatch,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    sync: Callable[[], None],
    budget_ms: float,
) -> float:
    """Host time of one backend builder's build() for this batch (for rows built elsewhere)."""
    from kvllm.attention.registry import get_backend_class
    from kvllm.attention.testing import make_builder

    builder = make_builder(get_backend_class(backend_name), batch, cache_dtype, kv_cache_dtype)
    return host_ms(lambda: builder.build(batch.metadata), sync, budget_ms)
