"""Top-k expert routing: router logits -> (topk_weights, topk_ids) for `fused_experts`.

Routing is kept apart from the expert computation so that other routings (DeepSeek's grouped,
sigmoid-with-bias top-k) produce the same two tensors and reuse the kernels unchanged.
"""

from __future__ import annotations

import torch


def _check_logits(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [num_tokens, num_experts], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(
            f"top_k must be in [1, {router_logits.shape[1]}] (the number of experts), got {top_k}"
        )


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), then the top_k probabilities, renormalized to sum to 1
    when `renormalize` (Mixtral always; Qwen-MoE when `norm_topk_prob`).

    router_logits [T, E] -> topk_weights [T, top_k] float32, topk_ids [T, top_k] int32.
    """
    _check_logits(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k logits first, then a softmax over just those (gpt-oss): weights sum to 1.

    router_logits [T, E] -> topk_weights [T, top_k] float32, topk_ids [T, top_k] int32.
    """
    _check_logits(router_logits, top_k)
    values, topk_ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), topk_ids.to(torch.int32)
