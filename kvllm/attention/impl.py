"""The torch side of the backend contract: per-layer implementation and per-step metadata builder."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec

if TYPE_CHECKING:
    from kvllm.attention.backend import AttentionBackend


class AttentionLayer(Protocol):
    """What an implementation reads from the layer it serves (kvllm.layers.attention.Attention)."""

    k_scale: torch.Tensor  # float32 scalar: an fp8 cache stores K / k_scale
    v_scale: torch.Tensor  # float32 scalar: an fp8 cache stores V / v_scale


class AttentionImpl(ABC):
    """Per-layer attention: writes new K/V into the paged cache and attends over a mixed batch.

    Semantics every implementation follows (the float32 reference in tests/ encodes them):
    - scores = scale * q.k, then `logits_soft_cap * tanh(scores / logits_soft_cap)` when a cap is set;
    - a query at absolute position p sees keys at positions k <= p (causal) or all keys of its
      request (non-causal); with a sliding window w, only keys with p - w < k;
    - with sinks (one logit per query head), softmax includes exp(sink) in its denominator;
    - an fp8 cache stores K / k_scale and V / v_scale and reads them back multiplied by the scale;
    - GQA: query head h reads KV head h // (num_heads // num_kv_heads).

    This is the contract of caches with separate K and V. A latent (MLA) cache has neither: MLA
    implementations get a sibling base class with their own `forward` (compressed KV plus the
    rotary part, as vLLM's MLAAttentionImpl), a `KVCacheSpec(use_mla=True)` page and their
    backend's `get_kv_cache_shape`.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_cache_dtype: str = "auto",
        sinks: torch.Tensor | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.kv_cache_dtype = kv_cache_dtype
        self.sinks = sinks

    def kv_cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V caches as [num_blocks, block_size, num_kv_heads, head_size] views, for a layer
        that writes this step's K/V itself (fused into its RoPE kernel) and then calls `forward`
        with `kv_written=True`; None when this backend must write them itself."""
        return None

    def reads_written_kv(self) -> bool:
        """Whether `forward(..., kv_written=True)` reads its key/value arguments (else only the cache).
        The piecewise graph runner copies them into its shared buffers only when this is True."""
        return True

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # shape from the backend's get_kv_cache_shape
        attn_metadata: Any,  # what this backend's builder returned
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Store key/value at attn_metadata's slot mapping, then attend for every query token."""


class AttentionMetadataBuilder(ABC):
    """Turns the common per-step metadata into what one backend's kernels need.

    CUDA-graph hooks: the graph runner calls `prepare_for_capture` once per captured batch size
    and `prepare_for_replay` before each replay; builders that keep fixed-size buffers override them.
    `uniform_batch_graphs` (vLLM's UNIFORM_BATCH graph support): the hooks also take uniform decode
    batches of several query tokens per request (`decode_query_len` > 1: speculative verification).
    """

    uniform_batch_graphs: ClassVar[bool] = False

    def __init__(
        self,
        backend: type[AttentionBackend],
        kv_cache_spec: KVCacheSpec,
        device: torch.device,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
    ) -> None:
        self.backend = backend
        self.kv_cache_spec = kv_cache_spec
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for one step."""

    def prepare_for_capture(self, common: CommonAttentionMetadata) -> Any:
        return self.build(common)

    def prepare_for_replay(self, common: CommonAttentionMetadata) -> Any:
        return self.build(common)
