"""Configs of TRITON_ATTN's prefill kernel (`triton_prefill_attention`): tiles, the table that picks
them, and how a config's KV load modes resolve on a given cache and inputs. No kernels here."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from kvllm.utils.dtypes import FP8_DTYPES

try:  # Hopper TMA descriptors built on the host (triton >= 3.4); the interpreter runs them too
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

KV_LOADS = ("gather", "page", "tma")
PREFILL_KERNEL_MODES = {"auto": "auto", "1": "on", "0": "off"}  # KVLLM_TRITON_PREFILL_KERNEL -> mode
# With the switch on, batches whose prefill requests average at least this many query tokens take this
# kernel; shorter chunks keep the unified kernel's GQA-packed rows (fewer wasted rows per program).
MIN_MEAN_QUERY_LEN = 128
# By default (auto) only chunks this long do. Measured end to end on an H100 (Qwen3-0.6B shapes, time to
# first token, benchmarks/h200/prefill_routing.py, docs/benchmarks.md, twenty-fifth session; the unified
# kernel's two runs against this threshold's two): one prompt of 2,048 tokens 8.5-9.3 against 7.4 ms, of
# 4,096 18.0-19.0 against 14.1-14.3 (at 4,096, the earlier threshold, 15.3), 8 x 2,048 47.8-51.2 against
# 45.5-48.8. Shorter steps are host-bound, and this kernel's launch costs the host more than the unified
# kernel's (94 against 50 us; prefill_launch_probe.py, twenty-fourth session): one prompt of 1,024 tokens
# was 10.7 against 7.8 ms with the kernel (twenty-second session). Under piecewise graphs the step's K/V
# is gathered back from the cache (gather_step_kv: on 8 x 2,048 about 55 us of a 415 us layer, against
# the unified kernel's 500).
AUTO_MIN_MEAN_QUERY_LEN = 2048


def prefill_kernel_mode() -> str:
    """How batches route to this kernel on their own (KVLLM_TRITON_PREFILL_KERNEL): "auto" (the default:
    chunks averaging AUTO_MIN_MEAN_QUERY_LEN query tokens), "on" (1: MIN_MEAN_QUERY_LEN) or "off" (0).
    A PrefillConfig passed to `unified_attention` (benchmarks, tests) always takes it."""
    switch = os.environ.get("KVLLM_TRITON_PREFILL_KERNEL", "auto")
    if switch not in PREFILL_KERNEL_MODES:
        raise ValueError(
            f"KVLLM_TRITON_PREFILL_KERNEL={switch!r}: allowed auto (long chunks only, the default), 1 (on) "
            "or 0 (off)"
        )
    return PREFILL_KERNEL_MODES[switch]


def routes_to_prefill_kernel(num_prefill_tokens: int, num_prefill_reqs: int, mode: str | None = None) -> bool:
    """Whether a batch's prefill requests (`num_prefill_tokens` query tokens, an upper bound, over
    `num_prefill_reqs` requests) take this kernel on their own, by `mode` (default: `prefill_kernel_mode`)."""
    mode = mode or prefill_kernel_mode()
    if mode == "off" or num_prefill_reqs <= 0:
        return False
    threshold = MIN_MEAN_QUERY_LEN if mode == "on" else AUTO_MIN_MEAN_QUERY_LEN
    return num_prefill_tokens >= threshold * num_prefill_reqs


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles and launch options of the prefill kernel."""

    block_m: int  # rows per program: query tokens x packed heads; power of two
    tile_n: int  # keys per inner-loop tile; power of two >= 16
    num_warps: int
    num_stages: int
    pack_gqa: bool = False  # rows = (token, head of the KV group) pairs instead of one head per program
    kv_load: str = "gather"  # see KV_LOADS; "page"/"tma" fall back when the cache does not allow them
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the KV loops
    new_kv: bool = False  # the step's K/V from the key/value inputs (16-bit caches), prefix from the cache

    def __post_init__(self) -> None:
        if self.kv_load not in KV_LOADS:
            raise ValueError(f"kv_load must be one of {KV_LOADS}, got {self.kv_load!r}")
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    @property
    def label(self) -> str:
        parts = [
            f"m{self.block_m}",
            f"n{self.tile_n}",
            f"w{self.num_warps}",
            f"s{self.num_stages}",
            self.kv_load,
        ]
        if self.pack_gqa:
            parts.append("pack")
        if self.warp_specialize:
            parts.append("ws")
        if self.new_kv:
            parts.append("newkv")
        return "-".join(parts)


