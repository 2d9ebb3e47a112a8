"""BERT encoders (BertModel: all-MiniLM, bge, e5, ...): absolute positions, token types, post-LN, GELU.

Attention is bidirectional over each prompt (`attn_type="encoder_only"`): the attention backend must
declare encoder-only attention (CPU_ATTN, FLEX_ATTENTION), and the engine runs each prompt in one step
(no chunked prefill, no prefix cache), since every token attends to every other. `forward` returns the
last hidden states [T, hidden_size]; the pooler (kvllm/worker/pooler.py) makes the embedding. Every
token has token type 0 (a single sentence), as sentence-transformers encodes one text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.attention import Attention
from kvllm.layers.linear import QKVLinear, default_weight_loader

# HF activation names -> functions (BERT checkpoints use gelu, the exact erf form, almost always).
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Checkpoint tensors that are not part of the encoder: heads of BertForMaskedLM / BertForPreTraining
# ("cls."), the unused pooler, and buffers.
_SKIPPED_PREFIXES = ("cls.", "pooler.", "lm_head.")
_SKIPPED_SUFFIXES = ("position_ids", "token_type_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type={config.position_embedding_type!r} is not available in kvllm's "
                "BertModel; allowed: absolute"
            )
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        hidden = hidden + self.token_type_embeddings.weight[0]
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.num_heads
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_size, self.num_heads, self.num_heads, bias=True
        )
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_heads,
            attn_type="encoder_only",
            prefix=f"{prefix}.attn",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.qkv_proj.q_size] + [self.qkv_proj.kv_size] * 2, -1)
        return self.attn(q, k, v)


class BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not available in kvllm's BertModel; allowed: "
                f"{', '.join(_ACTIVATIONS)}"
            )
        self.act = _ACTIVATIONS[config.hidden_act]
        self.self_attn = BertSelfAttention(config, prefix)
        self.attn_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attn_norm(hidden_states + self.attn_output(self.self_attn(hidden_states)))
        ffn = self.output(self.act(self.intermediate(hidden_states)))
        return self.output_norm(hidden_states + ffn)


# HF BertModel names -> this module's (after "encoder.layer.N."); q/k/v are stacked into qkv_proj.
_LAYER_NAMES = {
    "attention.output.dense.": "attn_output.",
    "attention.output.LayerNorm.": "attn_norm.",
    "intermediate.dense.": "intermediate.",
    "output.dense.": "output.",
    "output.LayerNorm.": "output_norm.",
}
_QKV_NAMES = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}


class BertModel(nn.Module):
    """An encoder-only BERT returning the last hidden states (vLLM's BertEmbeddingModel, CLS pooling by
    default; sentence-transformers folders set their own pooling)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.embeddings = BertEmbeddings(hf_config)
        self.layers = nn.ModuleList(
            BertLayer(hf_config, f"layers.{i}") for i in range(hf_config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (within each prompt, from 0): [T] -> last hidden states [T, hidden_size]."""
        hidden_states = self.embeddings(input_ids, positions.long())
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF BertModel tensors (also `bert.`-prefixed ones, as BertForMaskedLM saves them; heads
        skipped); returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("model.")
            if name.startswith(_SKIPPED_PREFIXES) or name.endswith(_SKIPPED_SUFFIXES):
                continue
            param_name, shard = self._map_name(name)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            param = params[param_name]
            if shard is not None:
                param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            else:
                default_weight_loader(param, tensor)
            loaded.add(param_name)
        return loaded

    @staticmethod
    def _map_name(name: str) -> tuple[str, str | None]:
        if not name.startswith("encoder.layer."):
            return name, None
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        prefix = f"layers.{index}."
        for hf, shard in _QKV_NAMES.items():
            if rest.startswith(hf):
                return prefix + "self_attn.qkv_proj." + rest.removeprefix(hf), shard
        for hf, ours in _LAYER_NAMES.items():
            if rest.startswith(hf):
                return prefix + ours + rest.removeprefix(hf), None
        return prefix + rest, None
