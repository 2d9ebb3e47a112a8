"""MLA backend and MLA prefill backend selection: the seed's priority per compute capability, manual
choices that fail loudly with reasons (the seed's FLASHMLA example among them), -ac.mla_prefill_backend
validation, and `kvllm backends` on a DeepSeek folder."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from kvllm import LLM
from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.backends.mla.prefill import choose_prefill_backend
from kvllm.attention.selector import choose_attention_backend, clear_selection_cache
from kvllm.config.attention import AttentionConfig
from kvllm.entrypoints.cli.main import main
from kvllm.models.hf_config import selector_config_from_hf_config
from kvllm.platforms import backend_priority
from kvllm.platforms.interface import DeviceInfo
from tests.unit.test_cli_args import parse

SM80, SM90, SM100 = DeviceInfo("cuda", (8, 0)), DeviceInfo("cuda", (9, 0)), DeviceInfo("cuda", (10, 0))
CPU = DeviceInfo("cpu")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def v2_lite_config(device: DeviceInfo) -> AttentionSelectorConfig:
    """DeepSeek-V2-Lite's attention needs, read from its HF config as the engine reads them."""
    from transformers import DeepseekV2Config

    hf = DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=27, vocab_size=102400,
    )  # fmt: skip
    return selector_config_from_hf_config(hf, device)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_selection_cache()
    yield
    clear_selection_cache()


def test_deepseek_config_is_mla_with_the_latent_width():
    config = v2_lite_config(SM90)
    assert config.use_mla and config.head_size == 576 and config.dtype == "bfloat16"


def test_seed_priority_lists_per_capability():
    names = lambda device: [n.name for n in backend_priority(device, use_mla=True)]  # noqa: E731
    assert names(SM100) == ["FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA"]
    assert names(SM90) == ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA"]
    assert names(CPU) == ["CPU_MLA"]


def test_the_seeds_flashmla_error_is_produced():
    with pytest.raises(ValueError) as info:
        choose_attention_backend(v2_lite_config(SM80), SM80, "FLASHMLA")
    assert str(info.value).startswith(
        "Selected backend FLASHMLA is not valid for this configuration. "
        "Reason: ['compute capability 8.0 not supported (needs 9.0-10.9)'"
    )


def test_automatic_choice_on_hopper_logs_every_rejected_faster_backend(caplog):
    config = v2_lite_config(SM90)
    with caplog.at_level(logging.INFO, logger="kvllm"):
        choice = choose_attention_backend(config, SM90)
    expected = "FLASHINFER_MLA" if HAS_FLASHINFER else "TRITON_MLA"
    assert choice.backend.name == expected
    text = caplog.text
    assert (
        "FLASH_ATTN_MLA (higher priority) rejected" in text and "flash_attn_interface not installed" in text
    )
    assert "FLASHMLA (higher priority) rejected" in text and "package flash_mla not installed" in text


def test_blackwell_explains_cutlass_mla_and_never_fakes_it():
    reasons = choose_backend_reasons("CUTLASS_MLA", v2_lite_config(SM100), SM100)
    assert any("could not be verified here" in r for r in reasons)
    with pytest.raises(
        ValueError, match=r"Selected backend CUTLASS_MLA is not valid .*could not be verified"
    ):
        choose_attention_backend(v2_lite_config(SM100), SM100, "CUTLASS_MLA")


def choose_backend_reasons(name, config, device):
    from kvllm.attention.selector import backend_reasons

    return backend_reasons(name, config, device)


def test_manual_mla_choice_for_a_standard_model_and_back_fails_with_reasons():
    standard = AttentionSelectorConfig(head_size=128, dtype="bfloat16")
    with pytest.raises(ValueError, match="MLA backend cannot serve standard"):
        choose_attention_backend(standard, SM90, "TRITON_MLA")
    with pytest.raises(ValueError, match="MLA attention needs an MLA backend"):
        choose_attention_backend(v2_lite_config(SM90), SM90, "TRITON_ATTN")


