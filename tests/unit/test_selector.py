"""Backend selection on CPU and simulated CUDA 8.0/9.0/10.0 and ROCm."""

from __future__ import annotations

import importlib.util
import logging

import pytest
from attention_fixtures import install_backend, isolated_registry, kvllm_logs  # noqa: F401

from kvllm.attention import registry
from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig, MultipleOf, OneOf
from kvllm.attention.selector import choose_attention_backend, clear_selection_cache, explain_kv_cache_dtype
from kvllm.config.backend_names import AttentionBackendEnum as B
from kvllm.platforms import backend_priority, current_device_info, simulate_platform
from kvllm.platforms.interface import DeviceInfo

# SmolLM2-135M: head 64, GQA 9:3, bf16 checkpoint.
SMOL = AttentionSelectorConfig(head_size=64, dtype="bfloat16")
CPU = DeviceInfo("cpu")
ROCM = DeviceInfo("rocm")
SM80, SM90, SM100 = DeviceInfo("cuda", (8, 0)), DeviceInfo("cuda", (9, 0)), DeviceInfo("cuda", (10, 0))


class FakeCuda(AttentionBackend):
    """A CUDA backend with no package requirement, to show priority order without GPU libraries."""

    platforms = ("cuda",)
    block_sizes = OneOf((16, 32, 64))
    head_sizes = OneOf((64, 128))
    preferred_block_size = 32


class FakeFlash(FakeCuda):
    name = "FLASH_ATTN"
    min_capability = (8, 0)


class FakeFlashInfer(FakeCuda):
    name = "FLASHINFER"
    min_capability = (8, 0)
    preferred_block_size = 64


class FakeTriton(AttentionBackend):
    name = "TRITON_ATTN"
    platforms = ("cuda", "rocm")
    supported_dtypes = ("float16", "bfloat16", "float32")
    block_sizes = MultipleOf(16)
    preferred_block_size = 16


@pytest.fixture
def fakes(isolated_registry: None) -> None:  # noqa: F811
    for cls in (FakeFlash, FakeFlashInfer, FakeTriton):
        install_backend(cls.name, cls)


def _chosen(config: AttentionSelectorConfig, device: DeviceInfo, requested: B | None = None) -> str:
    return choose_attention_backend(config, device, requested).backend.name


@pytest.mark.parametrize(
    ("device", "expected"),
    [(SM80, "FLASH_ATTN"), (SM90, "FLASH_ATTN"), (SM100, "FLASHINFER"), (ROCM, "TRITON_ATTN")],
)
def test_automatic_follows_priority_lists(fakes: None, device: DeviceInfo, expected: str) -> None:
    assert _chosen(SMOL, device) == expected


def test_automatic_skips_invalid_to_next_in_list(fakes: None, kvllm_logs: pytest.LogCaptureFixture) -> None:  # noqa: F811
    odd_head = AttentionSelectorConfig(head_size=80, dtype="float16")
    assert _chosen(odd_head, SM90) == "TRITON_ATTN"
    messages = [r.getMessage() for r in kvllm_logs.records if r.levelno == logging.INFO]
    potential = [n.name for n in backend_priority(SM90, use_mla=False)]
    assert potential[:3] == ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"]
    assert f"Using TRITON_ATTN attention backend out of potential backends: {potential}" in messages
    rejected = [m for m in messages if "rejected" in m]
    assert len(rejected) == 2
    assert "FLASH_ATTN" in rejected[0] and "head_size 80 not supported (supported: 64, 128)" in rejected[0]
    assert "FLASHINFER" in rejected[1]


def test_real_registry_on_this_machine() -> None:
    clear_selection_cache()
    assert _chosen(SMOL, CPU) == "CPU_ATTN"
    if registry.is_registered("TRITON_ATTN") and importlib.util.find_spec("triton") is not None:
        missing = [n for n in ("flash_attn", "flashinfer") if importlib.util.find_spec(n) is None]
        if len(missing) == 2:  # neither GPU library installed: Triton is the first valid CUDA backend
            for device in (SM90, SM100, ROCM):
                assert _chosen(SMOL, device) == "TRITON_ATTN"


