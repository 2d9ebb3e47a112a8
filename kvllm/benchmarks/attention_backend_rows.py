"""Backend rows of the attention kernel benchmark: every registered backend through its own contract.

For each registered backend (TRITON_ATTN excepted: the benchmark has its own row for it, timed
through its ops, with tile sweeps) the configuration of the shape (head size, dtype, KV-cache dtype,
block size) is validated on `current_device_info()`. A backend with reasons gets one "skipped" row
carrying them. A valid one is run exactly as the model runner runs it:

1. its KV cache is allocated with `get_kv_cache_shape`, and the cached context (not the step's new
   tokens) is written through `kv_cache_views`, which finds the K and V pages of any layout that is
   a permutation of (2, num_blocks, block_size, num_kv_heads, head_size) - TRITON/FLASH_ATTN's
   (2, nb, bs, h, d), FlashInfer's (nb, 2, bs, h, d), an HND (.., h, bs, d) one alike;
2. its metadata builder turns the PagedBatch's CommonAttentionMetadata into backend metadata;
3. `impl.forward` runs through a real `kvllm.layers.attention.Attention` layer (k_scale/v_scale
   1.0, no sinks) bound with `bind_backend`, checked against the float32 reference, then timed.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig
    from kvllm.attention.reference import PagedBatch

# Backends whose row the benchmark builds elsewhere (no duplicate generic row).
OWN_ROWS = {"TRITON_ATTN": "has its own row (its ops, called directly)"}

# Distinct sizes (none of them 2) to read a layout off get_kv_cache_shape.
_PROBE = {"blocks": 11, "block_size": 13, "kv_heads": 5, "head_size": 7}


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


def kv_cache_views(
    backend: type[AttentionBackend], kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) as [num_blocks, block_size, num_kv_heads, head_size] views of kv_cache.

    The layout is read off the backend's own `get_kv_cache_shape` with distinct probe sizes, so any
    5-d layout that permutes (K/V axis, blocks, block_size, kv_heads, head_size) works: the K/V axis
    is where the 2 lands, the other axes are permuted back to NHD pages. Writes through the views
    land in kv_cache. Raises ValueError for a layout outside that family.
    """
    p = _PROBE
    probe = tuple(backend.get_kv_cache_shape(p["blocks"], p["block_size"], p["kv_heads"], p["head_size"]))
    wanted = (p["blocks"], p["block_size"], p["kv_heads"], p["head_size"])
    if len(probe) != 5 or sorted(probe) != sorted((2, *wanted)):
        raise ValueError(
            f"KV cache shape {probe} for (blocks, block_size, kv_heads, head_size)={wanted} is not a "
            "permutation of (2, blocks, block_size, kv_heads, head_size)"
        )
    kv_axis = probe.index(2)
    rest = [size for axis, size in enumerate(probe) if axis != kv_axis]
    order = [rest.index(size) for size in wanted]
    return kv_cache.select(kv_axis, 0).permute(order), kv_cache.select(kv_axis, 1).permute(order)


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


@dataclass
class BackendCase:
    """A backend bound to one shape: cache, builder, layer and metadata, ready to run."""

    backend: type[AttentionBackend]
    kv_cache: torch.Tensor
    builder: Any
    layer: Any
    metadata: Any
    batch: PagedBatch

    def forward(self) -> torch.Tensor:
        b = self.batch
        return self.layer.impl.forward(
            self.layer, b.query, b.new_keys, b.new_values, self.kv_cache, self.metadata
        )

    def build(self) -> Any:
        return self.builder.build(self.batch.metadata)

    def first_layer(self) -> torch.Tensor:
        """build() then forward on the fresh metadata: what the first layer of a step waits for."""
        b = self.batch
        return self.layer.impl.forward(
            self.layer, b.query, b.new_keys, b.new_values, self.kv_cache, self.build()
        )


