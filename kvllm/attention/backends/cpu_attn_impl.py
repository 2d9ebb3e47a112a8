"""CPU_ATTN implementation: vectorised gathers from the paged cache, then SDPA per request group.

The batch is split into its decode part (one query each) and its prefill part; each part is
padded to its longest query and longest context, so a step costs two attention calls per layer
whatever the number of requests, with no Python loop over tokens or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvllm.attention.impl import AttentionImpl, AttentionLayer, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.utils.dtypes import cache_torch_dtype_is_fp8


@dataclass
class PaddedGroup:
    """Requests padded to a common query length Lq and context length Lk."""

    query_index: torch.Tensor  # int64 [B, Lq]: flat token index, clamped (mask hides padding)
    query_valid: torch.Tensor  # bool [B, Lq]
    slot_index: torch.Tensor  # int64 [B, Lk]: flat cache slot of each context position (clamped)
    query_pos: torch.Tensor  # int64 [B, Lq]: absolute position of each query
    key_valid: torch.Tensor  # bool [B, Lk]: position < seq_len

    def mask(self, causal: bool, sliding_window: int | None) -> torch.Tensor:
        """bool [B, 1, Lq, Lk]: which key each query may see."""
        k_pos = torch.arange(self.key_valid.shape[1], device=self.key_valid.device)[None, None, :]
        q_pos = self.query_pos[:, :, None]
        allowed = self.key_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
        if causal:
            allowed = allowed & (k_pos <= q_pos)
        if sliding_window is not None:
            allowed = allowed & (k_pos > q_pos - sliding_window)
        # Padded query rows see key 0 so softmax stays finite; their output is dropped.
        allowed = allowed | (~self.query_valid[:, :, None] & (k_pos == 0))
        return allowed[:, None]


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: list[PaddedGroup]
    causal: bool
    masks: dict[int | None, list[torch.Tensor]]  # per sliding window, one mask per group (lazy)


def _pad_group(common: CommonAttentionMetadata, first: int, last: int, block_size: int) -> PaddedGroup:
    qsl = common.query_start_loc_cpu[first : last + 1].long()
    seq_lens = common.seq_lens_cpu[first:last].long()
    query_lens = qsl[1:] - qsl[:-1]
    max_q = int(query_lens.max())
    max_k = int(seq_lens.max())
    offsets = torch.arange(max_q)[None, :]
    query_valid = offsets < query_lens[:, None]
    query_index = torch.where(query_valid, qsl[:-1, None] + offsets, qsl[:1, None])
    query_pos = (seq_lens - query_lens)[:, None] + offsets
    k_pos = torch.arange(max_k)[None, :]
    key_valid = k_pos < seq_lens[:, None]
    table = common.block_table[first:last].long().cpu()
    block_of_pos = table[:, : -(-max_k // block_size)].gather(
        1, (k_pos // block_size).expand(len(seq_lens), -1)
    )
    slot_index = torch.where(key_valid, block_of_pos * block_size + k_pos % block_size, 0)
    device = common.slot_mapping.device
    return PaddedGroup(
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
        slot_index=slot_index.to(device),
        query_pos=query_pos.to(device),
        key_valid=key_valid.to(device),
    )


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds the padded decode and prefill groups once per step (shared by all layers)."""

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        block_size = self.kv_cache_spec.block_size
        groups = []
        if common.num_decodes:
            groups.append(_pad_group(common, 0, common.num_decodes, block_size))
        if common.num_reqs > common.num_decodes:
            groups.append(_pad_group(common, common.num_decodes, common.num_reqs, block_size))
        return CpuAttentionMetadata(common.slot_mapping, groups, common.causal, masks={})


class CpuAttentionImpl(AttentionImpl):
    """Paged attention with torch ops; see the module docstring."""

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        is_fp8 = cache_torch_dtype_is_fp8(kv_cache.dtype)
        self._write(key_cache, value_cache, key, value, attn_metadata.slot_mapping, layer, is_fp8)

        masks = attn_metadata.masks.get(self.sliding_window)
        if masks is None:
            masks = [g.mask(attn_metadata.causal, self.sliding_window) for g in attn_metadata.groups]
            attn_metadata.masks[self.sliding_window] = masks
        output = torch.empty_like(query)
        for group, mask in zip(attn_metadata.groups, masks):
            k = key_cache[group.slot_index]  # [B, Lk, Hkv, D]
            v = value_cache[group.slot_index]
            if is_fp8:
                k = k.to(query.dtype) * layer.k_scale.to(query.dtype)
                v = v.to(query.dtype) * layer.v_scale.to(query.dtype)
            elif k.dtype != query.dtype:  # a 16-bit cache under a model of another dtype
                k, v = k.to(query.dtype), v.to(query.dtype)
            q = query[group.query_index]  # [B, Lq, H, D]
            out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
            out = out.transpose(1, 2)  # [B, Lq, H, D]
            output[group.query_index[group.query_valid]] = out[group.query_valid]
        return output

    def _write(self, key_cache, value_cache, key, value, slot_mapping, layer, is_fp8) -> None:  # noqa: ANN001
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k, v = key[valid], value[valid]
        if is_fp8:
            k = (k.float() / layer.k_scale).to(key_cache.dtype)
            v = (v.float() / layer.v_scale).to(value_cache.dtype)
        key_cache[slots] = k.to(key_cache.dtype)
        value_cache[slots] = v.to(value_cache.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask [B, 1, Lq, Lk] -> [B, H, Lq, D]."""
        if not self.logits_soft_cap and self.sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scale
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).to(q.dtype)
