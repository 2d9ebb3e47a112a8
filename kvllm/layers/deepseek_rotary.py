"""DeepSeek's rotary embedding: YaRN scaling with mscale, on the interleaved rope part of q and k.

DeepSeek checkpoints rotate pairs (x0, x1), (x2, x3), ... of the rope dims. HF's DeepSeek-V2 returns
the pairs interleaved, its V3 (`rope_interleave`) returns evens then odds; only q.k is ever used and
both sides get the same layout, so kvllm writes evens-then-odds for both. `interleaved=False` is
V3's plain rotate-half layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvllm.layers.ops.dispatch import use_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(params: dict[str, Any], qk_head_dim: int) -> float:
    """The attention softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        mscale = yarn_get_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


def _yarn(dim: int, params: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) as transformers' YaRN computes them."""
    base = float(params["rope_theta"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class DeepseekRotaryEmbedding(nn.Module):
    """RoPE over the rope part ([T, heads, rotary_dim]) of q and k, computed in float32.

    cos/sin are precomputed for positions [0, max_position) and already multiplied by YaRN's
    attention factor, as transformers applies it.
    """

    def __init__(
        self, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any], interleaved: bool = True
    ) -> None:
        super().__init__()
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported for DeepSeek models; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        with torch.device("cpu"):
            if rope_type == "default":
                base = float(rope_parameters["rope_theta"])
                inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
                attention_factor = 1.0
            else:
                inv_freq, attention_factor = _yarn(rotary_dim, rope_parameters, max_position)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> DeepseekRotaryEmbedding:
        cache = self.cos_sin_cache  # stays float32 when the model is cast
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return self

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q_pe [T, H, R]; k_pe [T, R] -> rotated (q_pe, k_pe)."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R/2]
        q = self._rotate(q_pe, cos[:, None], sin[:, None])
        k = self._rotate(k_pe, cos, sin)
        return q, k

    def rotate_query_and_key(
        self, positions: torch.Tensor, q: torch.Tensor, k_pe: torch.Tensor, nope_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, nope_dim + R] (its last R dims rotated), k_pe [T, R] -> (new q, rotated k_pe).

        One Triton launch where the fused kernels run (kvllm/layers/ops/mla_rope.py), else the torch
        path above and a concatenation; the two round the same float32 values once."""
        if use_fused_ops(q):
            from kvllm.layers.ops.mla_rope import mla_rope

            return mla_rope(positions, self.cos_sin_cache, q, k_pe, nope_dim, self.interleaved)
        q_pe, k_pe = self(positions, q[..., nope_dim:], k_pe)
        return torch.cat([q[..., :nope_dim], q_pe], dim=-1), k_pe
