"""The torch side of TRITON_ATTN: per-step metadata builder and per-layer implementation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvllm.attention.impl import AttentionImpl, AttentionLayer, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
from kvllm.attention.ops.triton_unified_attention import MAX_SEGMENTS, KernelConfig, unified_attention
from kvllm.utils.dtypes import FP8_DTYPES, FP8_TORCH_DTYPES

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
        self.decode_order = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self._sorted_seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)

    def num_splits_for(self, num_decode_reqs: int, max_seq_len: int) -> int:
        """KV segments for the decode launch: split only when too few programs fill the GPU."""
        programs = num_decode_reqs * self.kv_cache_spec.num_kv_heads
        if programs == 0 or programs >= self.split_below * self.num_sms:
            return 1
        by_occupancy = 1 << (-(-self.split_target * self.num_sms // programs) - 1).bit_length()
        by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
        by_length = 1 << (by_length.bit_length() - 1)
        return max(1, min(by_occupancy, by_length, MAX_SEGMENTS))

    def orders_decodes(self, num_decode_reqs: int, num_splits: int) -> bool:
        """Whether the decode launch starts its programs longest request first: an unsplit launch of more
        programs than the GPU has SMs (a split launch has fewer than 2 per SM: about one wave, no tail to
        order)."""
        programs = num_decode_reqs * self.kv_cache_spec.num_kv_heads
        return (
            self.longest_first
            and num_splits == 1
            and programs > self.num_sms
            and num_decode_reqs <= MAX_GRID_Y
        )

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        _check_causal(common)
        num_decodes = common.num_decodes
        num_splits = self.num_splits_for(num_decodes, common.max_seq_len)
        decode_order = None
        if self.orders_decodes(num_decodes, num_splits):
            decode_order = torch.sort(common.seq_lens[:num_decodes], descending=True).indices
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
        num_splits = self.num_splits_for(num_decode_reqs, self.max_model_len)
        decode_order = None
        if self.orders_decodes(num_decode_reqs, num_splits):
            # Refilled before every replay, like the buffers above (padding requests, length 0, sort last).
            decode_order = self.decode_order[:num_decode_reqs]
            torch.sort(
                self.seq_lens[:num_decode_reqs],
                descending=True,
                out=(self._sorted_seq_lens[:num_decode_reqs], decode_order),
            )
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
        )


def _check_causal(common: CommonAttentionMetadata) -> None:
    if not common.causal:
        raise NotImplementedError("TRITON_ATTN implements causal attention only (non-causal is not declared)")


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
        self.prefill_config: KernelConfig | None = None

    def kv_cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

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
            decode_cfg=self.decode_config,
            prefill_cfg=self.prefill_config,
            key=key,
            value=value,
        )  # fmt: skip
