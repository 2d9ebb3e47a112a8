"""Per-step attention metadata shared by every backend (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """One step's batch, as every attention backend sees it.

    Requests are ordered decodes first: the first `num_decodes` requests have
    `decode_query_len` query tokens each (one, or k + 1 in a full-graph speculative verification,
    where it is a bound: a request with fewer drafts has fewer, a padding request none); the rest ("prefills") have any number >= 1 of query tokens,
    which attend causally to their own earlier tokens and to everything already in the cache for
    that request. Token i of request r sits at absolute position seq_lens[r] - query_len[r] + i.
    """

    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    query_start_loc_cpu: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], device: cached + new tokens
    seq_lens_cpu: torch.Tensor  # int32 [num_reqs]
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], device; unused entries arbitrary
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], device; -1 = do not write (padding)
    causal: bool = True
    decode_query_len: int = 1  # query tokens of every decode request: num_decode_tokens / num_decodes

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """Tokens already in the cache before this step, per request."""
        return self.seq_lens_cpu - self.query_lens_cpu


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer's paged KV cache holds."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype  # storage dtype of the cache (an fp8 dtype for fp8 KV caches)
    kv_cache_dtype: str  # the user's setting: auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2
    # A latent (MLA) cache: one plane of head_size (latent + rotary dims) per token, no separate K and V.
    use_mla: bool = False

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block for one layer: K plus V, or the one latent plane of MLA."""
        planes = 1 if self.use_mla else 2
        return planes * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
