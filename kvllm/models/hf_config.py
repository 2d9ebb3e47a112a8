"""Every rule kvllm takes from a model's HF config, in one place; no weights are read, no torch.

ModelConfig, the Llama-family layers, the attention selector and `kvllm backends` all ask here,
so the head size and sliding window the selector validates are the ones the layers run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.config.attention import AttentionConfig
from kvllm.config.choices import MODEL_DTYPES, canonical_dtype
from kvllm.platforms.interface import DeviceInfo

# HF model types whose attention uses ALiBi instead of rotary positions.
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "baichuan", "falcon_alibi"})
# HF model types that are encoder-only (bidirectional, no KV cache).
_ENCODER_ONLY_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert"})
# HF model types whose attention adds a learned per-head sink logit to the softmax denominator.
_SINK_MODEL_TYPES = frozenset({"gpt_oss"})
# Configs of these types carry `attn_logit_softcapping`, but HF's (and vLLM's) Gemma 3 attention never
# applies it; only Gemma 2 caps attention logits.
_SOFT_CAP_IGNORED_MODEL_TYPES = frozenset({"gemma3", "gemma3_text"})


def load_hf_config(model: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The model's transformers config (config.json, or a GGUF file's header); no weights are read."""
    from transformers import AutoConfig

    if os.path.isfile(model) and model.endswith(".gguf"):
        return AutoConfig.from_pretrained(os.path.dirname(model) or ".", gguf_file=os.path.basename(model))
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)


def text_config(hf_config: Any) -> Any:
    """The language-model part of a config (the config itself for text-only models)."""
    get_text = getattr(hf_config, "get_text_config", None)
    return get_text() if callable(get_text) else hf_config


def head_size(hf_config: Any) -> int:
    """Size of one attention head: `head_dim`, else hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def is_encoder_only(hf_config: Any) -> bool:
    """Whether the model attends bidirectionally over the whole prompt (BERT-style encoders)."""
    return (getattr(text_config(hf_config), "model_type", "") or "") in _ENCODER_ONLY_MODEL_TYPES


def layer_sliding_window(hf_config: Any, layer_index: int) -> int | None:
    """The attention window of one layer, or None for full attention."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_index] != "sliding_attention":
        return None
    return int(window)


