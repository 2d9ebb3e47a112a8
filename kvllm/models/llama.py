"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (+ qkv bias), Qwen3 (+ QK-norm) and Phi-3 (qkv and
gate_up fused in the checkpoint) in one file. Other families build on its attention and decoder layer: the
MoE models replace the MLP (`LlamaForCausalLM.make_mlp`), gpt-oss adds sinks, Gemma its norms and scales.

The model runs on a flat batch of tokens from many requests: `forward(input_ids [T], positions [T])`
returns hidden states [T, hidden_size]; which token belongs to which request is known only to the
attention backend, through the forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvllm.layers.activation import SiluAndMul
from kvllm.layers.attention import Attention
from kvllm.layers.linear import Linear, MergedLinear, QKVLinear, default_weight_loader
from kvllm.layers.norm import RMSNorm
from kvllm.layers.ops.dispatch import use_fused_ops
from kvllm.layers.rotary import RopeInputs, RotaryEmbedding, rope_parameters_from_config
from kvllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kvllm.models.hf_config import head_size, layer_attention_settings, num_kv_heads

if TYPE_CHECKING:
    from kvllm.layers.quantization.base import QuantizationConfig

# checkpoint name fragment -> (fused parameter fragment, shard id)
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, optional QK-norm, RoPE, paged attention, output projection.

    The layer's window, logit soft-cap and sinks come from `layer_attention_settings`, the rule the
    attention selector validates backends against. `scale` defaults to head_size ** -0.5; `norm_cls`
    is the QK-norm (Gemma 3 passes its own).
    """

    def __init__(
        self,
        hf_config: Any,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        scale: float | None = None,
        norm_cls: type[nn.Module] = RMSNorm,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size(hf_config)
        prefix = f"model.layers.{layer_index}.self_attn"
        self.qkv_proj = QKVLinear(
            hf_config.hidden_size,
            self.head_size,
            hf_config.num_attention_heads,
            num_kv_heads(hf_config),
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
            shard_prefixes=[f"{prefix}.{name}_proj" for name in "qkv"],
        )
        # This rank's heads (tensor parallel: its share of the query heads, and of the KV heads or one
        # replicated KV head); all of them at TP=1.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = Linear(
            hf_config.num_attention_heads * self.head_size,
            hf_config.hidden_size,
            bias=getattr(hf_config, "attention_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
            parallel="row",
        )
        self.q_norm = norm_cls(self.head_size, hf_config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(self.head_size, hf_config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        settings = layer_attention_settings(hf_config, layer_index)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=self.head_size,
            scale=self.head_size**-0.5 if scale is None else scale,
            num_kv_heads=self.num_kv_heads,
            sliding_window=settings.sliding_window,
            logits_soft_cap=settings.logits_soft_cap,
            has_sinks=settings.has_sinks,
            prefix=f"model.layers.{layer_index}.self_attn.attn",
        )

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.view(x.shape[0], -1, self.head_size)).view(x.shape)

    def _fused_qk_norm_rope(self, rope: RopeInputs, qkv: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """q and k normed and rotated in place in qkv; K/V stored in the cache too where the backend
        allows it. Returns whether they were, and the buffer q went to instead of qkv (the attention
        layer's `query_target`, inside piecewise graphs) or None."""
        from kvllm.layers.ops.rotary import qk_norm_rope, qk_norm_rope_kv_write

        q_norm, k_norm = self.q_norm, self.k_norm
        norm_args = dict(
            q_weight=q_norm.weight if q_norm is not None else None,
            k_weight=k_norm.weight if k_norm is not None else None,
            eps=q_norm.eps if q_norm is not None else 0.0,
        )
        shape = (
            qkv,
            rope.positions,
            self.rotary_emb.cos_sin_cache,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
        )
        target = self.attn.kv_write_target()
        if target is None:
            qk_norm_rope(*shape, **norm_args)
            return False, None
        key_cache, value_cache, slot_mapping = target
        q_out = self.attn.query_target(qkv.shape[0], qkv.dtype)
        qk_norm_rope_kv_write(
            *shape, key_cache, value_cache, slot_mapping, self.attn.k_scale, self.attn.v_scale, **norm_args,
            q_out=q_out,
        )  # fmt: skip
        return True, q_out

    def forward(self, rope: RopeInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        kv_written = False
        if rope.cos_sin is None:  # the fused path
            kv_written, q_out = self._fused_qk_norm_rope(rope, qkv)
            q, k, v = self.qkv_proj.split(qkv)
            q = q if q_out is None else q_out
        else:
            q, k, v = self.qkv_proj.split(qkv)
            if self.q_norm is not None and self.k_norm is not None:
                q = self._head_norm(self.q_norm, q)
                k = self._head_norm(self.k_norm, k)
            q, k = self.rotary_emb.apply(rope.cos_sin, q, k)
        # Strided views of qkv are fine: every backend's KV write and kernel take row strides.
        return self.o_proj(self.attn(q, k, v, kv_written=kv_written))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "mlp",
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
            shard_prefixes=[f"{prefix}.gate_proj", f"{prefix}.up_proj"],
        )
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
            parallel="row",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.act_fn))


