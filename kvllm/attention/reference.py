"""Float32 reference for paged attention, and random paged batches to test kernels against it.

Used by the kernel tests, the declared-equals-implemented test and `kvllm bench attention`
(which checks every kernel against this reference before timing it). Deliberately plain torch,
one request at a time: obviously correct beats fast here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvllm.attention.metadata import CommonAttentionMetadata


def reference_attention(
    query: torch.Tensor,  # [T, Hq, D]
    keys: list[torch.Tensor],  # per request [seq_len, Hkv, D]: the whole context incl. new tokens
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:
    """Attention in float32 with the semantics documented on AttentionImpl; returns [T, Hq, D]."""
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    start = 0
    for k, v, qlen in zip(keys, values, query_lens):
        seq_len = k.shape[0]
        q = query[start : start + qlen].float()
        group = num_heads // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kf) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = torch.ones(qlen, seq_len, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, qlen, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, vf)
        start += qlen
    return out


@dataclass
class PagedBatch:
    """A random mixed batch over a paged cache with scrambled block tables."""

    query: torch.Tensor  # [T, Hq, D]
    new_keys: torch.Tensor  # [T, Hkv, D]: K of the query tokens, to be written by the kernel
    new_values: torch.Tensor
    keys: list[torch.Tensor]  # per request, whole context [seq_len, Hkv, D]
    values: list[torch.Tensor]
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    num_blocks: int
    block_table: torch.Tensor  # int32 [R, max_blocks]
    metadata: CommonAttentionMetadata

    def pages(self, r: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in the block) of request r's tokens at `positions`, on their device."""
        blocks = self.block_table[r].to(positions.device).long()[positions // self.block_size]
        return blocks, positions % self.block_size

    def cached_context(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(blocks, offsets, keys, values) of each request's already-cached context (not the new tokens)."""
        for r, (k, v, qlen) in enumerate(zip(self.keys, self.values, self.query_lens)):
            ctx = k.shape[0] - qlen
            if ctx:
                yield *self.pages(r, torch.arange(ctx, device=k.device)), k[:ctx], v[:ctx]

    def fill_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Write the already-cached context (not the new tokens) into [num_blocks, block_size, Hkv, D] views."""
        for blocks, offsets, k, v in self.cached_context():
            key_cache[blocks, offsets] = k.to(key_cache.dtype)
            value_cache[blocks, offsets] = v.to(value_cache.dtype)

    def reference(self, scale: float, **kwargs: object) -> torch.Tensor:
        return reference_attention(self.query, self.keys, self.values, self.query_lens, scale, **kwargs)


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    extra_blocks: int = 3,
) -> PagedBatch:
    """Random q/k/v for requests with the given query and cached-context lengths.

    Requests should be ordered decodes (query length 1) first, as the scheduler orders them.
    Physical blocks are a random permutation, so kernels cannot rely on contiguous tables.
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_req)
    # Unused table entries hold a valid-but-wrong block id: kernels must not read past seq_len.
    block_table = torch.full((len(seq_lens), max_blocks), int(perm[-1]), dtype=torch.int32)
    cursor = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[cursor : cursor + n].to(torch.int32)
        cursor += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [rand(s, num_kv_heads, head_size) for s in seq_lens]
    values = [rand(s, num_kv_heads, head_size) for s in seq_lens]
    total = sum(query_lens)
    query = rand(total, num_heads, head_size)
    new_keys = torch.cat([k[-q:] for k, q in zip(keys, query_lens)])
    new_values = torch.cat([v[-q:] for v, q in zip(values, query_lens)])
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(block_table[r].long()[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    device = torch.device(device)
    metadata = CommonAttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=total,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens_t.to(device),
        seq_lens_cpu=seq_lens_t,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
    )
    return PagedBatch(
        query=query.to(device),
        new_keys=new_keys.to(device),
        new_values=new_values.to(device),
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
        query_lens=list(query_lens),
        seq_lens=seq_lens,
        block_size=block_size,
        num_blocks=num_blocks,
        block_table=block_table.to(device),
        metadata=metadata,
    )
