"""gpt-oss: the Llama decoder with attention sinks, alternating sliding-window and full layers, YaRN
RoPE, biases on every attention projection, and a mixture of experts with a biased router and a clamped
SwiGLU.

Routing takes the top-k router logits, then a softmax over just those. The experts compute
(up + 1) * gate * sigmoid(1.702 * gate) with gate clamped above at 7 and up to [-7, 7] (FusedMoE's
"swigluoai" activation). Checkpoints store the experts stacked and transposed, gate and up interleaved
in columns: `experts.gate_up_proj` [E, H, 2I] (gate = [..., 0::2], up = [..., 1::2]), its bias
[E, 2I], `experts.down_proj` [E, I, H], its bias [E, H]. Only bf16/fp16/fp32 expert weights load; the
released MXFP4 checkpoints are rejected by `unsupported_config_reason` before any weight is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvllm.layers.moe import FusedMoE, topk_softmax
from kvllm.layers.moe.fused_moe_torch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from kvllm.models.llama import LlamaForCausalLM


class GptOssMoE(nn.Module):
    """Router (`router`, linear with bias) and experts (`experts`, FusedMoE with biases)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        alpha, limit = (
            getattr(hf_config, "swiglu_alpha", SWIGLU_OAI_ALPHA),
            getattr(hf_config, "swiglu_limit", SWIGLU_OAI_LIMIT),
        )
        if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
            raise ValueError(
                f"gpt-oss swiglu_alpha={alpha}, swiglu_limit={limit} are not supported "
                f"(kvllm implements {SWIGLU_OAI_ALPHA} and {SWIGLU_OAI_LIMIT}, the released models' values)"
            )
        self.top_k = hf_config.num_experts_per_tok
        self.router = nn.Linear(hf_config.hidden_size, hf_config.num_local_experts, bias=True)
        self.experts = FusedMoE(
            hf_config.num_local_experts,
            self.top_k,
            hf_config.hidden_size,
            hf_config.intermediate_size,
            activation="swigluoai",
            has_bias=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = topk_softmax(self.router(hidden_states), self.top_k)
        return self.experts.forward_experts(hidden_states, topk_weights, topk_ids)


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] with all gate columns, then all up columns."""
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)


def _expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with the experts in FusedMoE's layout and names, the sinks under the attention."""
    for name, tensor in weights:
        if name.endswith(".mlp.experts.gate_up_proj"):
            yield name.replace("gate_up_proj", "w13_weight"), _deinterleave(tensor).transpose(1, 2)
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            yield name.replace("gate_up_proj_bias", "w13_bias"), _deinterleave(tensor)
        elif name.endswith(".mlp.experts.down_proj"):
            yield name.replace("down_proj", "w2_weight"), tensor.transpose(1, 2)
        elif name.endswith(".mlp.experts.down_proj_bias"):
            yield name.replace("down_proj_bias", "w2_bias"), tensor
        elif name.endswith(".self_attn.sinks"):
            yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
        else:
            yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / 120b (bf16 checkpoints). Sinks and windows reach the backend through
    `layer_attention_settings`."""

    supports_tensor_parallel = False  # its experts and sinks are not split yet
    qkv_bias = None  # the config's attention_bias (True for the released models)
    supports_quantization = False  # its experts and MLP take no quantization method yet

    @staticmethod
    def make_mlp(hf_config: Any, layer_index: int) -> nn.Module:
        return GptOssMoE(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_expert_tensors(weights))
