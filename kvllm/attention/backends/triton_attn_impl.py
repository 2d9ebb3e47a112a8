"""The torch side of TRITON_ATTN: per-step metadata builder and per-layer implementation."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kvllm.attention.impl import AttentionImpl, AttentionLayer, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.attention.ops.triton_prefill_config import (
    PrefillConfig,
    prefill_kernel_config,
    prefill_kernel_mode,
    routes_to_prefill_kernel,
)
from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvllm.attention.ops.triton_unified_attention import (
    MAX_SEGMENTS,
    KernelConfig,
    decode_config,
    prefill_config,
    unified_attention,
)
from kvllm.utils.dtypes import FP8_DTYPES, FP8_TORCH_DTYPES
from kvllm.utils.host_copy import StagingBuffer


def gather_step_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K/V rows, [tokens, kv_heads, head_size] in token order, read back from their slots of
    the paged cache ([blocks, block_size, kv_heads, head_size]; any strides). Padding rows (slot -1)
    read slot 0: the kernels never read those rows.

    A cache whose slots are rows of one stride is read by one `index_select` per cache over those rows,
    moved 8 bytes at a time where a row allows. The general case's advanced indexing (the only path
    until the twenty-fourth session) computes every 2-byte value's address from two index tensors, in
    six launches: on an H100 the step's gather cost about 200 us a layer on 8 x 2,048 and 70 us of host
    time a call (benchmarks/h200/prefill_launch_probe.py, `prefill-gatherkv` against `prefill`); the
    row path about 55 us (twenty-fifth session, docs/benchmarks.md)."""
    slots = slot_mapping.clamp(min=0)
    return _gather_rows(key_cache, slots), _gather_rows(value_cache, slots)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    row = num_kv_heads * head_size
    if cache.stride() != (block_size * row, row, head_size, 1):
        slots = slots.long()
        return cache[slots // block_size, slots % block_size]
    rows = cache.as_strided((num_blocks * block_size, row), (row, 1))
    per_word = 8 // cache.element_size()
    if cache.element_size() < 8 and row % per_word == 0 and cache.storage_offset() % per_word == 0:
        wide = torch.index_select(rows.view(torch.int64), 0, slots)
        return wide.view(cache.dtype).view(-1, num_kv_heads, head_size)
    return torch.index_select(rows, 0, slots).view(-1, num_kv_heads, head_size)


MIN_SPLIT_TOKENS = 256  # a split-KV segment below this many keys costs more in the reduce than it saves
# The order in which an unsplit decode launch starts its requests' programs (KVLLM_TRITON_DECODE_ORDER):
# "longest_first" sorts them by sequence length on the device each step, so the launch's last wave holds
# the shortest requests and no SM idles behind one long request; "batch" keeps the batch's order.
DECODE_ORDERS = ("longest_first", "batch")
MAX_GRID_Y = 65535  # an ordered launch puts the requests on the grid's second dimension


# A decode launch of fewer than SPLIT_BELOW programs per SM splits each request's KV into segments, as many
# (a power of two) as bring the launch to SPLIT_TARGET programs per SM. KVLLM_TRITON_SPLIT_POLICY="BELOW,TARGET"
# overrides the pair (a measurement switch).
SPLIT_BELOW, SPLIT_TARGET = 2, 4


def split_policy() -> tuple[int, int]:
    text = os.environ.get("KVLLM_TRITON_SPLIT_POLICY", f"{SPLIT_BELOW},{SPLIT_TARGET}")
    below, _, target = text.partition(",")
    if not (below.isdigit() and target.isdigit() and int(below) > 0 and int(target) > 0):
        raise ValueError(f"KVLLM_TRITON_SPLIT_POLICY={text!r}: expected two positive integers, BELOW,TARGET")
    return int(below), int(target)


@dataclass(frozen=True)
class DecodePlanEntry:
    """How a decode launch of at most `max_reqs` requests runs: its KV tile, warps, stages and split count,
    and whether a split launch starts its requests longest first."""

    max_reqs: int
    tile_n: int
    num_warps: int
    num_stages: int
    splits: int
    ordered: bool


def decode_plan_setting() -> tuple[DecodePlanEntry, ...]:
    """KVLLM_TRITON_DECODE_PLAN (a measurement switch, empty by default): ';'-separated entries
    `MAX_REQS:TILE_N,WARPS,STAGES,SPLITS[,o]`. A decode launch of R requests takes the entry with the
    smallest MAX_REQS >= R; launches larger than every entry keep the default tiles and split policy."""
    text = os.environ.get("KVLLM_TRITON_DECODE_PLAN", "").strip()
    entries = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        reqs, _, rest = part.partition(":")
        fields = rest.split(",")
        ordered = fields[-1] == "o"
        numbers = fields[:-1] if ordered else fields
        if not (reqs.isdigit() and len(numbers) == 4 and all(f.isdigit() and int(f) > 0 for f in numbers)):
            raise ValueError(
                f"KVLLM_TRITON_DECODE_PLAN entry {part!r}: expected MAX_REQS:TILE_N,WARPS,STAGES,SPLITS[,o] "
                "with positive integers"
            )
        tile_n, warps, stages, splits = map(int, numbers)
        if tile_n < 16 or tile_n & (tile_n - 1) or splits & (splits - 1) or splits > MAX_SEGMENTS:
            raise ValueError(
                f"KVLLM_TRITON_DECODE_PLAN entry {part!r}: TILE_N must be a power of two >= 16 and SPLITS a "
                f"power of two <= {MAX_SEGMENTS}"
            )
        entries.append(DecodePlanEntry(int(reqs), tile_n, warps, stages, splits, ordered))
    return tuple(sorted(entries, key=lambda e: e.max_reqs))


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The requests' indices by descending length (ties in batch order)."""
    return np.argsort(-seq_lens, kind="stable")


def decode_order_setting() -> str:
    name = os.environ.get("KVLLM_TRITON_DECODE_ORDER", "longest_first")
    if name not in DECODE_ORDERS:
        raise ValueError(f"KVLLM_TRITON_DECODE_ORDER={name!r}: expected one of {list(DECODE_ORDERS)}")
    return name


@dataclass
class TritonAttentionMetadata:
    """One step's launch plan for the Triton kernels.

    Requests [0, num_decode_reqs) go to the decode launch (at most `decode_query_len` query tokens
    each: one, or k + 1 in a speculative verification; none for CUDA-graph padding), split over
    `num_splits` KV segments; the rest go to the general launch.
    """

    num_actual_tokens: int
    num_reqs: int
    num_decode_reqs: int
    num_splits: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding, not written
    decode_query_len: int = 1
    decode_order: torch.Tensor | None = None  # int64 [num_decode_reqs]: the decode programs' start order
    decode_plan: DecodePlanEntry | None = None  # KVLLM_TRITON_DECODE_PLAN's tiles for the decode launch


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds TritonAttentionMetadata; owns fixed-size buffers for CUDA-graph capture and replay.

    Eager steps (`build`) use the common metadata's tensors as they are. The graph hooks copy them
    into buffers preallocated for max_num_reqs / max_num_tokens (fixed addresses across replays) and
    take their launch decisions from the batch's padded sizes only, never from sequence lengths, so a
    replay launches exactly what was captured. They expect the batch padded to the captured size:
    padded tokens have slot -1, padded requests query length 0. A uniform-decode capture (every
    query length <= 1, or <= decode_query_len for a speculative verification) must be replayed with
    uniform-decode batches of the same bound.
    """

    uniform_batch_graphs: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        device = torch.device(self.device)
        max_num_reqs, max_num_tokens = self.max_num_reqs, self.max_num_tokens
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.num_sms = 16  # interpreter runs: any fixed value keeps the plan deterministic
        max_blocks = -(-self.max_model_len // self.kv_cache_spec.block_size)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.longest_first = decode_order_setting() == "longest_first"
        self.split_below, self.split_target = split_policy()
        self.decode_plan = decode_plan_setting()
        # The ordered decode launch's start order, sorted on the host (its lengths are there) and uploaded:
        # a device sort cost the host several launches a step, on a path that is host-bound at batch 64.
        # Depth 8: a draft model's builder fills it once per draft, several times a step.
        self.decode_order = StagingBuffer(max_num_reqs, torch.int64, device, depth=8)

    def plan_for(self, num_decode_reqs: int, graph: bool) -> DecodePlanEntry | None:
        """The KVLLM_TRITON_DECODE_PLAN entry of a decode launch. Only graph launches (`graph`) follow the
        plan: their variants compile at capture, while an eager step's new variant would compile mid-serving."""
        if num_decode_reqs == 0 or not graph:
            return None
        return next((e for e in self.decode_plan if num_decode_reqs <= e.max_reqs), None)

    def num_splits_for(self, num_decode_reqs: int, max_seq_len: int, graph: bool = False) -> int:
        """KV segments for the decode launch: split only when too few programs fill the GPU (or, for a
        `graph` launch, as KVLLM_TRITON_DECODE_PLAN says, never into segments below MIN_SPLIT_TOKENS)."""
        entry = self.plan_for(num_decode_reqs, graph)
        if entry is not None:
            return max(1, min(entry.splits, 1 << (max(1, max_seq_len // MIN_SPLIT_TOKENS).bit_length() - 1)))
        programs = num_decode_reqs * self.kv_cache_spec.num_kv_heads
        if programs == 0 or programs >= self.split_below * self.num_sms:
            return 1
        by_occupancy = 1 << (-(-self.split_target * self.num_sms // programs) - 1).bit_length()
        by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
        by_length = 1 << (by_length.bit_length() - 1)
        return max(1, min(by_occupancy, by_length, MAX_SEGMENTS))

    def orders_decodes(self, num_decode_reqs: int, num_splits: int, graph: bool = False) -> bool:
        """Whether the decode launch starts its programs longest request first: an unsplit launch of more
        programs than the GPU has SMs (a split launch has fewer than 2 per SM: about one wave, no tail to
        order), or a `graph` launch whose KVLLM_TRITON_DECODE_PLAN entry says so."""
        programs = num_decode_reqs * self.kv_cache_spec.num_kv_heads
        entry = self.plan_for(num_decode_reqs, graph)
        if entry is not None and num_splits > 1:
            return self.longest_first and entry.ordered and num_decode_reqs <= MAX_GRID_Y
        return (
            self.longest_first
            and num_splits == 1
            and programs > self.num_sms
            and num_decode_reqs <= MAX_GRID_Y
        )

    def _upload_decode_order(self, common: CommonAttentionMetadata, num_decode_reqs: int) -> torch.Tensor:
        """The first `num_decode_reqs` requests longest first, sorted on the host from its lengths (padding
        requests past them have length 0) into the fixed device buffer."""
        lens = np.zeros(num_decode_reqs, dtype=np.int64)
        known = common.seq_lens_cpu[:num_decode_reqs].numpy()
        lens[: len(known)] = known
        self.decode_order.next_host_numpy()[:num_decode_reqs] = longest_first(lens)
        return self.decode_order.upload()[:num_decode_reqs]

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        _check_causal(common)
        num_decodes = common.num_decodes
        num_splits = self.num_splits_for(num_decodes, common.max_seq_len)
        decode_order = None
        if self.orders_decodes(num_decodes, num_splits):
            decode_order = self._upload_decode_order(common, num_decodes)
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            num_decode_reqs=num_decodes,
            num_splits=num_splits,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            decode_query_len=common.decode_query_len if common.num_decodes else 1,
            decode_order=decode_order,
        )

    def prepare_for_capture(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return self._build_static(common)

    def prepare_for_replay(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return self._build_static(common)

    def _build_static(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        _check_causal(common)
        num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
        if num_reqs > self.max_num_reqs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"graph batch of {num_reqs} requests / {num_tokens} tokens exceeds the builder's "
                f"max_num_reqs={self.max_num_reqs} / max_num_tokens={self.max_num_tokens}"
            )
        cols = common.block_table.shape[1]
        if cols > self.block_table.shape[1]:
            raise ValueError(f"block table has {cols} columns, more than max_model_len allows")
        self.query_start_loc[: num_reqs + 1].copy_(common.query_start_loc[: num_reqs + 1], non_blocking=True)
        self.seq_lens[:num_reqs].copy_(common.seq_lens[:num_reqs], non_blocking=True)
        self.block_table[:num_reqs, :cols].copy_(common.block_table[:num_reqs], non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(common.slot_mapping[:num_tokens], non_blocking=True)
        # The plan follows the batch's shape (B requests of at most q tokens), never its contents.
        decode_query_len = 1
        if common.decode_query_len > 1 and common.num_decodes == num_reqs:
            if common.max_query_len > common.decode_query_len:
                raise ValueError(
                    f"a decode request has {common.max_query_len} query tokens, more than "
                    f"decode_query_len={common.decode_query_len}"
                )
            decode_query_len, num_decode_reqs = common.decode_query_len, num_reqs
        else:
            num_decode_reqs = num_reqs if common.max_query_len <= 1 else 0
        num_splits = self.num_splits_for(num_decode_reqs, self.max_model_len, graph=True)
        decode_order = None
        if self.orders_decodes(num_decode_reqs, num_splits, graph=True):
            # Refilled before every replay, like the buffers above (padding requests, length 0, sort last).
            decode_order = self._upload_decode_order(common, num_decode_reqs)
        return TritonAttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            num_decode_reqs=num_decode_reqs,
            num_splits=num_splits,
            max_query_len=common.max_query_len,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            decode_query_len=decode_query_len,
            decode_order=decode_order,
            decode_plan=self.plan_for(num_decode_reqs, graph=True),
        )


def _check_causal(common: CommonAttentionMetadata) -> None:
    if not common.causal:
        raise NotImplementedError("TRITON_ATTN implements causal attention only (non-causal is not declared)")


@functools.lru_cache(maxsize=256)
def planned_decode_config(
    entry: DecodePlanEntry, head_size: int, queries_per_kv: int, dtype: torch.dtype, query_len: int
) -> KernelConfig:
    """The decode launch's tiles under a KVLLM_TRITON_DECODE_PLAN entry (rows as decode_config sets them)."""
    rows = decode_config(head_size, queries_per_kv, dtype, query_len).block_m
    return KernelConfig(
        block_m=rows, tile_n=entry.tile_n, num_warps=entry.num_warps, num_stages=entry.num_stages
    )


class TritonAttentionImpl(AttentionImpl):
    """Writes K/V with the Triton KV-write kernel, then runs the unified attention kernel.

    `decode_config` / `prefill_config` override the shape-chosen tile sizes (tests, tuning).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_type != "decoder":
            raise NotImplementedError(
                f"TRITON_ATTN does not support attention type {self.attn_type} (supported: decoder)"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            self.sliding_window = None
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            self.logits_soft_cap = None
        self.fp8_dtype = FP8_TORCH_DTYPES.get(self.kv_cache_dtype)
        self.decode_config: KernelConfig | None = None
        self.prefill_config: KernelConfig | PrefillConfig | None = None  # None: routed per step
        self.prefill_mode = prefill_kernel_mode()  # read once: the piecewise runner's copies follow it
        self._prefill_configs: dict[tuple[bool, torch.dtype, int], KernelConfig | PrefillConfig] = {}

    def kv_cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    def reads_written_kv(self) -> bool:
        # Only the prefill kernel reads the step's K/V from the inputs (PrefillConfig.new_kv); the unified
        # kernel reads the cache. By default (auto) few steps take the prefill kernel, so the piecewise
        # runner is not asked to copy every step's K/V: those steps gather theirs back from the cache
        # (`_prefill_launch`). Tests and benchmarks that pass a PrefillConfig call forward directly.
        return self.prefill_mode == "on" or isinstance(self.prefill_config, PrefillConfig)

    def _prefill_launch(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TritonAttentionMetadata,
        kv_written: bool,
        dtype: torch.dtype,
    ) -> tuple[KernelConfig | PrefillConfig | None, torch.Tensor | None, torch.Tensor | None]:
        """The prefill requests' launch config, decided here once (the prefill kernel's for long chunks, by
        `prefill_mode`; else the unified kernel's), and the step's K/V for the prefill kernel: `key`/`value`
        when they hold it; when the layer stored them and the piecewise runner may have left these
        arguments unstaged (`reads_written_kv` False), read back from the cache, or None (never read)."""
        cfg = self.prefill_config
        num_prefill_reqs = md.num_reqs - md.num_decode_reqs
        if cfg is None and num_prefill_reqs > 0:
            routed = routes_to_prefill_kernel(
                md.num_actual_tokens - md.num_decode_reqs, num_prefill_reqs, self.prefill_mode
            )
            cfg = self._default_prefill_config(routed, dtype, key_cache.shape[1])
        staged = not kv_written or self.reads_written_kv()
        if staged:
            return cfg, key, value
        if not isinstance(cfg, PrefillConfig) or key_cache.dtype in FP8_DTYPES:  # fp8: it reads the cache
            return cfg, None, None
        return cfg, *gather_step_kv(key_cache, value_cache, md.slot_mapping)

    def _default_prefill_config(
        self, routed: bool, dtype: torch.dtype, block_size: int
    ) -> KernelConfig | PrefillConfig:
        cache_key = (routed, dtype, block_size)
        cfg = self._prefill_configs.get(cache_key)
        if cfg is None:
            queries_per_kv = self.num_heads // self.num_kv_heads
            if routed:
                cfg = prefill_kernel_config(self.head_size, queries_per_kv, dtype, block_size)
            else:
                cfg = prefill_config(self.head_size, queries_per_kv, dtype)
            self._prefill_configs[cache_key] = cfg
        return cfg

    def _planned_config(self, md: TritonAttentionMetadata, dtype: torch.dtype) -> KernelConfig | None:
        if md.decode_plan is None or md.num_decode_reqs == 0:
            return None
        queries_per_kv = self.num_heads // self.num_kv_heads
        return planned_decode_config(
            md.decode_plan, self.head_size, queries_per_kv, dtype, md.decode_query_len
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """As AttentionImpl.forward; `output` ([T, Hq, D], head dim contiguous) receives the result if given;
        `kv_written`: the layer already stored this step's K/V (see `kv_cache_views`)."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        cache_is_fp8 = key_cache.dtype in FP8_DTYPES
        if (self.fp8_dtype is not None and key_cache.dtype != self.fp8_dtype) or (
            self.fp8_dtype is None and cache_is_fp8
        ):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} does not match the KV cache tensor dtype {key_cache.dtype}"
            )
        md = attn_metadata
        if not kv_written:
            reshape_and_cache(
                key, value, key_cache, value_cache, md.slot_mapping, layer.k_scale, layer.v_scale,
                num_tokens=md.slot_mapping.shape[0],
            )  # fmt: skip
        out = (
            output if output is not None else torch.empty(query.shape, dtype=query.dtype, device=query.device)
        )
        prefill_cfg, key, value = self._prefill_launch(
            key, value, key_cache, value_cache, md, kv_written, query.dtype
        )
        return unified_attention(
            out, query, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table,
            num_reqs=md.num_reqs,
            num_tokens=md.num_actual_tokens,
            num_decode_reqs=md.num_decode_reqs,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            num_splits=md.num_splits,
            decode_order=md.decode_order,
            decode_query_len=md.decode_query_len,
            decode_cfg=self.decode_config or self._planned_config(md, query.dtype),
            prefill_cfg=prefill_cfg,
            key=key,
            value=value,
        )  # fmt: skip
