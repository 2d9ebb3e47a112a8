"""RMSNorm, with the residual add fused in the way decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.ops.dispatch import use_fused_ops


class RMSNorm(nn.Module):
    """Root-mean-square norm. Computes in float32 and scales in the input dtype, as HF Llama/Qwen do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op for x * rsqrt(mean(x^2) + eps) in float32 (each op is a kernel launch on a GPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if use_fused_ops(x):
            from kvllm.layers.ops.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale = 1 + weight), applied in float32
    before the one rounding to the input dtype, as HF's Gemma 2/3 do. Plain torch (no fused kernel)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
