"""Qwen3-MoE and Mixtral: the Llama decoder with a top-k routed mixture of SwiGLU experts as its MLP.

Qwen3-MoE is Qwen3 (QK-norm) whose layers `(i + 1) % decoder_sparse_step == 0` outside `mlp_only_layers`
are sparse (softmax top-k, renormalized when `norm_topk_prob`); Mixtral is Mistral with every layer
sparse and the top-k always renormalized. Checkpoints name each expert's matrices
(`experts.N.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`); FusedMoE
stacks them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvllm.layers.moe import FusedMoE
from kvllm.models.llama import LlamaForCausalLM, llama_mlp


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a bias-free linear map to expert logits) and the experts (`experts`, FusedMoE)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool
    ) -> None:
        super().__init__()
        # A plain nn.Linear, as HF's router: its logits decide the routing, so they follow F.linear exactly.
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """Qwen-MoE's rule for which layers have experts (the others keep a dense MLP)."""
    return (
        layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer_index + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B)."""

    supports_quantization = False  # its MLPs (experts) take no quantization method yet

    qk_norm = True

    @staticmethod
    def make_mlp(hf_config: Any, layer_index: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_index):
            return llama_mlp(hf_config, layer_index)
        return SparseMoeBlock(
            hf_config.hidden_size,
            hf_config.num_experts,
            hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            renormalize=bool(hf_config.norm_topk_prob),
        )

    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.num_experts
        )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (e.g. Mixtral-8x7B): Mistral with every MLP a mixture of `num_local_experts` experts."""

    supports_quantization = False  # its MLPs (experts) take no quantization method yet

    @staticmethod
    def make_mlp(hf_config: Any, layer_index: int) -> nn.Module:
        return SparseMoeBlock(
            hf_config.hidden_size,
            hf_config.num_local_experts,
            hf_config.num_experts_per_tok,
            hf_config.intermediate_size,
            renormalize=True,
        )

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")

    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        return FusedMoE.make_expert_params_mapping("w1", "w2", "w3", self.config.num_local_experts)