def llama_mlp(hf_config: Any, layer_index: int, quant_config: QuantizationConfig | None = None) -> nn.Module:
    """The dense MLP of a decoder layer (the default `LlamaForCausalLM.make_mlp`)."""
    return LlamaMLP(
        hf_config.hidden_size,
        hf_config.intermediate_size,
        bias=getattr(hf_config, "mlp_bias", False),
        quant_config=quant_config,
        prefix=f"model.layers.{layer_index}.mlp",
    )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is threaded through the norms (add fused in).

    `mlp` is any module mapping [T, hidden] -> [T, hidden] (dense SwiGLU, or a mixture of experts).
    """

    def __init__(
        self,
        hf_config: Any,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            hf_config, layer_index, rotary_emb, qkv_bias, qk_norm, quant_config=quant_config
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        rope: RopeInputs,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(
        self,
        hf_config: Any,
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: Callable[[Any, int], nn.Module],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # One cos/sin cache shared by all layers (it can be tens of MB for long contexts).
        self.rotary_emb = rotary_emb = RotaryEmbedding(
            head_size(hf_config), hf_config.max_position_embeddings, rope_parameters_from_config(hf_config)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config, i, rotary_emb, qkv_bias, qk_norm, make_mlp(hf_config, i), quant_config
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        # EAGLE-3: the residual stream entering these layers is kept after each forward pass, in
        # `aux_hidden_states` (a side output: every other caller takes the one hidden-state tensor).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions, hidden_states.dtype, fused=use_fused_ops(hidden_states))
        residual = None
        aux_layers, aux = self.aux_hidden_state_layers, []
        for i, layer in enumerate(self.layers):
            if aux_layers and i in aux_layers:
                aux.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(rope, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_layers:
            self.aux_hidden_states = [aux[sorted(set(aux_layers)).index(i)] for i in aux_layers]
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM. Subclasses switch on qkv bias (Qwen2) and QK-norm (Qwen3), and replace
    the MLP (`make_mlp`) and the checkpoint-name rules (`checkpoint_name`, `expert_params_mapping`)."""

    qkv_bias: bool | None = None  # None: the config's `attention_bias`
    qk_norm: bool = False
    supports_quantization = True  # takes quant_config (kvllm/layers/quantization)
    # Splits over tensor-parallel ranks (kvllm/distributed); subclasses that change a layer set it
    # again once their own layers are split.
    supports_tensor_parallel = True

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.quant_config = quant_config
        self.model = self.build_model(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.vocab_size = hf_config.vocab_size
        self.gathers_logits = getattr(self.model.embed_tokens, "tp_size", 1) > 1
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            # compute_logits calls F.linear on its weight (not the small-M kernel).
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)

    def build_model(self, hf_config: Any) -> nn.Module:
        """The decoder stack (embedding, layers, final norm): `forward(input_ids, positions)` -> hidden states,
        with the token embedding as `embed_tokens`."""
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else getattr(hf_config, "attention_bias", False)
        return LlamaModel(hf_config, bool(qkv_bias), self.qk_norm, self.make_mlp, self.quant_config)

    def make_mlp(self, hf_config: Any, layer_index: int) -> nn.Module:
        """The feed-forward block of layer `layer_index` (quantized as the checkpoint says)."""
        return llama_mlp(hf_config, layer_index, self.quant_config)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's parameter naming spells it; None to skip the tensor."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return name

    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        """(parameter fragment, checkpoint fragment, expert id, shard id) of MoE experts; none for dense models."""
        return []

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Keep the hidden states entering these layers on every forward pass (EAGLE-3's inputs)."""
        self.model.aux_hidden_state_layers = tuple(layers)

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """vLLM's default auxiliary layers: early, middle and late."""
        num_layers = len(self.model.layers)
        return (2, num_layers // 2, num_layers - 3)

    def aux_hidden_states(self) -> torch.Tensor:
        """[T, len(layers) * hidden]: the last forward pass's auxiliary hidden states, concatenated."""
        return torch.cat(self.model.aux_hidden_states, dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden states [N, hidden_size] -> logits [N, vocab_size] over the full (padded) vocab, in
        float32 (or, with upcast=False, in the model's dtype: the sampler reads those directly)."""
        logits = F.linear(hidden_states, self.lm_head_weight)
        if self.gathers_logits:
            logits = gather_logits(logits, self.vocab_size)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        expert_mapping = self.expert_params_mapping()
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            name = self.checkpoint_name(checkpoint_name)
            if name is None:
                continue
            expert = next((m for m in expert_mapping if m[1] in name), None) if ".experts." in name else None
            if expert is not None:
                param_part, checkpoint_part, expert_id, expert_shard = expert
                param_name = name.replace(checkpoint_part, param_part)
                param = self._param(params, param_name, checkpoint_name)
                param.weight_loader(param, tensor, expert_shard, expert_id)  # type: ignore[attr-defined]
                loaded.add(param_name)
                continue
            for checkpoint_part, param_part, shard_id in _STACKED_PARAMS:
                if checkpoint_part in name:
                    param_name = name.replace(checkpoint_part, param_part)
                    param = self._param(params, param_name, checkpoint_name)
                    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                    break
            else:
                param_name = name
                param = self._param(params, param_name, checkpoint_name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(param_name)
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], param_name: str, checkpoint_name: str) -> nn.Parameter:
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no matching model parameter")
        return params[param_name]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer (when the config sets one)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on the q, k and v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE (and qkv bias as the config says)."""

    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama whose checkpoint already fuses q/k/v (`qkv_proj`, rows q then k then v) and gate/up
    (`gate_up_proj`, rows gate then up). They load as the separate tensors they fuse, so each goes
    through its shard's weight loader (and, under tensor parallel, is cut to the rank's part).
    LongRoPE (the 128k variants) is rejected by `unsupported_config_reason`."""

    supports_quantization = False  # its fused checkpoint names have no quantized-shard mapping yet

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused tensors as the q/k/v and gate/up tensors of a Llama checkpoint (split by rows)."""
        config = self.config
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_rows = config.num_attention_heads * head_size
        kv_rows = config.num_key_value_heads * head_size
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_rows + 2 * kv_rows:
                    raise ValueError(
                        f"{name}: {tensor.shape[0]} rows, expected q + k + v = {q_rows + 2 * kv_rows}"
                    )
                q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
                yield name.replace(".qkv_proj.", ".q_proj."), q
                yield name.replace(".qkv_proj.", ".k_proj."), k
                yield name.replace(".qkv_proj.", ".v_proj."), v
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
