"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.ops.dispatch import use_fused_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [..., 2 * d] holding gate then up (a fused gate_up projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_ops(x):
            from kvllm.layers.ops.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up (GeGLU) on [..., 2 * d] holding gate then up; `approximate="tanh"` is HF's
    "gelu_pytorch_tanh" (Gemma)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximation must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
