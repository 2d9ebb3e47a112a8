"""The paged KV cache of a drafter's attention layers (a draft model, an EAGLE head, an MTP layer).

A drafter shares the target's paged layout: the same block ids and block table, its own cache
tensors. So a block holds the target's and the drafter's K/V of the same tokens, and preemption,
prefix caching and freeing apply to both at once. The drafter's decode steps (one token per
request) build their metadata here from host positions and the target's block table.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec
from kvllm.layers.attention import Attention
from kvllm.layers.mla_attention import MLAAttention
from kvllm.utils.host_copy import upload_from_host


class DraftKVCache:
    """The drafter's attention layers, bound to the target's backend, and their caches."""

    def __init__(
        self,
        module: nn.Module,
        attn_backend: type[AttentionBackend],
        spec: KVCacheSpec,
        bind: Callable[[Attention | MLAAttention], None],
        device: torch.device,
    ) -> None:
        self.attn_backend = attn_backend
        self.spec = spec
        self.device = device
        self.layers = [m for m in module.modules() if isinstance(m, Attention | MLAAttention)]
        for layer in self.layers:
            bind(layer)
        self.builder = None

    def bytes_per_block(self) -> int:
        return self.spec.page_size_bytes * len(self.layers)

    def initialize(self, num_blocks: int, max_num_reqs: int, max_num_tokens: int, max_model_len: int) -> None:
        spec = self.spec
        for layer in self.layers:
            layer.kv_cache = self.attn_backend.allocate_kv_cache(
                num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, self.device
            )
        self.builder = self.attn_backend.get_builder_cls()(
            self.attn_backend, spec, self.device, max_num_reqs, max_num_tokens, max_model_len
        )

    def build(self, common: CommonAttentionMetadata):
        """The backend's metadata for one forward pass of the drafter."""
        assert self.builder is not None, "initialize() first"
        return self.builder.build(common)

    def decode_metadata(
        self,
        positions: np.ndarray,
        rows: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
        pad_to: int | None = None,
    ) -> CommonAttentionMetadata:
        """One query token per request: request i's token sits at `positions[i]` of token-table row
        `rows[i]` and attends to everything before it (its slots must be allocated). With `pad_to`
        (a CUDA-graph size) requests n..pad_to-1 are padding: no token, sequence length 0, slot -1."""
        n = len(rows)
        size = n if pad_to is None else pad_to
        block_size = self.spec.block_size
        slots = np.full(size, -1, dtype=np.int64)
        slots[:n] = (
            block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        )
        seq_lens = np.zeros(size, dtype=np.int32)
        seq_lens[:n] = positions + 1
        qsl = torch.from_numpy(np.minimum(np.arange(size + 1), n).astype(np.int32))
        table_rows = np.full(size, rows[0], dtype=np.int64)
        table_rows[:n] = rows
        device = self.device
        # Uploads through pinned memory: a proposal step never waits for the previous one to finish.
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            num_decodes=size,
            num_decode_tokens=size,
            query_start_loc=upload_from_host(qsl, device),
            query_start_loc_cpu=qsl,
            seq_lens=upload_from_host(torch.from_numpy(seq_lens), device),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            block_table=block_table_gpu[
                upload_from_host(torch.from_numpy(table_rows), device),
                : int(positions.max()) // block_size + 1,
            ],
            slot_mapping=upload_from_host(torch.from_numpy(slots), device),
        )

    def capture_metadata(self, num_reqs: int) -> CommonAttentionMetadata:
        """A dummy decode batch of `num_reqs` requests for a CUDA-graph capture: each has one token
        at position 0 that reads block 0 and writes nothing (slot -1)."""
        zeros = np.zeros(num_reqs, dtype=np.int64)
        table = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        common = self.decode_metadata(zeros, zeros, np.zeros((1, 1), dtype=np.int32), table)
        common.slot_mapping.fill_(-1)
        return common

    def pair_metadata(
        self,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
        pad_to: int | None = None,
    ) -> tuple[CommonAttentionMetadata, np.ndarray]:
        """Two query tokens per request, at positions[i] - 1 and positions[i] (only the first when
        positions[i] has no slot: it is >= limits[i]); and each request's last token's row.

        With `pad_to` (a CUDA-graph size) the batch is a uniform decode of pad_to requests of at most
        two tokens (2 * pad_to token rows, the real ones packed first, the rest padding); without it
        the requests are "prefills" (num_decodes 0), which every backend's general path takes."""
        n = len(rows)
        size = n if pad_to is None else pad_to
        query_lens = np.where(positions < limits, 2, 1)
        qsl = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1 : n + 1])
        qsl[n + 1 :] = qsl[n]
        num_tokens = int(qsl[n])
        num_rows = num_tokens if pad_to is None else 2 * size
        req = np.repeat(np.arange(n), query_lens)
        token_pos = positions[req] - 1 + (np.arange(num_tokens) - qsl[req])
        block_size = self.spec.block_size
        slots = np.full(num_rows, -1, dtype=np.int64)
        slots[:num_tokens] = (
            block_table[rows[req], token_pos // block_size].astype(np.int64) * block_size
            + token_pos % block_size
        )
        seq_lens = np.zeros(size, dtype=np.int32)
        seq_lens[:n] = positions - 1 + query_lens
        table_rows = np.full(size, rows[0], dtype=np.int64)
        table_rows[:n] = rows
        device = self.device
        uniform = pad_to is not None
        qsl_cpu = torch.from_numpy(qsl)
        common = CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=num_rows,
            num_decodes=size if uniform else 0,
            num_decode_tokens=num_rows if uniform else 0,
            query_start_loc=upload_from_host(qsl_cpu, device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=upload_from_host(torch.from_numpy(seq_lens), device),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table=block_table_gpu[
                upload_from_host(torch.from_numpy(table_rows), device),
                : int(positions.max()) // block_size + 1,
            ],
            slot_mapping=upload_from_host(torch.from_numpy(slots), device),
            decode_query_len=2 if uniform else 1,
        )
        return common, (qsl[1 : n + 1] - 1).astype(np.int64)

    def pair_capture_metadata(self, num_reqs: int) -> CommonAttentionMetadata:
        """A dummy batch of `num_reqs` two-token requests (positions 0 and 1, block 0, slots -1)."""
        ones = np.ones(num_reqs, dtype=np.int64)
        table = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        common, _ = self.pair_metadata(
            ones, ones * 0, ones * 2, np.zeros((1, 1), dtype=np.int32), table, pad_to=num_reqs
        )
        common.slot_mapping.fill_(-1)
        return common


def pair_layout(positions: np.ndarray, limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The packed tokens of a two-token proposal step: each one's flat index into the [n, 2] token
    pairs, and its position (int64, int32). A request whose emitted token has no slot keeps one."""
    query_lens = np.where(positions < limits, 2, 1)
    starts = np.cumsum(query_lens) - query_lens
    req = np.repeat(np.arange(len(positions)), query_lens)
    within = np.arange(int(query_lens.sum())) - starts[req]
    return req * 2 + within, (positions[req] - 1 + within).astype(np.int32)
