"""Quantized checkpoints (AWQ, GPTQ, fp8, compressed-tensors) against HF transformers on the CPU.

Each checkpoint is a tiny random model quantized by tests/quant_checkpoints.py. The reference is HF
transformers on the same checkpoint where its integration runs here (compressed-tensors W4A16 and fp8,
fine-grained fp8 block), else HF on the same model with the exact dequantized weights in float32
(AWQ and GPTQ need gptqmodel; transformers ignores per-tensor `weight_scale` of quant_method fp8).
kvllm's CPU path dequantizes the weights in float32 too, so logits agree to float32 summation
order: 1e-4 absolute on logits of magnitude ~10.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from kvllm.config.engine import EngineArgs
from kvllm.forward_context import set_forward_context
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from tests.model_factory import make_tiny_llama, make_tiny_qwen3
from tests.quant_checkpoints import (
    PROJECTIONS,
    STATIC_INPUT_SCALE,
    dequantized_copy,
    fp8_checkpoint,
    fp8_dequantized,
    int4_checkpoint,
)

CPU = torch.device("cpu")
PROMPT = [5, 17, 33, 2, 9, 100, 7, 250, 3]
ATOL = 1e-4


@cache
def _hf_logits(path: str, activations: str | None = None) -> torch.Tensor:
    """HF's logits; `activations` "token", "block" or "static" quantizes and dequantizes every
    decoder linear's input to fp8 as W8A8 does (HF's CPU fp8 paths are weight-only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if activations is not None:
        for name, module in model.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                module.register_forward_pre_hook(lambda _, args: (_fake_fp8(args[0], activations),))
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def _fake_fp8(x: torch.Tensor, activations: str) -> torch.Tensor:
    fp8 = torch.float8_e4m3fn
    if activations == "static":
        return (x / STATIC_INPUT_SCALE).clamp(-448, 448).to(fp8).float() * STATIC_INPUT_SCALE
    group = 128 if activations == "block" else x.shape[-1]
    xg = x.reshape(*x.shape[:-1], -1, group)
    scale = (xg.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return ((xg / scale).clamp(-448, 448).to(fp8).float() * scale).reshape(x.shape)


def kvllm_logits(path: Path, **engine_args: object) -> torch.Tensor:
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path), **engine_args), CPU)
    model = load_model(config, "auto", CPU)
    with torch.no_grad(), set_forward_context(None):
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)))
        return model.compute_logits(hidden)[:, : config.vocab_size]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("quant") / "llama")


