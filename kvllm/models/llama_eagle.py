"""EAGLE-1/2 draft heads for Llama-family targets (SafeAILab/EAGLE's format, e.g.
yuhuili/EAGLE-LLaMA3-Instruct-8B): a folder with a Llama `config.json` and safetensors named
`fc.weight` [hidden, 2 * hidden] (`fc.bias` optional), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight` (layer 0 has no
input norm), and optionally `embed_tokens.weight` / `lm_head.weight` (shared with the target when
absent; a leading `model.` on the names is accepted).

At position p the head reads fc(concat(embed(t_{p+1}), h_p)), with h_p the target's final (normed)
hidden state at p, through its decoder layer(s); the output (no final norm) is the head's own h'_{p+1}:
the target's LM head on it predicts t_{p+2}, and it is the next drafting step's hidden input.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.linear import default_weight_loader
from kvllm.layers.ops.dispatch import use_fused_ops
from kvllm.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from kvllm.models.hf_config import head_size
from kvllm.models.llama import LlamaDecoderLayer, llama_mlp

logger = logging.getLogger(__name__)

# checkpoint fragment -> (fused parameter fragment, shard id), as kvllm's Llama fuses them
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> set[str]:
    """Load tensors already named as `module`'s parameters (q/k/v and gate/up fused on the way); every
    parameter must be filled, tensors that fill none are logged and skipped."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unused: list[str] = []
    for name, tensor in weights:
        for ckpt_part, param_part, shard in STACKED_PARAMS:
            if ckpt_part in name:
                param_name = name.replace(ckpt_part, param_part)
                if param_name in params:
                    param = params[param_name]
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    loaded.add(param_name)
                else:
                    unused.append(name)
                break
        else:
            if name in params:
                default_weight_loader(params[name], tensor)
                loaded.add(name)
            else:
                unused.append(name)
    if unused:  # as vLLM: published heads carry extras (e.g. a first-layer input norm nothing reads)
        logger.warning(
            "%s: %d checkpoint tensor(s) unused, e.g. %s", what, len(unused), ", ".join(unused[:3])
        )
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"{what}: missing weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    return loaded


class EagleLlamaForCausalLM(nn.Module):
    """An EAGLE-1/2 head (see the module docstring); `attach_target` fills what it omits."""

    def __init__(self, hf_config: Any, has_embed_tokens: bool, has_lm_head: bool, fc_bias: bool) -> None:
        super().__init__()
        c = self.config = hf_config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if has_embed_tokens else None
        self.rotary_emb = rotary = RotaryEmbedding(
            head_size(c), c.max_position_embeddings, rope_parameters_from_config(c)
        )
        qkv_bias = bool(getattr(c, "attention_bias", False))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(c, i, rotary, qkv_bias, False, llama_mlp(c, i))
            for i in range(c.num_hidden_layers)
        )
        # EAGLE's first layer takes fc's output without an input norm.
        self.layers[0].input_layernorm = nn.Identity()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=fc_bias)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if has_lm_head else None
        self._target: nn.Module | None = None  # not a submodule: its weights stay the target's

    def attach_target(self, target: nn.Module) -> None:
        """Use the target's token embedding and LM head where the checkpoint has none."""
        object.__setattr__(self, "_target", target)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        assert self._target is not None, "attach_target() first"
        return self._target.model.embed_tokens(input_ids)

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as this head reads them (EAGLE-1: the final hidden state)."""
        return target_hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden states the LM head reads, the hidden states the next drafting step reads)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden_states], dim=-1))
        rope = self.rotary_emb.prepare(positions, x.dtype, fused=use_fused_ops(x))
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        out = x + residual
        return out, out

    def draft_token_ids(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """int64 [N]: the greedy draft from each row (the target's vocabulary)."""
        if self.lm_head is not None:
            weight = self.lm_head.weight
        else:
            assert self._target is not None, "attach_target() first"
            weight = self._target.lm_head_weight
        return F.linear(hidden_states, weight).argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, ((_strip_model(n), t) for n, t in weights), "EAGLE head")


def _strip_model(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name
