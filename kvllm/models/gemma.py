"""Gemma 2 and Gemma 3 (text): the Llama attention with Gemma's norms, scales and caps.

What differs from Llama: embeddings scaled by sqrt(hidden_size) (rounded to the model dtype, as HF
does); RMSNorm scales by (1 + weight); four norms per layer (before and after attention and the MLP),
residual adds outside the norms; a GeGLU MLP (tanh GELU); attention scaled by query_pre_attn_scalar
** -0.5; sliding-window and full layers alternating by `layer_types`; tied embeddings; final logits
soft-capped (`final_logit_softcapping`). Gemma 2 also soft-caps attention logits; Gemma 3 instead
norms q and k per head and gives sliding and full layers their own RoPE theta.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvllm.layers.activation import GeluAndMul
from kvllm.layers.linear import Linear, MergedLinear
from kvllm.layers.norm import GemmaRMSNorm
from kvllm.layers.ops.dispatch import use_fused_ops
from kvllm.layers.rotary import RopeInputs, RotaryEmbedding, rope_parameters_from_config
from kvllm.layers.vocab_embedding import VocabParallelEmbedding
from kvllm.models.hf_config import head_size, layer_type
from kvllm.models.llama import LlamaAttention, LlamaForCausalLM

_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: down(gelu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        activation = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        if activation not in _GELU_APPROXIMATIONS:
            raise ValueError(
                f"Gemma hidden_activation {activation!r} is not supported (supported: {', '.join(_GELU_APPROXIMATIONS)})"
            )
        size = hf_config.intermediate_size
        self.gate_up_proj = MergedLinear(hf_config.hidden_size, [size, size], bias=False)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[activation])
        self.down_proj = Linear(size, hf_config.hidden_size, bias=False, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm decoder layer: x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        self.layer_type = layer_type(hf_config, layer_index)
        self.self_attn = LlamaAttention(
            hf_config,
            layer_index,
            rotary_emb,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=qk_norm,
            scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            norm_cls=GemmaRMSNorm,
        )
        self.mlp = GemmaMLP(hf_config)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope: RopeInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers, final norm; one RoPE table per layer type when they differ."""

    def __init__(self, hf_config: Any, qk_norm: bool, rope_per_layer_type: bool) -> None:
        super().__init__()
        self.hidden_size = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layer_types = [layer_type(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        self.rotary_embs = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    head_size(hf_config),
                    hf_config.max_position_embeddings,
                    rope_parameters_from_config(hf_config, kind if rope_per_layer_type else None),
                )
                for kind in sorted(set(self.layer_types))
            }
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, i, self.rotary_embs[kind], qk_norm)
            for i, kind in enumerate(self.layer_types)
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        # The fused RoPE kernel norms q and k with Llama's RMSNorm; Gemma's (1 + weight) norm runs in torch.
        self.fused_rope = not qk_norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        hidden_states = hidden_states * torch.tensor(self.hidden_size**0.5, dtype=hidden_states.dtype)
        fused = self.fused_rope and use_fused_ops(hidden_states)
        ropes = {
            kind: emb.prepare(positions, hidden_states.dtype, fused=fused)
            for kind, emb in self.rotary_embs.items()
        }
        for layer, kind in zip(self.layers, self.layer_types):
            hidden_states = layer(ropes[kind], hidden_states)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention logits (through the backend) and final logits."""

    supports_quantization = False  # its MLPs (experts) take no quantization method yet

    qk_norm = False
    rope_per_layer_type = False

    def build_model(self, hf_config: Any) -> nn.Module:
        return GemmaModel(hf_config, self.qk_norm, self.rope_per_layer_type)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden_states, upcast)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): QK-norm, and separate RoPE for sliding (local) and full (global) layers."""

    qk_norm = True
    rope_per_layer_type = True
