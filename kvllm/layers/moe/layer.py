"""`FusedMoE`: the experts of one MoE layer as stacked tensors, loaded from HF per-expert checkpoints.

Parameters (vLLM's names): `w13_weight` [E, 2I, H] (each expert's gate rows, then its up rows),
`w2_weight` [E, H, I], and with `has_bias` `w13_bias` [E, 2I] and `w2_bias` [E, H]. Checkpoints
name each expert's matrices separately (`experts.N.gate_proj/up_proj/down_proj`, Mixtral's
`experts.N.w1/w3/w2`); `make_expert_params_mapping` turns those names into the stacked parameter plus
(expert, shard), and `weight_loader` copies one expert's matrix into its rows.

Tensor parallel: every rank holds every expert, with 1/N of its intermediate size (its slice of the
gate and up rows and of the down columns); the ranks' outputs are summed (one all-reduce), and the
down projection's bias is held by rank 0 alone so that it is counted once. At TP=1 nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvllm.distributed.communication import tensor_model_parallel_all_reduce
from kvllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from kvllm.layers.linear import default_weight_loader
from kvllm.layers.moe.fused_moe import fused_experts
from kvllm.layers.moe.router import softmax_topk

# shard ids: w1 = gate, w3 = up (both in w13), w2 = down
_SHARDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    """E experts of SwiGLU-style MLPs (gate, up, down), top-k routed.

    `forward(hidden_states, router_logits)` routes with a softmax top-k; models with their own routing
    (gpt-oss, DeepSeek's grouped top-k) compute (topk_weights, topk_ids) and call `forward_experts`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        activation: str = "silu",
        has_bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"{prefix}: the experts' intermediate size {intermediate_size} does not split over "
                f"tensor_parallel_size={self.tp_size}"
            )
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's
        self.renormalize = renormalize
        self.activation = activation
        self.prefix = prefix
        intermediate_size = self.intermediate_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        self.w13_bias = (
            nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size), requires_grad=False)
            if has_bias
            else None
        )
        self.w2_bias = (
            nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False) if has_bias else None
        )
        for param in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def make_expert_params_mapping(
        ckpt_gate_proj_name: str, ckpt_down_proj_name: str, ckpt_up_proj_name: str, num_experts: int
    ) -> list[tuple[str, str, int, str]]:
        """(parameter prefix, checkpoint fragment, expert id, shard id) for every expert matrix.

        A checkpoint name containing the fragment `experts.{N}.{ckpt name}.` becomes the parameter with
        that fragment replaced by `experts.w13_` or `experts.w2_` (so `.weight` / `.bias` follow), as vLLM's.
        """
        mapping = []
        for expert in range(num_experts):
            for shard, ckpt_name in (
                ("w1", ckpt_gate_proj_name),
                ("w2", ckpt_down_proj_name),
                ("w3", ckpt_up_proj_name),
            ):
                param_prefix = "experts.w2_" if shard == "w2" else "experts.w13_"
                mapping.append((param_prefix, f"experts.{expert}.{ckpt_name}.", expert, shard))
        return mapping

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Copy one expert's gate (w1), up (w3) or down (w2) matrix or bias into the stacked `param`;
        without a shard and an expert, a checkpoint tensor already stacked as `param` is (gpt-oss)."""
        if shard_id is None and expert_id is None:
            if self.tp_size > 1:
                raise ValueError(
                    f"{self.prefix}: the checkpoint stacks the experts in one tensor, which kvllm does not "
                    f"split for tensor_parallel_size={self.tp_size}; use tensor_parallel_size=1"
                )
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in _SHARDS or expert_id is None:
            raise ValueError(f"MoE shard id must be one of {_SHARDS}, got {shard_id!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(
                f"expert id {expert_id} out of range for {self.num_experts} experts ({self.prefix})"
            )
        target = param.data[expert_id]
        if self.tp_size > 1:
            loaded_weight = self._tensor_parallel_part(param, loaded_weight, shard_id)
        if shard_id == "w1":
            target = target.narrow(0, 0, self.intermediate_size)
        elif shard_id == "w3":
            target = target.narrow(0, self.intermediate_size, self.intermediate_size)
        default_weight_loader(target, loaded_weight)

    def _tensor_parallel_part(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> torch.Tensor:
        """This rank's part of one expert's matrix or bias: its intermediate slice (rows of gate/up,
        columns of down); the down bias on rank 0 only (zeros elsewhere: the all-reduce adds it once)."""
        size = self.intermediate_size
        if shard_id != "w2":
            return loaded_weight.narrow(0, self.tp_rank * size, size)
        if param is self.w2_bias:
            return loaded_weight if self.tp_rank == 0 else torch.zeros_like(loaded_weight)
        return loaded_weight.narrow(1, self.tp_rank * size, size)

    def forward_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [T, H] with precomputed routing [T, k] -> [T, H]."""
        out = fused_experts(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            activation=self.activation,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
        )
        return out if self.tp_size == 1 else tensor_model_parallel_all_reduce(out)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] -> [T, H], routed by softmax top-k."""
        topk_weights, topk_ids = softmax_topk(router_logits, self.top_k, self.renormalize)
        return self.forward_experts(hidden_states, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation}"
        )
