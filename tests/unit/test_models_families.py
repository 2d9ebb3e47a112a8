"""The model families beyond Llama, below the engine: per-layer attention settings from the one HF-config
rule reach both the selector and the layers, configs kvllm cannot run are refused with a reason, the
checkpoint layouts load, and YaRN RoPE matches transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.layers.attention import Attention
from kvllm.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from kvllm.models.hf_config import layer_attention_settings, selector_config_from_hf_config
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.models.registry import unsupported_model_reason
from kvllm.platforms import make_device_info
from tests import model_factory

CPU = make_device_info("cpu", None)
SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def gemma2_config(**overrides):
    from transformers import Gemma2Config

    return Gemma2Config(num_hidden_layers=4, sliding_window=16, **SMALL, **overrides)


def test_gemma2_alternates_window_and_caps_every_layer() -> None:
    config = gemma2_config()
    settings = [layer_attention_settings(config, i) for i in range(4)]
    assert [s.sliding_window for s in settings] == [16, None, 16, None]
    assert {s.logits_soft_cap for s in settings} == {50.0}
    assert not any(s.has_sinks for s in settings)
    selector = selector_config_from_hf_config(config, CPU)
    assert selector.has_sliding_window and selector.logits_soft_cap == 50.0 and not selector.has_sink


def test_gemma3_never_caps_attention_even_when_the_config_names_a_cap() -> None:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(num_hidden_layers=6, sliding_window=8, attn_logit_softcapping=50.0, **SMALL)
    assert [layer_attention_settings(config, i).sliding_window for i in range(6)] == [8] * 5 + [None]
    assert all(layer_attention_settings(config, i).logits_soft_cap is None for i in range(6))
    assert selector_config_from_hf_config(config, CPU).logits_soft_cap is None
    local, full = (
        rope_parameters_from_config(config, kind) for kind in ("sliding_attention", "full_attention")
    )
    assert (local["rope_theta"], full["rope_theta"]) == (10000.0, 1000000.0)


def test_gpt_oss_has_sinks_on_every_layer() -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(num_hidden_layers=2, num_local_experts=4, sliding_window=8, **SMALL)
    assert all(layer_attention_settings(config, i).has_sinks for i in range(2))
    assert selector_config_from_hf_config(config, CPU).has_sink


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "mixtral"])
def test_layers_run_what_the_selector_validates(name: str, tmp_path: Path) -> None:
    """Each Attention layer of the built model carries exactly its layer's settings from the rule, and the
    selector config asks for the union of them."""
    path = getattr(model_factory, f"make_tiny_{name}")(tmp_path)
    model_config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))
    model = load_model(model_config, "auto", torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    hf = model_config.hf_config
    assert len(layers) == hf.num_hidden_layers
    for i, layer in enumerate(layers):
        settings = layer_attention_settings(hf, i)
        assert layer.sliding_window == settings.sliding_window
        assert layer.logits_soft_cap == settings.logits_soft_cap
        assert (layer.sinks is not None) == settings.has_sinks
    selector = selector_config_from_hf_config(hf, CPU)
    assert selector.has_sliding_window == any(layer.sliding_window for layer in layers)
    assert selector.has_sink == any(layer.sinks is not None for layer in layers)
    caps = {layer.logits_soft_cap for layer in layers} - {None}
    assert selector.logits_soft_cap == (max(caps) if caps else None)
    if name == "gpt_oss":  # the checkpoint's sinks were loaded, not left at their zero init
        assert all(layer.sinks.abs().sum() > 0 for layer in layers)


def test_gpt_oss_experts_load_deinterleaved(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = model_factory.make_tiny_gpt_oss(tmp_path)
    model_config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))
    model = load_model(model_config, "auto", torch.device("cpu"))
    checkpoint = load_file(str(path / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    gate_up = checkpoint["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate/up interleaved
    inter = experts.intermediate_size
    assert torch.equal(experts.w13_weight[2, :inter], gate_up[2, :, 0::2].T)
    assert torch.equal(experts.w13_weight[2, inter:], gate_up[2, :, 1::2].T)
    assert torch.equal(experts.w2_weight[3], checkpoint["model.layers.1.mlp.experts.down_proj"][3].T)
    bias = checkpoint["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert torch.equal(experts.w13_bias[1], torch.cat([bias[1, 0::2], bias[1, 1::2]]))


def _write_config(folder: Path, config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def test_mxfp4_gpt_oss_and_longrope_phi3_are_refused(tmp_path: Path) -> None:
    from transformers import GptOssConfig, Phi3Config

    gpt_oss = GptOssConfig(num_hidden_layers=2, num_local_experts=4, **SMALL)
    gpt_oss.architectures = ["GptOssForCausalLM"]
    gpt_oss.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    reason = unsupported_model_reason(gpt_oss)
    assert reason.startswith("GptOssForCausalLM: MXFP4") and "BF16" in reason
    long_factors = [1.0] * 4  # head_dim 8 -> 4 rotary frequencies
    phi3 = Phi3Config(
        num_hidden_layers=2,
        original_max_position_embeddings=64,
        max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": long_factors, "long_factor": long_factors},
        pad_token_id=0,
        **SMALL,
    )
    phi3.architectures = ["Phi3ForCausalLM"]
    assert "LongRoPE" in unsupported_model_reason(phi3)
    folder = _write_config(tmp_path / "phi3", phi3)
    with pytest.raises(ValueError, match="cannot be loaded: .*LongRoPE"):
        ModelConfig.from_engine_args(EngineArgs(model=str(folder)), torch.device("cpu"))
    assert unsupported_model_reason(gemma2_config(architectures=["Gemma2ForCausalLM"])) is None
    assert "not supported" in unsupported_model_reason(gemma2_config(architectures=["Gemma2Model"]))


def test_yarn_matches_transformers() -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        config = GptOssConfig(num_hidden_layers=2, num_local_experts=4, max_position_embeddings=512, **SMALL)
        config.rope_parameters["truncate"] = truncate
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        rope = RotaryEmbedding(8, 512, rope_parameters_from_config(config))
        positions = torch.arange(512, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=1e-6, atol=1e-6)
        assert attention_factor > 1.0  # the factor is really applied


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        RotaryEmbedding(8, 16, {"rope_type": "longrope", "rope_theta": 10000.0})


def test_config_json_round_trip_keeps_gemma3_layer_rules(tmp_path: Path) -> None:
    """A saved Gemma 3 folder read back (as the engine reads it) gives the same per-layer settings."""
    from transformers import AutoConfig

    path = model_factory.make_tiny_gemma3(tmp_path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    config = AutoConfig.from_pretrained(path)
    assert [layer_attention_settings(config, i).sliding_window for i in range(3)] == [24, 24, None]
