"""EAGLE-3 draft heads for Llama-family targets (SafeAILab/EAGLE's format, e.g.
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a folder with a Llama `config.json` (plus `draft_vocab_size`,
`target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, all
optional) and safetensors named `fc.weight` [hidden, 3 * target_hidden], `midlayer.*` (or
`layers.0.*`: `input_layernorm`, `hidden_norm`, `self_attn.{q,k,v}_proj` reading 2 * hidden,
`o_proj`, `post_attention_layernorm`, `mlp.*`), `norm.weight`, `lm_head.weight` [draft_vocab, hidden],
`d2t` (draft id -> target id offset; `t2d` is ignored) and optionally `embed_tokens.weight` (else the
target's).

The target's input: fc(concat of three of its hidden states), the residual stream entering layers
`aux_hidden_state_layers` (vLLM's default: 2, L // 2, L - 3 of the L target layers). The decoder layer
attends over concat(input_layernorm(embed(t_{p+1})), hidden_norm(h_p)); its output, normed, gives the
logits over the draft vocabulary, and un-normed it is the next drafting step's hidden input.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.linear import QKVLinear
from kvllm.layers.norm import RMSNorm
from kvllm.layers.ops.dispatch import use_fused_ops
from kvllm.layers.rotary import RopeInputs, RotaryEmbedding, rope_parameters_from_config
from kvllm.models.hf_config import head_size, num_kv_heads
from kvllm.models.llama import LlamaAttention, llama_mlp
from kvllm.models.llama_eagle import load_named_weights


def eagle3_aux_layers(hf_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads: the config's, else vLLM's default."""
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    layers = tuple(int(i) for i in ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"EAGLE-3 head: auxiliary hidden-state layers {list(layers)} do not fit a target of "
            f"{num_target_layers} layers (three ids in 0..{num_target_layers - 1} are needed)"
        )
    return layers


class Eagle3DecoderLayer(nn.Module):
    """The head's one layer: attention over [normed embedding, normed hidden state], then the MLP."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        c = hf_config
        bias = bool(getattr(c, "attention_bias", False))
        self.self_attn = LlamaAttention(c, 0, rotary_emb, qkv_bias=bias, qk_norm=False)
        heads, kv_heads, size = c.num_attention_heads, num_kv_heads(c), head_size(c)
        self.self_attn.qkv_proj = QKVLinear(
            2 * c.hidden_size, size, heads, kv_heads, bias=bias, prefix="layers.0.self_attn.qkv_proj"
        )
        self.mlp = llama_mlp(c, 0)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = bool(getattr(c, "norm_before_residual", False))

    def forward(
        self, rope: RopeInputs, embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden_states)
        residual = normed if self.norm_before_residual else hidden_states
        x = self.self_attn(rope, torch.cat([embeds, normed], dim=-1))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """An EAGLE-3 head (see the module docstring)."""

    def __init__(self, hf_config: Any, num_target_layers: int, has_embed_tokens: bool, has_d2t: bool) -> None:
        super().__init__()
        c = self.config = hf_config
        if c.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 head: num_hidden_layers={c.num_hidden_layers}; kvllm runs the published one-layer heads"
            )
        self.draft_vocab_size = int(getattr(c, "draft_vocab_size", None) or c.vocab_size)
        if not has_d2t and self.draft_vocab_size != c.vocab_size:
            raise ValueError(
                f"EAGLE-3 head: draft_vocab_size={self.draft_vocab_size} differs from vocab_size={c.vocab_size} "
                "but the checkpoint has no d2t mapping from draft to target ids"
            )
        self.aux_hidden_state_layers = eagle3_aux_layers(c, num_target_layers)
        target_hidden = int(getattr(c, "target_hidden_size", None) or c.hidden_size)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if has_embed_tokens else None
        self.rotary_emb = rotary = RotaryEmbedding(
            head_size(c), c.max_position_embeddings, rope_parameters_from_config(c)
        )
        self.layers = nn.ModuleList([Eagle3DecoderLayer(c, rotary)])
        self.fc = nn.Linear(3 * target_hidden, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, self.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i] (zeros: the same vocabulary)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        self._target: nn.Module | None = None  # not a submodule: its weights stay the target's

    def attach_target(self, target: nn.Module) -> None:
        """Read the target's embedding when the checkpoint has none, and have it keep the hidden
        states this head reads."""
        object.__setattr__(self, "_target", target)
        target.set_aux_hidden_state_layers(self.aux_hidden_state_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        assert self._target is not None, "attach_target() first"
        return self._target.model.embed_tokens(input_ids)

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target_hidden] (the three auxiliary states, concatenated) -> [T, hidden]."""
        return self.fc(target_hidden)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden states for the LM head, pre-norm ones for the next drafting step)."""
        embeds = self.embed(input_ids)
        rope = self.rotary_emb.prepare(positions, embeds.dtype, fused=use_fused_ops(embeds))
        x, residual = self.layers[0](rope, embeds, hidden_states)
        return self.norm(x, residual)

    def draft_token_ids(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """int64 [N]: the greedy draft of each row, as a target-vocabulary id."""
        draft = F.linear(hidden_states, self.lm_head.weight).argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def named() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name[len("model.") :] if name.startswith("model.") else name
                if name == "t2d":
                    continue
                if name == "d2t":
                    self.d2t.copy_(tensor.to(torch.long))
                    continue
                yield name.replace("midlayer.", "layers.0."), tensor

        return load_named_weights(self, named(), "EAGLE-3 head")
