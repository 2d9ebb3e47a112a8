"""Mixture-of-experts: routing (`softmax_topk`, `topk_softmax`), the expert computation
(`fused_experts`, with a plain-torch and a Triton grouped-GEMM path) and the `FusedMoE` layer."""

from kvllm.layers.moe.fused_moe import fused_experts
from kvllm.layers.moe.fused_moe_torch import fused_experts_torch
from kvllm.layers.moe.layer import FusedMoE
from kvllm.layers.moe.router import softmax_topk, topk_softmax

__all__ = ["FusedMoE", "fused_experts", "fused_experts_torch", "softmax_topk", "topk_softmax"]
