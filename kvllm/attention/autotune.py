"""`--attention-backend auto-tune` (beyond vLLM): time every valid backend on the model's own shapes.

At start-up, every registered backend that can serve the model's attention configuration on this
machine runs a few prefill and decode steps shaped like the model's (its head counts, head size,
dtype, KV dtype, sliding window and soft-cap; batch and context sizes from the engine's limits)
through the same builder and implementation the model runner uses. Each result is first checked
against the float32 reference (a backend that computes wrong results is excluded, never chosen),
then timed: CUDA events on a GPU, wall time around a synchronizing call on the CPU. The fastest
total wins; the table and the reason are logged at INFO. A time cap bounds the run, checked before
each timed step: what has not started before it is excluded and says so; a step already started
finishes past it (a backend's first-use compile cannot be cut short: FlashAttention-4 and
FLEX_ATTENTION compiled for over 50 s on the H200, so give a cold machine a cap of minutes).

Results are cached per machine, shapes, configuration and library versions (autotune_cache), so
a second start reads the table instead of timing again and logs that it did.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvllm.attention import autotune_cache, registry
from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.selector import BackendChoice, backend_reasons
from kvllm.logger import init_logger
from kvllm.platforms import backend_priority
from kvllm.platforms.interface import DeviceInfo

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

DEFAULT_TIME_CAP_S = 60.0
# Relative L2 error against the float32 reference above which a backend is "wrong" (a sanity
# gate on 16-bit and fp8 results; the conformance walks hold backends to tighter bounds).
MAX_REL_ERROR = 5e-2

# (backend name, shape name, fn) -> milliseconds of one fn() call. Tests inject a deterministic one.
Timer = Callable[[str, str, Callable[[], object]], float]


@dataclass(frozen=True)
class ModelShapes:
    """What the timed steps are shaped after: the model's attention and the engine's limits."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class TuneShape:
    """One timed step: requests with these query lengths over these cached-context lengths."""

    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]


def tune_shapes(model: ModelShapes, device_type: str) -> tuple[TuneShape, ...]:
    """Two decode steps (a full batch at a moderate context, one long sequence) and one prefill
    chunk, within the engine's limits; scaled down on the CPU, where kernels are 100x slower."""
    on_gpu = device_type == "cuda"
    longest = max(model.max_model_len - 1, 1)
    batch = max(1, min(model.max_num_seqs, 128 if on_gpu else 4))
    ctx = min(1023 if on_gpu else 63, longest)
    long_ctx = min(8191 if on_gpu else 255, longest)
    chunk = max(1, min(model.max_num_batched_tokens, model.max_model_len, 2048 if on_gpu else 64))
    return (
        TuneShape(f"decode {batch} x ctx {ctx}", (1,) * batch, (ctx,) * batch),
        TuneShape(f"decode 1 x ctx {long_ctx}", (1,), (long_ctx,)),
        TuneShape(f"prefill 1 x {chunk}", (chunk,), (0,)),
    )


@dataclass
class TuneRow:
    """One backend's result: status ok (timed), invalid, wrong, error or not_timed."""

    backend: str
    status: str
    block_size: int | None = None
    ms: dict[str, float] = field(default_factory=dict)  # shape name -> ms per step
    reason: str = ""

    @property
    def total_ms(self) -> float | None:
        return sum(self.ms.values()) if self.status == "ok" else None


@dataclass
class TuneResult:
    """The auto-tune table, the backend it chose and where the table came from."""

    rows: list[TuneRow]
    shapes: tuple[TuneShape, ...]
    chosen: str
    block_size: int
    why: str
    from_cache: bool
    cache_file: Path | None

    def choice(self) -> BackendChoice:
        return BackendChoice(registry.get_backend_class(self.chosen), self.block_size)

    def format_table(self) -> str:
        """The table `kvllm backends --tune` prints and the engine logs."""
        head = ["backend", "block", *(s.name for s in self.shapes), "total ms", "status"]
        body = []
        for row in self.rows:
            times = [f"{row.ms[s.name]:.4f}" if s.name in row.ms else "-" for s in self.shapes]
            total = f"{row.total_ms:.4f}" if row.total_ms is not None else "-"
            status = row.status + (f": {row.reason}" if row.reason else "")
            mark = " <- chosen" if row.backend == self.chosen else ""
            body.append([row.backend, str(row.block_size or "-"), *times, total, status + mark])
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [head, *body]]
        source = f"from the cache {self.cache_file}" if self.from_cache else "timed now"
        return "\n".join([f"Attention auto-tune ({source}):", *lines, f"Chosen: {self.chosen}: {self.why}"])

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [asdict(r) for r in self.rows],
            "shapes": [asdict(s) for s in self.shapes],
            "chosen": self.chosen,
            "block_size": self.block_size,
            "why": self.why,
            "from_cache": self.from_cache,
            "cache_file": str(self.cache_file) if self.cache_file else None,
        }


