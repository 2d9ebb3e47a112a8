"""The model-facing attention layer: projections in, backend-computed attention out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.forward_context import get_forward_context

if TYPE_CHECKING:
    from kvllm.attention.backend import AttentionBackend
    from kvllm.attention.impl import AttentionImpl


class Attention(nn.Module):
    """One attention layer. The model runner binds a backend implementation and a KV cache to it."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        has_sinks: bool = False,
        attn_type: str = "decoder",
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.prefix = prefix
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if has_sinks else None
        # Scales of an fp8 KV cache (stored = value / scale). 1.0 unless a checkpoint provides them.
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor = torch.empty(0)

    def bind_backend(self, backend: type[AttentionBackend], kv_cache_dtype: str) -> None:
        self.impl = backend.get_impl_cls()(
            num_heads=self.num_heads,
            head_size=self.head_size,
            scale=self.scale,
            num_kv_heads=self.num_kv_heads,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            attn_type=self.attn_type,
            kv_cache_dtype=kv_cache_dtype,
            sinks=self.sinks,
        )

    def kv_write_target(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(key_cache, value_cache, slot_mapping) for a caller that stores this step's K/V itself
        before `forward(..., kv_written=True)`; None when the backend must write them (or there is
        no cache yet: the memory-profiling run)."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None or self.impl is None:
            return None
        views = self.impl.kv_cache_views(self.kv_cache)
        slot_mapping = getattr(attn_metadata, "slot_mapping", None)
        if views is None or slot_mapping is None:
            return None
        return views[0], views[1], slot_mapping

    def query_target(self, num_tokens: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A [num_tokens, num_heads * head_size] buffer for a caller that can write this step's query there
        (the fused RoPE kernel) and pass it to `forward`: the piecewise graphs' shared query buffer, which
        then needs no copy; None outside them."""
        provider = get_forward_context().query_buffer
        return None if provider is None else provider(self, num_tokens, dtype)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_written: bool = False
    ) -> torch.Tensor:
        """query [T, H*D], key/value [T, Hkv*D] -> [T, H*D]. `kv_written`: see `kv_write_target`."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        context = get_forward_context()
        attn_metadata = context.attn_metadata
        if context.attention_hook is not None:
            out = context.attention_hook(self, q, k, v, kv_written)
        elif attn_metadata is None:
            out = self._profile_forward(q, k, v)
        else:
            if self.impl is None:
                raise RuntimeError(f"attention layer {self.prefix!r} has no backend bound")
            extra = {"kv_written": True} if kv_written else {}
            out = self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata, **extra)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def _profile_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Memory-profiling run (no cache yet): the batch attends as one causal sequence."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)
