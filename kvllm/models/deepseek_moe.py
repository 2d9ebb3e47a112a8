"""DeepSeek's mixture of experts: V2's softmax and V3's sigmoid-with-bias group-limited routing, plus
shared experts. The expert computation itself is kvllm.layers.moe.FusedMoE's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.moe import FusedMoE


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """bool [T, E]: the experts of each token's `topk_group` best groups."""
    num_groups = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask[:, :, None].expand(-1, -1, scores.shape[-1] // num_groups).reshape(scores.shape)


def softmax_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int | None,
    topk_group: int | None,
    group_limited: bool,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax over experts; `group_limited_greedy` keeps the `topk_group` groups with the
    best single expert score; top-k of what is left; weights scaled by routed_scaling_factor.

    `renormalize` (norm_topk_prob) makes the k weights sum to one first, as DeepSeek's own code and vLLM
    do; HF transformers 5's DeepseekV2 ignores norm_topk_prob (every released V2 has it False).
    """
    scores = router_logits.float().softmax(dim=-1)
    if group_limited and num_groups and num_groups > 1:
        group_scores = scores.view(scores.shape[0], num_groups, -1).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(scores, group_scores, int(topk_group)), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def sigmoid_grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int | None,
    topk_group: int | None,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; experts are chosen on score + e_score_correction_bias, within the
    `topk_group` groups whose two best biased scores sum highest; weights are the unbiased scores,
    renormalised when norm_topk_prob, times routed_scaling_factor."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    if num_groups and num_groups > 1:
        group_scores = choice.view(choice.shape[0], num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(choice, group_scores, int(topk_group)), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    """Routed experts (FusedMoE) plus shared experts; the router runs in float32 as DeepSeek's does."""

    def __init__(self, hf_config: Any, layer_index: int, shared_mlp_cls: type[nn.Module]) -> None:
        super().__init__()
        self.is_v3 = getattr(hf_config, "model_type", "") == "deepseek_v3"
        num_experts = hf_config.n_routed_experts
        self.top_k = hf_config.num_experts_per_tok
        self.num_groups = getattr(hf_config, "n_group", None)
        self.topk_group = getattr(hf_config, "topk_group", None)
        self.topk_method = getattr(hf_config, "topk_method", "greedy") or "greedy"
        if not self.is_v3 and self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method={self.topk_method!r} is not supported for DeepSeek-V2 "
                "(supported: greedy, group_limited_greedy)"
            )
        self.renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
        self.routed_scaling_factor = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        # Router weights stay float32 whatever the model dtype (transformers keeps them so too).
        self.gate = nn.Linear(hf_config.hidden_size, num_experts, bias=False, dtype=torch.float32)
        if self.is_v3:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        self.experts = FusedMoE(
            num_experts,
            self.top_k,
            hf_config.hidden_size,
            hf_config.moe_intermediate_size,
            renormalize=False,
            prefix=f"model.layers.{layer_index}.mlp.experts",
        )
        num_shared = getattr(hf_config, "n_shared_experts", None) or 0
        self.shared_experts = (
            shared_mlp_cls(hf_config.hidden_size, hf_config.moe_intermediate_size * num_shared)
            if num_shared
            else None
        )

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.float(), self.gate.weight.float())
        if self.is_v3:
            return sigmoid_grouped_topk(
                logits,
                self.gate.e_score_correction_bias,
                self.top_k,
                self.num_groups,
                self.topk_group,
                self.renormalize,
                self.routed_scaling_factor,
            )
        return softmax_grouped_topk(
            logits,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.topk_method == "group_limited_greedy",
            self.renormalize,
            self.routed_scaling_factor,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden_states)
        out = self.experts.forward_experts(hidden_states, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out
