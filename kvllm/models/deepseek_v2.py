"""DeepSeek-V2 and DeepSeek-V3: MLA attention (kvllm.layers.mla_attention), dense first layers, then
mixture-of-experts layers with shared experts (kvllm.models.deepseek_moe).

Attention: q from `q_proj`, or through the q LoRA (`q_a_proj` -> RMSNorm -> `q_b_proj`); the KV
latent from `kv_a_proj_with_mqa` (kv_lora_rank compressed entries, RMS-normed, plus one shared
rope key); RoPE (YaRN with mscale where configured) on the rope parts; the MLA layer attends and
`kv_b_proj` up-projects inside it. V3 differs in routing only (and its rope layout flag).

Tensor parallel: the attention heads split over the ranks (q_proj / q_b_proj and kv_b_proj column
parallel by head, o_proj row parallel); the latent projections (q_a_proj, kv_a_proj_with_mqa) and so
the latent KV cache are whole on every rank; the experts split as FusedMoE does, the shared experts
and dense MLPs as LlamaMLP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.deepseek_rotary import DeepseekRotaryEmbedding, yarn_softmax_scale
from kvllm.layers.linear import Linear, default_weight_loader
from kvllm.layers.mla_attention import MLAAttention
from kvllm.layers.moe import FusedMoE
from kvllm.layers.norm import RMSNorm
from kvllm.layers.rotary import rope_parameters_from_config
from kvllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kvllm.models.deepseek_moe import DeepseekMoE
from kvllm.models.llama import LlamaMLP

# checkpoint fragment -> (parameter fragment, shard) for the dense and shared-expert MLPs
_STACKED_PARAMS = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


def is_moe_layer(hf_config: Any, layer_index: int) -> bool:
    """MoE from layer `first_k_dense_replace` on (every `moe_layer_freq`-th), dense before."""
    if not getattr(hf_config, "n_routed_experts", None):
        return False
    first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    return layer_index >= first_dense and layer_index % (getattr(hf_config, "moe_layer_freq", 1) or 1) == 0


class DeepseekV2MLAAttention(nn.Module):
    """The projections around one MLA layer."""

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: DeepseekRotaryEmbedding) -> None:
        super().__init__()
        c = hf_config
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        bias = bool(getattr(c, "attention_bias", False))
        heads = c.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, heads * self.qk_head_dim, bias=False, parallel="column")
        else:
            self.q_a_proj = Linear(c.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False, parallel="column")
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(
            self.kv_lora_rank,
            heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
            parallel="column",
        )
        self.o_proj = Linear(heads * self.v_head_dim, c.hidden_size, bias=bias, parallel="row")
        self.num_heads = self.kv_b_proj.out_features // (
            self.qk_nope_head_dim + self.v_head_dim
        )  # this rank's
        self.rotary_emb = rotary_emb
        self.mla_attn = MLAAttention(
            num_heads=self.num_heads,
            scale=yarn_softmax_scale(rope_parameters_from_config(c), self.qk_head_dim),
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            prefix=f"model.layers.{layer_index}.self_attn.mla_attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], -1
        )
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q, k_pe = self.rotary_emb.rotate_query_and_key(positions, q, k_pe, self.qk_nope_head_dim)
        out = self.mla_attn(q, kv_c_normed, k_pe, self.kv_b_proj.weight)
        return self.o_proj(out)


def deepseek_rotary_embedding(hf_config: Any) -> DeepseekRotaryEmbedding:
    """The rope of the MLA layers (V3 checkpoints may ask for the non-interleaved layout)."""
    interleaved = getattr(hf_config, "model_type", "") != "deepseek_v3" or bool(
        getattr(hf_config, "rope_interleave", True)
    )
    return DeepseekRotaryEmbedding(
        hf_config.qk_rope_head_dim,
        hf_config.max_position_embeddings,
        rope_parameters_from_config(hf_config),
        interleaved=interleaved,
    )


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm layer: MLA, then a dense MLP (first layers) or the MoE."""

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: DeepseekRotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DeepseekV2MLAAttention(hf_config, layer_index, rotary_emb)
        if is_moe_layer(hf_config, layer_index):
            self.mlp: nn.Module = DeepseekMoE(hf_config, layer_index, LlamaMLP)
        else:
            self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.rotary_emb = rotary_emb = deepseek_rotary_embedding(hf_config)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(hf_config, i, rotary_emb) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 (and V2-Lite): softmax group-limited greedy routing."""

    supports_tensor_parallel = True

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.model = DeepseekV2Model(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        )
        self.vocab_size = hf_config.vocab_size
        self.gathers_logits = self.model.embed_tokens.tp_size > 1
        self.num_experts = getattr(hf_config, "n_routed_experts", None) or 0

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = F.linear(hidden_states, self.lm_head_weight)
        if self.gathers_logits:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (per-expert matrices stacked into FusedMoE); V3's multi-token-prediction
        layers (indices >= num_hidden_layers) are skipped. Returns the parameters filled."""
        params = dict(self.named_parameters())
        expert_mapping = FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.num_experts
        )
        num_layers = self.config.num_hidden_layers
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or _layer_index(name) >= num_layers:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            param_name = load_deepseek_tensor(params, expert_mapping, name, tensor)
            loaded.add(param_name)
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3/R1: sigmoid routing with e_score_correction_bias (selected by the config's model_type)."""


def load_deepseek_tensor(params: dict, expert_mapping: list, name: str, tensor: torch.Tensor) -> str:
    """Load one HF-named tensor into `params` (experts into the FusedMoE stacks, gate/up fused);
    returns the parameter's name."""
    if ".experts." in name and ".shared_experts." not in name:
        for param_prefix, fragment, expert_id, shard in expert_mapping:
            if fragment in name:
                param_name = name.replace(fragment, param_prefix)
                param = _param(params, param_name, name)
                param.weight_loader(param, tensor, shard, expert_id)  # type: ignore[attr-defined]
                return param_name
    for ckpt_part, param_part, shard in _STACKED_PARAMS:
        if ckpt_part in name:
            param_name = name.replace(ckpt_part, param_part)
            param = _param(params, param_name, name)
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            return param_name
    param = _param(params, name, name)
    getattr(param, "weight_loader", default_weight_loader)(param, tensor)  # TP-sharding loaders
    return name


def _layer_index(name: str) -> int:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return -1


def _param(params: dict[str, nn.Parameter], param_name: str, checkpoint_name: str) -> nn.Parameter:
    if param_name not in params:
        raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no matching model parameter")
    return params[param_name]
