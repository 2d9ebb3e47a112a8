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