def sliding_window(hf_config: Any) -> int | None:
    """The window of the layers that have one (the largest, if they differ); None if all attend fully."""
    windows = {layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {None}
    return max(windows) if windows else None


def layer_type(hf_config: Any, layer_index: int) -> str:
    """HF's `layer_types[i]` ("sliding_attention" / "full_attention"), derived where the config has none."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return str(layer_types[layer_index])
    return "sliding_attention" if layer_sliding_window(hf_config, layer_index) else "full_attention"


@dataclass(frozen=True)
class LayerAttentionSettings:
    """What one attention layer asks of the backend beyond head sizes (the AttentionImpl contract)."""

    sliding_window: int | None
    logits_soft_cap: float | None
    has_sinks: bool


def layer_attention_settings(hf_config: Any, layer_index: int) -> LayerAttentionSettings:
    """The window, soft-cap and sinks of layer `layer_index`: what the model builds its Attention with,
    and (over all layers) what `selector_config_from_hf_config` asks the backends for."""
    model_type = getattr(hf_config, "model_type", "") or ""
    soft_cap = getattr(hf_config, "attn_logit_softcapping", None)
    if model_type in _SOFT_CAP_IGNORED_MODEL_TYPES:
        soft_cap = None
    return LayerAttentionSettings(
        sliding_window=layer_sliding_window(hf_config, layer_index),
        logits_soft_cap=float(soft_cap) if soft_cap else None,
        has_sinks=model_type in _SINK_MODEL_TYPES,
    )


def unsupported_config_reason(hf_config: Any) -> str | None:
    """Why kvllm cannot run a config of an architecture it implements (None when it can): checkpoint
    formats and options the model code does not implement. ModelConfig and `kvllm backends` ask here."""
    text = text_config(hf_config)
    model_type = getattr(text, "model_type", "") or ""
    quant = getattr(hf_config, "quantization_config", None) or {}
    quant_method = (
        quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    )
    if quant_method == "mxfp4":
        return (
            "MXFP4-quantized experts (gpt-oss's released checkpoints) are not supported; "
            "use a BF16 checkpoint of the model (its experts dequantized)"
        )
    if model_type == "phi3":
        # The rope type as kvllm.layers.rotary.rope_parameters_from_config reads it (layers stand below models).
        rope: dict[str, Any] = {}
        for attr in ("rope_scaling", "rope_parameters"):
            value = getattr(text, attr, None)
            rope.update(value if isinstance(value, dict) else {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear"):
            return (
                f"Phi-3 with rope_type {rope_type!r} (LongRoPE, the 128k variants) is not supported: HF switches "
                "every position's frequencies once a sequence passes original_max_position_embeddings, which a "
                "batch of requests of different lengths cannot share; use a 4k-context Phi-3 checkpoint"
            )
    if getattr(text, "use_bidirectional_attention", False):
        return "bidirectional (encoder) variants of decoder models are not supported"
    return None


def config_dtype_name(hf_config: Any) -> str | None:
    """The checkpoint dtype named in the config (transformers 4 `torch_dtype` or 5 `dtype`)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return None
    name = canonical_dtype(str(value).removeprefix("torch."))
    return name if name in MODEL_DTYPES else None


def resolve_model_dtype(requested: str, hf_config: Any, device: DeviceInfo) -> str:
    """The dtype the model runs in; the one rule the engine and `kvllm backends` share.

    The user's choice wins. "auto" is float32 on the CPU (fast there, and exact against
    float32 references); on a GPU it is the checkpoint's float16/bfloat16, with float32 or
    unnamed checkpoints in bfloat16, and bfloat16 replaced by float16 on GPUs without
    native bfloat16 (CUDA compute capability below 8.0).
    """
    if requested != "auto":
        return canonical_dtype(requested)
    if device.platform == "cpu":
        return "float32"
    dtype = config_dtype_name(hf_config)
    if dtype not in ("float16", "bfloat16"):
        dtype = "bfloat16"
    has_bf16 = device.platform == "rocm" or device.capability is None or device.capability >= (8, 0)
    return dtype if dtype == "float16" or has_bf16 else "float16"


def selector_config_from_hf_config(
    hf_config: Any,
    device: DeviceInfo,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    attention_config: AttentionConfig | None = None,
) -> AttentionSelectorConfig:
    """The attention needs of a model: head size, dtype, sliding window, soft-cap, sinks, MLA..."""
    text = text_config(hf_config)
    model_type = getattr(text, "model_type", "") or ""
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    use_mla = kv_lora_rank is not None
    if use_mla:
        # MLA decode attends over the compressed latent plus the rotary part (576 for DeepSeek).
        size = int(kv_lora_rank) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    else:
        size = head_size(text)
    layers = [layer_attention_settings(text, i) for i in range(text.num_hidden_layers)]
    soft_caps = {layer.logits_soft_cap for layer in layers} - {None}
    attention_config = attention_config or AttentionConfig()
    encoder_only = model_type in _ENCODER_ONLY_MODEL_TYPES
    return AttentionSelectorConfig(
        head_size=int(size),
        dtype=resolve_model_dtype(dtype, text, device),
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        use_mla=use_mla,
        has_sink=any(layer.has_sinks for layer in layers),
        has_sliding_window=any(layer.sliding_window is not None for layer in layers),
        logits_soft_cap=max(soft_caps) if soft_caps else None,
        use_alibi=model_type in _ALIBI_MODEL_TYPES or bool(getattr(text, "alibi", False)),
        attn_type="encoder_only" if encoder_only else "decoder",
        use_non_causal=encoder_only,
        flash_attn_version=attention_config.flash_attn_version,
        use_trtllm_attention=attention_config.use_trtllm_attention,
    )