def machine_name(device: torch.device) -> str:
    """The GPU's name (e.g. NVIDIA H200), or the CPU's."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def candidate_backends(config: AttentionSelectorConfig, device_info: DeviceInfo) -> list[str]:
    """Every registered backend of the right kind (MLA or not): the platform's priority list first,
    then the rest (FLEX_ATTENTION runs on the CPU when named; others are rows with their reasons)."""
    priority = [n.name for n in backend_priority(device_info, config.use_mla)]
    rest = []
    for name in registry.registered_backend_names():
        if name in priority:
            continue
        try:
            backend = registry.get_backend_class(name)
        except ImportError:
            rest.append(name)  # backend_reasons reports the import failure
            continue
        if backend.is_mla == config.use_mla:
            rest.append(name)
    return priority + rest


def autotune_attention_backend(
    config: AttentionSelectorConfig,
    device_info: DeviceInfo,
    model: ModelShapes,
    device: torch.device,
    *,
    timer: Timer | None = None,
    time_cap_s: float = DEFAULT_TIME_CAP_S,
    use_cache: bool = True,
    refresh: bool = False,
    cache_dir: Path | None = None,
    versions: dict[str, str | None] | None = None,
) -> TuneResult:
    """Time every valid backend on `model`'s shapes and pick the fastest (or read the cached table).

    `use_cache=False` neither reads nor writes the cache; `refresh=True` times again and overwrites it.
    """
    import torch

    from kvllm.platforms import is_simulated

    on_this_device = (device_info.platform == "cpu") == (device.type == "cpu")
    if is_simulated() or not on_this_device:
        raise ValueError(
            f"auto-tune times the backends on this machine; it cannot tune for {device_info.describe()} "
            f"(simulated or not this device, which is {device.type}). Pick a backend by name instead."
        )
    shapes = tune_shapes(model, device.type)
    names = candidate_backends(config, device_info)
    rows = {
        n: TuneRow(n, "invalid", reason="; ".join(backend_reasons(n, config, device_info))) for n in names
    }
    valid = [n for n in names if not rows[n].reason]
    for name in valid:
        rows[name] = TuneRow(name, "pending", _block_size(name, config))
    key = {
        "machine": {"device_info": asdict(device_info), "name": machine_name(device)},
        "config": asdict(config),
        # The engine limits matter only through the shapes they give, so the engine and
        # `kvllm backends --tune` share entries whenever the timed shapes agree.
        "model": {k: getattr(model, k) for k in ("num_heads", "num_kv_heads", "head_size", "sliding_window")},
        "shapes": [asdict(s) for s in shapes],
        "valid_backends": {n: registry.backend_path(n) for n in valid},
        "versions": versions if versions is not None else autotune_cache.library_versions(),
    }
    if use_cache and not refresh:
        entry = autotune_cache.load(key, cache_dir)
        if entry is not None and entry.get("chosen") in valid:
            result = TuneResult(
                rows=[TuneRow(**r) for r in entry["rows"]],
                shapes=shapes,
                chosen=entry["chosen"],
                block_size=int(entry["block_size"]),
                why=entry["why"],
                from_cache=True,
                cache_file=autotune_cache.cache_path(key, cache_dir),
            )
            logger.info("Attention auto-tune: cache hit, %s\n%s", result.cache_file, result.format_table())
            return result
    if not valid:
        raise ValueError(
            f"auto-tune: no attention backend is valid for {device_info.describe()} with {config}. Reasons: "
            + "{"
            + ", ".join(f"{n}: [{rows[n].reason}]" for n in names)
            + "}"
        )
    timer = timer or default_timer(device)
    deadline = time.monotonic() + time_cap_s
    with torch.inference_mode():
        for name in valid:
            _measure(rows[name], config, model, shapes, device, timer, deadline, time_cap_s)
    result = _decide(list(rows.values()), shapes, config, device_info)
    if result.chosen in {r.backend for r in result.rows if r.status == "ok"}:
        entry = {k: v for k, v in result.to_json().items() if k not in ("from_cache", "cache_file", "shapes")}
        result.cache_file = autotune_cache.store(key, entry, cache_dir) if use_cache else None
    logger.info("Attention auto-tune: timed %d backend(s)\n%s", len(valid), result.format_table())
    return result


def _block_size(name: str, config: AttentionSelectorConfig) -> int:
    backend = registry.get_backend_class(name)
    return config.block_size if config.block_size is not None else backend.preferred_block_size


def _measure(
    row: TuneRow,
    config: AttentionSelectorConfig,
    model: ModelShapes,
    shapes: tuple[TuneShape, ...],
    device: torch.device,
    timer: Timer,
    deadline: float,
    time_cap_s: float,
) -> None:
    from kvllm.attention.testing import run_backend_case
    from kvllm.utils.dtypes import torch_dtype

    backend = registry.get_backend_class(row.backend)
    fp8 = config.kv_cache_dtype.startswith("fp8")
    for seed, shape in enumerate(shapes):
        if time.monotonic() > deadline:
            row.status, row.reason = "not_timed", f"time cap of {time_cap_s:g} s reached before {shape.name}"
            return
        try:
            case = run_backend_case(
                backend, list(shape.query_lens), list(shape.context_lens), model.num_heads, model.num_kv_heads,
                model.head_size, row.block_size, torch_dtype(config.dtype), device, seed=seed,
                kv_cache_dtype=config.kv_cache_dtype, k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0,
                sliding_window=model.sliding_window if config.has_sliding_window else None,
                logits_soft_cap=config.logits_soft_cap, attn_type=config.attn_type,
            )  # fmt: skip
            error = case.rel_error()
            if not error < MAX_REL_ERROR:
                row.status, row.reason = "wrong", f"{shape.name}: relative error {error:.2e} vs float32"
                return
            row.ms[shape.name] = float(timer(row.backend, shape.name, case.forward))
        except Exception as exc:  # a backend that cannot run a shape is excluded, not fatal
            row.status, row.reason = "error", f"{shape.name}: {type(exc).__name__}: {str(exc)[:160]}"
            return
    row.status = "ok"


def _decide(
    rows: list[TuneRow],
    shapes: tuple[TuneShape, ...],
    config: AttentionSelectorConfig,
    device_info: DeviceInfo,
) -> TuneResult:
    timed = sorted(
        (r for r in rows if r.status == "ok"), key=lambda r: r.total_ms
    )  # stable: priority on ties
    if not timed:
        # Nothing finished in time: the automatic choice (the priority list) stands.
        fallback = next(r for r in rows if r.status != "invalid")
        why = "no backend was timed completely; using the first valid one in priority order"
        logger.warning("Attention auto-tune: %s (%s)", why, fallback.backend)
        return TuneResult(rows, shapes, fallback.backend, fallback.block_size, why, False, None)
    best = timed[0]
    if len(timed) == 1:
        why = "the only backend valid and timed here"
    else:
        runner_up = timed[1]
        why = (
            f"fastest total over {len(shapes)} steps shaped like the model's: {best.total_ms:.4f} ms vs "
            f"{runner_up.backend} {runner_up.total_ms:.4f} ms ({runner_up.total_ms / best.total_ms:.2f}x)"
        )
    return TuneResult(rows, shapes, best.backend, best.block_size, why, False, None)


def default_timer(device: torch.device) -> Timer:
    """CUDA events on a GPU (median of a few timed repetitions after a warm-up), wall time on the CPU."""
    import torch

    def time_cuda(_backend: str, _shape: str, fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize(device)
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 5)
        return statistics.median(samples)

    def time_cpu(_backend: str, _shape: str, fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(3):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(samples)

    return time_cuda if device.type == "cuda" else time_cpu


def model_shapes_from_engine(model_config: Any, args: Any, max_num_batched_tokens: int) -> ModelShapes:
    """ModelShapes from the runner's ModelConfig and EngineArgs."""
    return ModelShapes(
        num_heads=model_config.num_attention_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_size=model_config.head_size,
        max_model_len=model_config.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        sliding_window=model_config.sliding_window,
    )


__all__ = [
    "ModelShapes",
    "TuneResult",
    "TuneRow",
    "TuneShape",
    "autotune_attention_backend",
    "default_timer",
    "model_shapes_from_engine",
    "tune_shapes",
]