def test_priority_lists_follow_spec() -> None:
    full = {
        d: backend_priority(d, use_mla=False, registered_only=False) for d in (SM80, SM90, SM100, ROCM, CPU)
    }
    assert full[SM100] == [B.FLASHINFER, B.FLASH_ATTN, B.TRITON_ATTN, B.FLEX_ATTENTION]
    assert full[SM90] == full[SM80] == [B.FLASH_ATTN, B.FLASHINFER, B.TRITON_ATTN, B.FLEX_ATTENTION]
    assert full[ROCM][0] == B.ROCM_ATTN and full[ROCM][-1] == B.TRITON_ATTN
    assert full[CPU] == [B.CPU_ATTN]
    assert backend_priority(SM100, use_mla=True, registered_only=False)[:2] == [
        B.FLASHINFER_MLA,
        B.CUTLASS_MLA,
    ]
    assert backend_priority(SM90, use_mla=True, registered_only=False)[0] == B.FLASH_ATTN_MLA
    assert backend_priority(CPU, use_mla=True, registered_only=False) == [B.CPU_MLA]
    # Filtered lists name only registered backends.
    for device in (SM90, ROCM, CPU):
        assert all(registry.is_registered(n.name) for n in backend_priority(device, use_mla=False))


@pytest.mark.parametrize("device", [CPU, SM80, SM90, SM100, ROCM], ids=str)
def test_invalid_manual_choice_raises_seed_text(device: DeviceInfo) -> None:
    wrong = "CPU_ATTN" if device.platform != "cpu" else "FLASH_ATTN"
    if not registry.is_registered(wrong):
        pytest.skip(f"{wrong} not registered in this build")
    with pytest.raises(ValueError) as info:
        choose_attention_backend(SMOL, device, B.from_name(wrong))
    text = str(info.value)
    assert text.startswith(f"Selected backend {wrong} is not valid for this configuration. Reason: [")
    assert f"platform {device.platform} not supported" in text
    assert "AttentionBackendEnum" not in text


def test_manual_choice_is_never_replaced(fakes: None) -> None:
    # FLASH_ATTN is first in the list, but the user asked for TRITON_ATTN: honour it.
    assert _chosen(SMOL, SM90, B.TRITON_ATTN) == "TRITON_ATTN"
    with pytest.raises(ValueError, match=r"Selected backend FLASH_ATTN is not valid .*head_size 80"):
        choose_attention_backend(AttentionSelectorConfig(head_size=80, dtype="float16"), SM90, B.FLASH_ATTN)


def test_unregistered_enum_member_is_unknown() -> None:
    with pytest.raises(
        ValueError, match=r"^Unknown attention backend: 'ROCM_AITER_MLA'. Valid options are: CPU_ATTN"
    ):
        choose_attention_backend(SMOL, SM90, B.ROCM_AITER_MLA)


def test_no_valid_backend_lists_reasons(fakes: None) -> None:
    config = AttentionSelectorConfig(head_size=64, dtype="float16", block_size=24)
    with pytest.raises(ValueError) as info:
        choose_attention_backend(config, SM90)
    text = str(info.value)
    assert text.startswith("No valid attention backend found for cuda")
    assert str(config) in text
    assert "Reasons: {FLASH_ATTN: [" in text and "FLASHINFER: [" in text and "TRITON_ATTN: [" in text
    assert "block_size 24 not supported (supported: multiples of 16)" in text
    assert "FLEX_ATTENTION: " in text


def test_mla_on_cpu_is_cpu_mla_and_its_limits_are_reasons() -> None:
    mla = AttentionSelectorConfig(head_size=576, dtype="bfloat16", use_mla=True)
    assert choose_attention_backend(mla, CPU).backend.name == "CPU_MLA"
    with pytest.raises(
        ValueError,
        match=r"No valid attention backend found for cpu .*CPU_MLA: \['head_size 1100 not supported",
    ):
        choose_attention_backend(AttentionSelectorConfig(head_size=1100, dtype="bfloat16", use_mla=True), CPU)