def test_fp8_latent_declarations():
    fp8 = AttentionSelectorConfig(head_size=576, dtype="bfloat16", kv_cache_dtype="fp8", use_mla=True)
    assert choose_attention_backend(fp8, SM90, "TRITON_MLA").backend.name == "TRITON_MLA"
    e5m2 = AttentionSelectorConfig(head_size=576, dtype="bfloat16", kv_cache_dtype="fp8_e5m2", use_mla=True)
    assert choose_attention_backend(e5m2, SM90, "TRITON_MLA").backend.name == "TRITON_MLA"
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e5m2 not supported"):
        choose_attention_backend(e5m2, SM90, "FLASHMLA")
    with pytest.raises(ValueError, match=r"FLASHINFER_MLA is not valid.*kv_cache_dtype fp8 not supported"):
        choose_attention_backend(fp8, SM90, "FLASHINFER_MLA")


def test_mla_prefill_backend_option_is_validated():
    with pytest.raises(
        ValueError, match=r"mla_prefill_backend='BOGUS' is not valid; allowed: FLASH_ATTN, FLASHINFER"
    ):
        parse("-ac.mla_prefill_backend=BOGUS")
    assert parse("-ac.mla_prefill_backend=torch_sdpa").attention_config.mla_prefill_backend == "TORCH_SDPA"
    with pytest.raises(ValueError, match="use_prefill_query_quantization=true is not supported"):
        AttentionConfig(use_prefill_query_quantization=True)


def test_mla_prefill_choice_and_reasons():
    assert choose_prefill_backend(CPU, "float32").name == "TORCH_SDPA"
    with pytest.raises(
        ValueError, match=r"Selected MLA prefill backend FLASHINFER is not valid .*platform cpu"
    ):
        choose_prefill_backend(CPU, "float32", "FLASHINFER")
    with pytest.raises(ValueError, match=r"FLASH_ATTN is not valid .*no FlashAttention MLA prefill binding"):
        choose_prefill_backend(SM90, "bfloat16", "FLASH_ATTN", (192, 128))
    with pytest.raises(
        ValueError, match=r"head dims qk 24 / v 16 not supported \(supported: qk 192 / v 128\)"
    ):
        choose_prefill_backend(SM90, "bfloat16", "FLASHINFER", (24, 16))
    with pytest.raises(ValueError, match=r"TRTLLM_RAGGED is not valid .*could not be verified here"):
        choose_prefill_backend(SM100, "bfloat16", "TRTLLM_RAGGED", (192, 128))


def test_engine_refuses_a_prefill_backend_that_cannot_run(tiny_deepseek_v2_path):
    with pytest.raises(ValueError, match=r"Selected MLA prefill backend FLASHINFER is not valid"):
        LLM(str(tiny_deepseek_v2_path), attention_config={"mla_prefill_backend": "FLASHINFER"})


def test_engine_refuses_flashmla_on_this_machine(tiny_deepseek_v2_path):
    with pytest.raises(
        ValueError, match=r"^Selected backend FLASHMLA is not valid for this configuration. Reason:"
    ):
        LLM(str(tiny_deepseek_v2_path), attention_backend="FLASHMLA")


def test_backends_command_on_a_deepseek_folder(tiny_deepseek_v3_path, capsys):
    code = main(["backends", str(tiny_deepseek_v3_path), "--platform", "cuda", "--capability", "9.0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "use_mla=True" in out and "head_size=40" in out
    assert "Priority order for MLA attention" in out and "1. FLASH_ATTN_MLA" in out
    assert "Automatic selection: TRITON_MLA" in out
    assert "MLA prefill backends" in out and "MLA prefill selection: TORCH_SDPA" in out
    code = main(["backends", str(tiny_deepseek_v3_path), "--attention-backend", "FLASHMLA"])
    out = capsys.readouterr().out
    assert code == 1 and "Your selection: Selected backend FLASHMLA is not valid" in out
