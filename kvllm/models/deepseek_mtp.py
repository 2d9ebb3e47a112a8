"""DeepSeek-V3's multi-token-prediction (MTP) layers as a draft head (vLLM's `mtp` method).

A V3 checkpoint with `num_nextn_predict_layers` = n carries n extra layers after the
`num_hidden_layers` = L main ones, at indices L .. L + n - 1: `model.layers.{i}.enorm`, `.hnorm`,
`.eh_proj` [hidden, 2 * hidden], `.shared_head.norm`, `.shared_head.head` (the LM head),
`.embed_tokens` (the target's embedding again; the target's is used when absent) and one decoder
layer's tensors (`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`).

At position p the layer reads eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p))) through its decoder
layer, h_p the target's final (normed) hidden state at p; the output plus its residual is the layer's
own h'_{p+1}: shared_head (norm, then head) on it predicts t_{p+2}, and it is the next drafting step's
hidden input. Drafting step j uses MTP layer j mod n (vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.moe import FusedMoE
from kvllm.layers.norm import RMSNorm
from kvllm.models.deepseek_v2 import DeepseekV2DecoderLayer, deepseek_rotary_embedding, load_deepseek_tensor

_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    """One MTP layer: the two norms, the projection, a decoder layer and the shared head's norm and head."""

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: nn.Module) -> None:
        super().__init__()
        c = hf_config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.shared_head.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.mtp_block = DeepseekV2DecoderLayer(c, layer_index, rotary_emb)


class DeepSeekMTP(nn.Module):
    """The checkpoint's MTP layers as one draft head (the interface of the EAGLE heads)."""

    def __init__(self, hf_config: Any, has_embed_tokens: bool) -> None:
        super().__init__()
        c = self.config = hf_config
        self.first_layer = c.num_hidden_layers
        self.num_mtp_layers = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
        if self.num_mtp_layers < 1:
            raise ValueError(
                "speculative_config.method='mtp' needs a checkpoint with multi-token-prediction layers; "
                "this model's config has num_nextn_predict_layers=0"
            )
        self.rotary_emb = rotary = deepseek_rotary_embedding(c)
        self.layers = nn.ModuleDict(
            {
                str(i): DeepSeekMultiTokenPredictorLayer(c, i, rotary)
                for i in range(self.first_layer, self.first_layer + self.num_mtp_layers)
            }
        )
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if has_embed_tokens else None
        self.num_experts = getattr(c, "n_routed_experts", None) or 0
        self._target: nn.Module | None = None  # not a submodule: its weights stay the target's

    def _layer(self, step: int) -> DeepSeekMultiTokenPredictorLayer:
        return self.layers[str(self.first_layer + step % self.num_mtp_layers)]

    def attach_target(self, target: nn.Module) -> None:
        object.__setattr__(self, "_target", target)

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden states the shared head reads, the same for the next drafting step)."""
        layer = self._layer(step)
        if self.embed_tokens is not None:
            embeds = self.embed_tokens(input_ids)
        else:
            assert self._target is not None, "attach_target() first"
            embeds = self._target.model.embed_tokens(input_ids)
        # Position 0 has no previous token whose hidden state the layer refines (vLLM masks it too).
        embeds = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden_states)], dim=-1))
        x, residual = layer.mtp_block(positions, x, None)
        out = x + residual
        return out, out

    def draft_token_ids(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        head = self._layer(step).shared_head
        return F.linear(head.norm(hidden_states), head.head.weight).argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the MTP layers' tensors from the whole checkpoint (the main layers are skipped)."""
        expert_mapping = FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.num_experts
        )
        last = self.first_layer + self.num_mtp_layers
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            parts = name.split(".")
            if (
                len(parts) < 4
                or parts[:2] != ["model", "layers"]
                or not self.first_layer <= int(parts[2]) < last
            ):
                continue
            index, rest = parts[2], ".".join(parts[3:])
            if rest == "embed_tokens.weight":
                if int(index) == self.first_layer and self.embed_tokens is not None:
                    # The MTP layers share one embedding (V3's report): the first layer's.
                    loaded.add(load_deepseek_tensor(params, expert_mapping, "embed_tokens.weight", tensor))
                continue
            if "rotary_emb.inv_freq" in rest:
                continue
            own = rest.startswith(_OWN_PARTS)
            param_name = f"layers.{index}.{rest}" if own else f"layers.{index}.mtp_block.{rest}"
            loaded.add(load_deepseek_tensor(params, expert_mapping, param_name, tensor))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint lacks weights of its {self.num_mtp_layers} MTP layer(s), e.g. "
                f"{', '.join(missing[:4])} (model.layers.{self.first_layer}.*)"
            )
        return loaded
