"""`fused_experts`: the MoE feed-forward for precomputed routing, dispatched to Triton or plain torch."""

from __future__ import annotations

import torch

from kvllm.layers.moe.fused_moe_torch import fused_experts_torch
from kvllm.layers.ops.dispatch import use_fused_ops


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) -> [T, H].

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k] with
    ids in [0, E) (not checked: that would sync with the host). Runs the grouped-GEMM Triton kernels
    where fused ops are on for these tensors (CUDA by default, see kvllm/layers/ops/dispatch.py), else
    the per-expert torch loop.
    """
    if use_fused_ops(hidden_states):
        from kvllm.layers.moe.fused_moe_triton import fused_experts_triton

        return fused_experts_triton(
            hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias
        )
    return fused_experts_torch(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