def make_builder(
    backend: type[AttentionBackend],
    batch: PagedBatch,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
) -> Any:
    from kvllm.attention.metadata import KVCacheSpec

    md = batch.metadata
    spec = KVCacheSpec(batch.block_size, num_kv_heads, head_size, cache_dtype, kv_cache_dtype)
    return backend.get_builder_cls()(
        backend, spec, device, md.num_reqs, md.num_actual_tokens, md.max_seq_len + batch.block_size
    )


def make_case(
    backend: type[AttentionBackend],
    batch: PagedBatch,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
) -> BackendCase:
    import torch

    from kvllm.layers.attention import Attention

    shape = backend.get_kv_cache_shape(batch.num_blocks, batch.block_size, num_kv_heads, head_size)
    kv_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    key_cache, value_cache = kv_cache_views(backend, kv_cache)
    batch.fill_cache(key_cache, value_cache)  # the cached context; forward writes the new tokens
    builder = make_builder(backend, batch, num_kv_heads, head_size, cache_dtype, kv_cache_dtype, device)
    layer = Attention(num_heads, head_size, scale, num_kv_heads, prefix=f"bench.{backend.name}").to(device)
    layer.bind_backend(backend, kv_cache_dtype)
    layer.kv_cache = kv_cache
    return BackendCase(backend, kv_cache, builder, layer, builder.build(batch.metadata), batch)


def backend_results(
    names: list[str],
    batch: PagedBatch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
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

    config = selector_config(head_size, dtype, kv_cache_dtype, batch.block_size)
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
            result = _run_backend(
                name, batch, num_heads, num_kv_heads, head_size, scale, cache_dtype, kv_cache_dtype,
                device, ref, tol, time_ms, sync, build_budget_ms,
            )  # fmt: skip
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _run_backend(name, batch, num_heads, num_kv_heads, head_size, scale, cache_dtype, kv_cache_dtype,
                 device, ref, tol, time_ms, sync, build_budget_ms) -> BackendResult:  # fmt: skip
    from kvllm.attention.registry import get_backend_class

    backend = get_backend_class(name)
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
        case = make_case(backend, batch, num_heads, num_kv_heads, head_size, scale, cache_dtype,
                         kv_cache_dtype, device)  # fmt: skip
        out = case.forward()
        sync()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < tol:
            return BackendResult(
                name, "wrong", rel_error=err, note=f"tolerance {tol:g}; not timed", extra=extra
            )
        ms = time_ms(case.forward)
        build_ms = host_ms(case.build, sync, build_budget_ms)
        # Per-step work some backends do lazily in the first layer's forward (masks, plans) shows here.
        extra["first_layer_ms"] = host_ms(case.first_layer, sync, build_budget_ms)
    except Exception as exc:  # a backend that cannot run this shape is a result, not a crash
        return BackendResult(name, "error", note=f"{type(exc).__name__}: {str(exc)[:200]}", extra=extra)
    note = f"forward incl. the step's KV write; first layer of a step (build + forward) {extra['first_layer_ms']:.3f} ms"
    return BackendResult(name, "ok", ms=ms, build_ms=build_ms, rel_error=err, note=note, extra=extra)


def _probe_tensor(backend: type[AttentionBackend]) -> torch.Tensor:
    import torch

    p = _PROBE
    return torch.empty(backend.get_kv_cache_shape(p["blocks"], p["block_size"], p["kv_heads"], p["head_size"]),
                       dtype=torch.uint8, device="meta")  # fmt: skip


def build_ms(
    backend_name: str,
    batch: PagedBatch,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
    sync: Callable[[], None],
    budget_ms: float,
) -> float:
    """Host time of one backend builder's build() for this batch (for rows built elsewhere)."""
    from kvllm.attention.registry import get_backend_class

    backend = get_backend_class(backend_name)
    builder = make_builder(backend, batch, num_kv_heads, head_size, cache_dtype, kv_cache_dtype, device)
    return host_ms(lambda: builder.build(batch.metadata), sync, budget_ms)