def prefill_kernel_config(
    head_size: int, queries_per_kv: int, dtype: torch.dtype, block_size: int
) -> PrefillConfig:
    """The config table. Timed by `benchmarks/h200/prefill_sweep.py` (H200, ninth session; H100,
    twenty-second): within 3-6% of the fastest candidate on 8 x 2,048 causal (375 against 401 TFLOP/s
    for the GQA-packed variant on the H100) and the fastest on one 8,192-token chunk (521 against 496),
    the long chunks that the default routing sends here.

    16-bit, head size <= 128: 128 x 64 tiles, 8 warps (two warpgroups of 64 rows), 3 stages, the
    step's own K/V read as rows (TMA), the prefix from the cache (TMA inside 64+-token pages).
    float32 or head size 256: 64 x 32 tiles (registers).
    """
    head_pad = triton.next_power_of_2(head_size)
    if dtype == torch.float32 or head_pad > 128:
        return PrefillConfig(64, 32, 4, 2)
    kv_load = "tma" if block_size % 64 == 0 else "gather"
    return PrefillConfig(128, 64, 8, 3, kv_load=kv_load, new_kv=True)


def resolve_kv_load(
    cfg: PrefillConfig, key_cache: torch.Tensor, value_cache: torch.Tensor, head_size: int
) -> str:
    """The KV load mode the launch will use: `cfg.kv_load`, or the nearest one this cache allows."""
    block_size = key_cache.shape[1]
    if cfg.kv_load == "gather" or block_size % cfg.tile_n:
        return "gather"
    if cfg.kv_load == "page":
        return "page"
    head_pad = triton.next_power_of_2(head_size)
    for cache in (key_cache, value_cache):
        nb, bs, kvh, d = cache.shape
        page_contiguous = cache.stride() == (bs * kvh * d, kvh * d, d, 1)
        if not page_contiguous or cache.data_ptr() % 16 or (kvh * d * cache.element_size()) % 16:
            return "page"
    if head_pad != head_size or not _has_tma(key_cache.device):
        return "page"
    return "tma"


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """TMA descriptors: NVIDIA from Hopper (SM 9.0) on, and the interpreter (CPU tensors). Cached: the
    capability query cost about 10 us a call, twice a prefill launch (the H100 probe's profile)."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ok(t: torch.Tensor, head_size: int) -> bool:
    """Whether [rows, heads, head_size] `t` can be read by a TMA descriptor of its 2-D rows."""
    if triton.next_power_of_2(head_size) != head_size or not _has_tma(t.device):
        return False
    row_bytes = t.stride(0) * t.element_size()
    return t.stride(2) == 1 and t.stride(1) == head_size and t.data_ptr() % 16 == 0 and row_bytes % 16 == 0


def resolve_new_kv_load(
    cfg: PrefillConfig, key: torch.Tensor | None, value: torch.Tensor | None, key_cache: torch.Tensor
) -> str | None:
    """How the step's own K/V are read: None (from the cache), "rows" (pointer loads) or "rows-tma"."""
    if not cfg.new_kv or key is None or value is None or key_cache.dtype in FP8_DTYPES:
        return None
    for name, t in (("key", key), ("value", value)):
        if t.shape[1:] != key_cache.shape[2:] or t.stride(-1) != 1:
            raise ValueError(
                f"{name} {tuple(t.shape)} (strides {t.stride()}) must be [tokens, {key_cache.shape[2]}, "
                f"{key_cache.shape[3]}] with a contiguous head dimension, like the cache's pages"
            )
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        return None
    head_size = key.shape[2]
    return "rows-tma" if _tma_ok(key, head_size) and _tma_ok(value, head_size) else "rows"