@pytest.fixture(scope="module")
def base_128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 whose shards start at multiples of 128 rows (block fp8 needs whole blocks per shard)."""
    return make_tiny_qwen3(
        tmp_path_factory.mktemp("quant") / "qwen3",
        hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=256,
    )  # fmt: skip


INT4_CASES = [
    # (format, group size, symmetric, act order, HF runs the checkpoint itself)
    ("awq", 32, False, False, False),
    ("awq", -1, False, False, False),
    ("gptq", 32, True, False, False),
    ("gptq", 32, False, True, False),
    ("compressed-tensors", 32, True, False, True),
    ("compressed-tensors", 32, False, False, False),
    ("compressed-tensors", 32, True, True, False),
]


@pytest.mark.parametrize("fmt,group,sym,act_order,hf_direct", INT4_CASES)
def test_int4_logits_match_hf(base: Path, tmp_path: Path, fmt, group, sym, act_order, hf_direct) -> None:
    folder, dense = int4_checkpoint(base, tmp_path / fmt, fmt, group, sym=sym, act_order=act_order)
    reference_folder = folder if hf_direct else dequantized_copy(base, tmp_path / "dense", dense)
    expected = _hf_logits(str(reference_folder))
    got = kvllm_logits(folder)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    # The quantization moved the logits (the comparison is not of the unquantized model).
    assert (_hf_logits(str(base)) - expected).abs().max() > 100 * ATOL


FP8_CASES = [
    # (scheme, static activation scales, HF runs the checkpoint itself)
    ("block", False, True),
    ("tensor", False, False),
    ("tensor", True, False),
    ("ct-channel", False, True),
    ("ct-tensor", True, True),
]


@pytest.mark.parametrize("scheme,static,hf_direct", FP8_CASES)
def test_fp8_logits_match_hf(base_128: Path, tmp_path: Path, scheme, static, hf_direct) -> None:
    """W8A8 on the CPU: kvllm quantizes the activations as its GPU kernels do; transformers'
    compressed-tensors integration does too, its other CPU fp8 paths get the same rounding by a hook."""
    folder = fp8_checkpoint(base_128, tmp_path / scheme, scheme, static=static)
    activations = "static" if static else "block" if scheme == "block" else "token"
    if scheme.startswith("ct"):
        expected = _hf_logits(str(folder))
    elif hf_direct:
        expected = _hf_logits(str(folder), activations)
    else:
        expected = _hf_logits(str(fp8_dequantized(base_128, folder, tmp_path / "dense")), activations)
    torch.testing.assert_close(kvllm_logits(folder), expected, rtol=0, atol=ATOL)
    assert (_hf_logits(str(base_128)) - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", True)])
def test_engine_greedy_ids_equal_hf(base: Path, tmp_path: Path, fmt, act_order) -> None:
    from kvllm import LLM, SamplingParams
    from tests.hf_reference import hf_greedy

    folder, dense = int4_checkpoint(base, tmp_path / fmt, fmt, 32, act_order=act_order)
    expected, _, _ = hf_greedy(str(dequantized_copy(base, tmp_path / "dense", dense)), PROMPT, 8)
    llm = LLM(model=str(folder), quantization=fmt, max_model_len=64, kv_cache_memory_bytes=2**22)
    out = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert list(out[0].outputs[0].token_ids) == expected


def test_quantization_mismatch_and_unquantized_checkpoint_errors(base: Path, tmp_path: Path) -> None:
    folder, _ = int4_checkpoint(base, tmp_path / "awq", "awq", 32)
    with pytest.raises(ValueError, match="does not match the checkpoint, which is quantized with 'awq'"):
        kvllm_logits(folder, quantization="gptq")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with awq"):
        kvllm_logits(base, quantization="awq")
    # vLLM's Marlin names are run by kvllm's kernels.
    torch.testing.assert_close(
        kvllm_logits(folder, quantization="awq_marlin"), kvllm_logits(folder), rtol=0, atol=0
    )


def test_online_fp8_quantizes_a_16_bit_checkpoint(base_128: Path) -> None:
    """--quantization fp8 on an unquantized checkpoint: per-channel weights, per-token activations."""
    from safetensors.torch import load_file

    from kvllm.layers.quantization.fp8 import quantize_per_channel

    state = load_file(str(base_128 / "model.safetensors"))
    dense = {}
    for name in state:
        if name.split(".")[-2] in PROJECTIONS:
            weight, scale = quantize_per_channel(state[name])
            dense[name] = weight.float() * scale[:, None]
    folder = dequantized_copy(base_128, base_128.parent / "online_reference", dense)
    torch.testing.assert_close(
        kvllm_logits(base_128, quantization="fp8"), _hf_logits(str(folder), "token"), rtol=0, atol=ATOL
    )


def test_dummy_weights_for_every_method(base: Path, base_128: Path, tmp_path: Path) -> None:
    """load_format=dummy fills packed integers, fp8 values and scales with values the layers run on."""
    folders = [int4_checkpoint(base, tmp_path / f, f, 32, act_order=f == "gptq")[0] for f in ("awq", "gptq")]
    folders.append(fp8_checkpoint(base_128, tmp_path / "block", "block"))
    for folder in folders:
        config = ModelConfig.from_engine_args(EngineArgs(model=str(folder)), CPU)
        model = load_model(config, "dummy", CPU)
        with torch.no_grad(), set_forward_context(None):
            logits = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))
        assert torch.isfinite(logits).all() and logits.std() > 0