def test_block_size_preferred_and_pinned(fakes: None, kvllm_logs: pytest.LogCaptureFixture) -> None:  # noqa: F811
    assert choose_attention_backend(SMOL, SM90).block_size == 32  # FakeFlash's preferred size
    assert choose_attention_backend(SMOL, SM100).block_size == 64  # FakeFlashInfer's
    pinned = AttentionSelectorConfig(head_size=64, dtype="bfloat16", block_size=48)
    choice = choose_attention_backend(pinned, SM90)
    assert (choice.backend.name, choice.block_size) == ("TRITON_ATTN", 48)
    warnings = [r.getMessage() for r in kvllm_logs.records if r.levelno == logging.WARNING]
    assert any(
        "block_size 48 rules out" in w and "FLASH_ATTN, FLASHINFER" in w and "using TRITON_ATTN" in w
        for w in warnings
    )


def test_choice_is_cached(fakes: None, kvllm_logs: pytest.LogCaptureFixture) -> None:  # noqa: F811
    first = choose_attention_backend(SMOL, SM90)
    count = len(kvllm_logs.records)
    assert choose_attention_backend(SMOL, SM90) is first
    assert len(kvllm_logs.records) == count  # no second round of logging


def test_simulate_platform_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    with simulate_platform("cuda", (9, 0)) as device:
        assert current_device_info() == device == SM90
        with simulate_platform("rocm"):
            assert current_device_info() == ROCM
        assert current_device_info() == SM90
    monkeypatch.setenv("KVLLM_SIMULATE_PLATFORM", "cuda:10.0")
    assert current_device_info() == SM100
    monkeypatch.setenv("KVLLM_SIMULATE_PLATFORM", "cuda")
    with pytest.raises(ValueError, match="needs a compute capability"):
        current_device_info()
    with pytest.raises(ValueError, match="Unknown platform 'tpu'"):
        with simulate_platform("tpu"):
            pass


def test_explain_kv_cache_dtype(kvllm_logs: pytest.LogCaptureFixture) -> None:  # noqa: F811
    explain_kv_cache_dtype("bfloat16", "auto", SM80)
    assert not kvllm_logs.records
    explain_kv_cache_dtype("bfloat16", "fp8", SM90)
    (mixed,) = [r for r in kvllm_logs.records if r.levelno == logging.WARNING]
    assert (
        "fp8" in mixed.getMessage() and "bfloat16" in mixed.getMessage() and "accuracy" in mixed.getMessage()
    )
    kvllm_logs.clear()
    explain_kv_cache_dtype("float16", "fp8_e4m3", SM80)
    assert any("no speed-up" in r.getMessage() and "8.0" in r.getMessage() for r in kvllm_logs.records)


def test_reasons_name_value_and_supported_set() -> None:
    config = AttentionSelectorConfig(
        head_size=88,
        dtype="float16",
        kv_cache_dtype="fp8_e5m2",
        block_size=24,
        has_sink=True,
        logits_soft_cap=30.0,
    )
    reasons = FakeFlash.validate_configuration(config, SM80)
    assert "head_size 88 not supported (supported: 64, 128)" in reasons
    assert "block_size 24 not supported (supported: 16, 32, 64)" in reasons
    assert any(r.startswith("kv_cache_dtype fp8_e5m2 not supported (supported: auto") for r in reasons)
    assert any(r.startswith("attention sinks not supported") for r in reasons)
    assert any(r.startswith("logits soft-cap 30.0 not supported") for r in reasons)
    assert "compute capability 7.5 not supported (needs >= 8.0)" in FakeFlash.validate_configuration(
        SMOL, DeviceInfo("cuda", (7, 5))
    )
    # Encoder-only layers keep no KV cache: their KV dtype never disqualifies a backend.
    encoder = AttentionSelectorConfig(
        head_size=64, dtype="float16", kv_cache_dtype="fp8_e5m2", attn_type="encoder_only"
    )
    assert not any("kv_cache_dtype" in r for r in FakeFlash.validate_configuration(encoder, SM90))


def test_missing_package_is_a_reason_naming_the_extra() -> None:
    class NeedsPkg(FakeFlash):
        required_package = "kvllm_no_such_kernel_lib"
        pip_extra = "no-such"

    reasons = NeedsPkg.validate_configuration(SMOL, SM90)
    assert reasons == ["package kvllm_no_such_kernel_lib not installed (pip install 'kvllm[no-such]')"]
