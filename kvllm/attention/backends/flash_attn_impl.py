"""FLASH_ATTN kernel side: FlashAttention-4 `flash_attn_varlen_func` with a page table.

The whole step (decode tokens first, then prefill chunks) goes through one varlen call:
FA4's causal mask is aligned to the end of each sequence, which is exactly kvllm's semantics
(token i of request r sits at position seq_lens[r] - query_len[r] + i).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvllm.attention.impl import AttentionImpl, AttentionLayer, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.attention.ops.paged_cache_write import write_kv_to_paged_cache

_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class FlashAttentionMetadata:
    """One step's batch in the form FA4's varlen kernel takes it."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1] = cu_seqlens_q
    seq_lens: torch.Tensor  # int32 [num_reqs] = seqused_k
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], contiguous = page_table
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]; -1 = do not write
    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Passes the common metadata through, with the dtypes and contiguity FA4 asserts on.

    For CUDA graphs (uniform decode), the batch is copied into buffers allocated once at maximum
    sizes, and the launch sizes are fixed: max_seqlen_q = 1, max_seqlen_k = max_model_len.
    Padded requests have query length 0 and seqused_k 0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        max_blocks = -(-self.max_model_len // self.kv_cache_spec.block_size)
        device = self.device
        self._query_start_loc = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self._block_table = torch.zeros(self.max_num_reqs, max_blocks, dtype=torch.int32, device=device)
        self._slot_mapping = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=device)

    def prepare_for_capture(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self._build_static(common)

    def prepare_for_replay(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self._build_static(common)

    def _build_static(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
        if common.max_query_len > 1 or num_reqs > self.max_num_reqs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"FLASH_ATTN graphs take uniform decode batches of at most {self.max_num_reqs} requests "
                f"(got {num_reqs} requests, {num_tokens} tokens, max query length {common.max_query_len})"
            )
        cols = common.block_table.shape[1]
        self._query_start_loc[: num_reqs + 1].copy_(common.query_start_loc, non_blocking=True)
        self._seq_lens[:num_reqs].copy_(common.seq_lens, non_blocking=True)
        self._block_table[:num_reqs, :cols].copy_(common.block_table, non_blocking=True)
        self._slot_mapping[:num_tokens].copy_(common.slot_mapping[:num_tokens], non_blocking=True)
        return FlashAttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self._query_start_loc[: num_reqs + 1],
            seq_lens=self._seq_lens[:num_reqs],
            block_table=self._block_table[:num_reqs],
            slot_mapping=self._slot_mapping[:num_tokens],
            causal=common.causal,
        )

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return FlashAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=common.seq_lens.to(torch.int32).contiguous(),
            block_table=common.block_table.to(torch.int32).contiguous(),
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            causal=common.causal,
        )


def _load_varlen_kernel() -> Callable[..., Any]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError(
            "FLASH_ATTN needs FlashAttention-4 (module flash_attn.cute): pip install 'kvllm[flash-attn]'. "
            f"Import failed with: {exc}"
        ) from exc
    return flash_attn_varlen_func


class FlashAttentionImpl(AttentionImpl):
    """One layer's attention through FA4: cache write, then one varlen call for the whole batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(
                f"FLASH_ATTN: kv_cache_dtype {self.kv_cache_dtype} not supported (supported: auto, bfloat16, float16)"
            )
        if self.attn_type != "decoder":
            raise ValueError(
                f"FLASH_ATTN: attention type {self.attn_type} not supported (supported: decoder)"
            )
        # Our window w admits keys k with p - w < k; FA's left window admits p - k <= left.
        self.window_size = (self.sliding_window - 1, 0) if self.sliding_window else (None, None)
        self._varlen = _load_varlen_kernel()

    def kv_cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if not kv_written:
            write_kv_to_paged_cache(
                key_cache, value_cache, key[:num_tokens], value[:num_tokens], attn_metadata.slot_mapping
            )
        sinks = self.sinks
        if sinks is not None and sinks.dtype not in _SINK_DTYPES:
            sinks = sinks.float()
        # q arrives as a strided view of the fused qkv buffer; FA4's support for that was read in its
        # source, not run on a GPU, so it gets a contiguous copy (one small kernel beside the call).
        result = self._varlen(
            q=query[:num_tokens].contiguous(),
            k=key_cache,
            v=value_cache,
            cu_seqlens_q=attn_metadata.query_start_loc,
            seqused_k=attn_metadata.seq_lens,
            max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len,
            page_table=attn_metadata.block_table,
            softmax_scale=self.scale,
            causal=attn_metadata.causal,
            window_size=self.window_size,
            learnable_sink=sinks,
            softcap=self.logits_soft_cap or 0.0,
        )
        # FA4 returns (out, lse); older builds returned out alone.
        out = result[0] if isinstance(result, tuple) else result
        if num_tokens == query.shape[0]:
            return out
        padded = torch.zeros_like(query)
        padded[:num_tokens] = out
        return padded
