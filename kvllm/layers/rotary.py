"""Rotary position embeddings (NeoX / HF "rotate half" layout) with default, linear, llama3 and YaRN scaling."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters_from_config(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of an HF config as one dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; older configs use `rope_scaling` (may be
    None) next to a top-level `rope_theta`. Both are read; explicit keys win over the top-level theta.
    Models with settings per layer type (Gemma 3: "sliding_attention" / "full_attention") nest one
    dict per type in `rope_parameters`; `layer_type` picks one.
    """
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, dict) and layer_type is not None and isinstance(value.get(layer_type), dict):
            value = value[layer_type]
        if isinstance(value, dict):
            params.update(value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    return params


def _yarn_inv_freq(rotary_dim: int, params: dict[str, Any], base: float, max_position: int) -> torch.Tensor:
    """YaRN: frequencies interpolated by `factor` below a band of dimensions, kept above it, ramped in it
    (the band from beta_fast / beta_slow rotations over the original context), as HF computes them."""
    factor = float(params.get("factor") or max_position / params["original_max_position_embeddings"])
    original = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(params: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other rope type)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(params["factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)


def _inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_context_len / high_freq_factor) & (
            wavelen <= old_context_len / low_freq_factor
        )
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, params, base, max_position)
    raise ValueError(
        f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RopeInputs(NamedTuple):
    """One forward pass's RoPE inputs, prepared once for all layers (RotaryEmbedding.prepare)."""

    positions: torch.Tensor  # [T]
    # (cos, sin) [T, 1, rotary_dim / 2] in the activations' dtype for the torch path; None when the
    # layers run the fused kernel, which reads the float32 cache at `positions` itself.
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat q/k ([T, num_heads * head_size]) at given positions.

    cos/sin are precomputed in float32 for positions [0, max_position) and cast to the activations'
    dtype when applied, which is what HF transformers does.
    """

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = int(head_size * float(rope_parameters.get("partial_rotary_factor", 1.0)))
        # Computed on the CPU whatever the default device, so every device gets the same table.
        with torch.device("cpu"):
            inv_freq = _inv_freq(self.rotary_dim, rope_parameters, max_position)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            attention_factor = rope_attention_factor(rope_parameters)
            if attention_factor != 1.0:
                cache = cache * attention_factor
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # Keep the cache in float32 when the module is moved or cast (model.to(bfloat16)).
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return self

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half : self.rotary_dim]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if self.rotary_dim < self.head_size:
            rotated = torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)
        return rotated.reshape(num_tokens, -1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([T, 1, rotary_dim / 2]) for the positions; computed once per forward pass."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RopeInputs:
        """This step's inputs; cos/sin are looked up only for the torch path (`fused` False)."""
        return RopeInputs(positions, None if fused else self.cos_sin(positions, dtype))

    def apply(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(self.cos_sin(positions, query.dtype), query, key)
