"""The model-facing MLA layer: latent in, backend-computed attention out (DeepSeek-V2/V3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.forward_context import get_forward_context

if TYPE_CHECKING:
    from kvllm.attention.backend import AttentionBackend
    from kvllm.attention.backends.mla.common_impl import MLAAttentionImpl, MLAPrefillImpl


class MLAAttention(nn.Module):
    """One MLA layer. The model runner binds an MLA backend implementation and a latent cache to it.

    Its cache is one tensor (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim); the backend
    declares that shape (`MLABackend.get_kv_cache_shape`) and the worker sizes it.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.prefix = prefix
        # An fp8 latent cache stores latent / k_scale; 1.0 unless a checkpoint provides it.
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.impl: MLAAttentionImpl | None = None
        self.kv_cache: torch.Tensor = torch.empty(0)

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bind_backend(
        self, backend: type[AttentionBackend], kv_cache_dtype: str, prefill_impl: MLAPrefillImpl | None = None
    ) -> None:
        self.impl = backend.get_impl_cls()(
            num_heads=self.num_heads,
            scale=self.scale,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            kv_cache_dtype=kv_cache_dtype,
            prefill_impl=prefill_impl,
        )

    def forward(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, qk_nope + rope] (rope part rotated), kv_c_normed [T, kv_lora_rank], k_pe [T, rope]
        (rotated), kv_b_weight: kv_b_proj's [H * (qk_nope + v), kv_lora_rank] -> [T, H * v_head_dim]."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            return self._profile_forward(q, kv_c_normed, k_pe, kv_b_weight)
        if self.impl is None:
            raise RuntimeError(f"MLA layer {self.prefix!r} has no backend bound")
        return self.impl.forward(self, q, kv_c_normed, k_pe, self.kv_cache, attn_metadata, kv_b_weight)

    def _profile_forward(
        self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor
    ) -> torch.Tensor:
        """Memory-profiling run (no cache yet): up-projected causal attention over the batch as one sequence."""
        num_tokens, H, P = q.shape[0], self.num_heads, self.qk_nope_head_dim
        kv = F.linear(kv_c, kv_b_weight).view(num_tokens, H, P + self.v_head_dim)
        k_nope, v = kv.split([P, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, H, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale
        )
        return out.transpose(0, 1).reshape(num_tokens, H * self.v_head_dim)
