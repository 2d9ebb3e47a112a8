"""FLASH_ATTN and FLASHINFER on a machine without CUDA or without their libraries.

Covers the reasons validation gives (naming what is missing and how to install it), the
flash_attn_version and use_trtllm_attention knobs, and the host-side metadata construction,
which must run without the kernel libraries.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kvllm.attention.backend import AttentionSelectorConfig
from kvllm.attention.backends import flashinfer_impl
from kvllm.attention.backends.flash_attn import FlashAttentionBackend
from kvllm.attention.backends.flash_attn_impl import FlashAttentionMetadataBuilder
from kvllm.attention.backends.flashinfer import FlashInferBackend, VerifiedAxes, describe_pairs
from kvllm.attention.backends.flashinfer_impl import (
    paged_kv_host_arrays,
    paged_kv_indices,
)
from kvllm.attention.backends.flashinfer_impl import (
    write_to_paged_cache as write_to_flashinfer_cache,
)
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.ops.paged_cache_write import write_kv_to_paged_cache
from kvllm.attention.reference import make_paged_batch
from kvllm.platforms.interface import DeviceInfo

CPU = DeviceInfo("cpu")
H200 = DeviceInfo("cuda", (9, 0))
A100 = DeviceInfo("cuda", (8, 0))
B200 = DeviceInfo("cuda", (10, 0))
FA_MISSING = "package flash_attn (FlashAttention-4, module flash_attn.cute) not installed (pip install 'kvllm[flash-attn]')"
FI_MISSING = "package flashinfer not installed (pip install 'kvllm[flashinfer]')"


def selector_config(**kwargs: object) -> AttentionSelectorConfig:
    """A selector config; knobs AttentionSelectorConfig does not (yet) have go on a subclass."""
    kwargs.setdefault("head_size", 128)
    kwargs.setdefault("dtype", "bfloat16")
    known = {f.name for f in dataclasses.fields(AttentionSelectorConfig)}
    extra = {k: v for k, v in kwargs.items() if k not in known}
    if not extra:
        return AttentionSelectorConfig(**kwargs)
    cls = dataclasses.make_dataclass(
        "Config", [(k, object, None) for k in extra], bases=(AttentionSelectorConfig,), frozen=True
    )
    return cls(**kwargs)


@pytest.fixture
def no_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name.split(".")[0] in ("flash_attn", "flashinfer"):
            return None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def packages_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Simulate flashinfer and the FA4 wheel (namespace package flash_attn with a cute/ module)."""
    cute = tmp_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("")
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name == "flash_attn":
            return types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "flash_attn")])
        if name == "flashinfer":
            return types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "flashinfer")])
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# ---- package and platform reasons ---------------------------------------------------------------------


def test_declarations_import_without_torch() -> None:
    code = (
        "import sys\n"
        "from kvllm.attention.backends.flash_attn import FlashAttentionBackend\n"
        "from kvllm.attention.backends.flashinfer import FlashInferBackend\n"
        "assert 'torch' not in sys.modules, 'declarations imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("backend", "missing"), [(FlashAttentionBackend, FA_MISSING), (FlashInferBackend, FI_MISSING)]
)
def test_cpu_without_packages(no_packages: None, backend: type, missing: str) -> None:
    reasons = backend.validate_configuration(selector_config(), CPU)
    assert reasons == ["platform cpu not supported (supported: cuda)", missing]


@pytest.mark.parametrize(
    ("backend", "missing"), [(FlashAttentionBackend, FA_MISSING), (FlashInferBackend, FI_MISSING)]
)
def test_hopper_without_package_names_the_install(no_packages: None, backend: type, missing: str) -> None:
    assert backend.validate_configuration(selector_config(), H200) == [missing]


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend])
def test_hopper_with_packages_is_valid(packages_present: None, backend: type) -> None:
    assert backend.validate_configuration(selector_config(), H200) == []


def test_flash_attn_parent_without_cute_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The classic flash-attn (FA2) wheel provides flash_attn but not flash_attn.cute."""
    (tmp_path / "flash_attn").mkdir()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "flash_attn")])
            if name == "flash_attn"
            else real(name, *a)
        ),
    )
    assert FlashAttentionBackend.missing_package_reason() == FA_MISSING


def test_declared_values_are_reasons_with_supported_sets(packages_present: None) -> None:
    config = selector_config(head_size=80, dtype="float32", kv_cache_dtype="int8", block_size=24)
    reasons = FlashInferBackend.validate_configuration(config, H200)
    assert "head_size 80 not supported (supported: 64, 128, 256)" in reasons
    assert "dtype float32 not supported (supported: float16, bfloat16)" in reasons
    assert "block_size 24 not supported (supported: 16, 32, 64)" in reasons
    assert any(r.startswith("kv_cache_dtype int8 not supported") for r in reasons)
    assert FlashInferBackend.validate_configuration(selector_config(has_sink=True), H200)[0].startswith(
        "attention sinks not supported"
    )
    fa = FlashAttentionBackend.validate_configuration(selector_config(kv_cache_dtype="fp8"), H200)
    assert fa == ["kv_cache_dtype fp8 not supported (supported: auto, float16, bfloat16)"]


def test_flashinfer_declares_everything_it_implements_now_that_every_pair_passed(
    packages_present: None,
) -> None:
    """The walk passed all 27 cases of every (dtype, cache) pair (twenty-seventh session): head sizes
    64/128/256, blocks 16/32/64, window and soft-cap declared for both model dtypes and every cache."""
    fi = FlashInferBackend
    assert set(fi.head_sizes.values) == set(fi.IMPLEMENTED_HEAD_SIZES)
    assert set(fi.block_sizes.values) == set(fi.IMPLEMENTED_BLOCK_SIZES)
    assert fi.supports_sliding_window and fi.supports_logits_soft_cap
    assert fi.FP8_KV_CACHE_VERIFIED and {"fp8", "fp8_e4m3", "fp8_e5m2"} <= set(fi.supported_kv_cache_dtypes)
    for dtype in ("bfloat16", "float16"):
        for kv in ("auto", dtype, "fp8", "fp8_e4m3", "fp8_e5m2"):
            wide = selector_config(dtype=dtype, kv_cache_dtype=kv, head_size=256, block_size=64,
                                   has_sliding_window=True, logits_soft_cap=30.0)  # fmt: skip
            assert fi.validate_configuration(wide, H200) == [], (dtype, kv)
    assert fi.validate_configuration(selector_config(head_size=96), H200) == [
        "head_size 96 not supported (supported: 64, 128, 256)"
    ]


def _partly_verified(monkeypatch: pytest.MonkeyPatch, by_dtypes: dict) -> None:
    """The declaration as it stood before the float16 walk: head size 128 and blocks 16/32 everywhere,
    the rest per pair."""
    monkeypatch.setattr(FlashInferBackend, "VERIFIED_HEAD_SIZES", (128,))
    monkeypatch.setattr(FlashInferBackend, "VERIFIED_BLOCK_SIZES", (16, 32))
    monkeypatch.setattr(FlashInferBackend, "VERIFIED_SLIDING_WINDOW", False)
    monkeypatch.setattr(FlashInferBackend, "VERIFIED_LOGITS_SOFT_CAP", False)
    monkeypatch.setattr(FlashInferBackend, "VERIFIED_BY_DTYPES", by_dtypes)


def test_flashinfer_refuses_with_a_reason_what_passed_for_other_pairs_only(
    packages_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk that covered some (dtype, cache) pairs completely: the others are refused, naming the pairs
    that passed."""
    fi = FlashInferBackend
    wide = VerifiedAxes((64, 128, 256), (16, 32, 64), True, True)
    _partly_verified(monkeypatch, {("bfloat16", c): wide for c in ("bfloat16", "fp8_e4m3", "fp8_e5m2")})
    for kv in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        config = selector_config(dtype="bfloat16", kv_cache_dtype=kv, head_size=256, block_size=64,
                                 has_sliding_window=True, logits_soft_cap=30.0)  # fmt: skip
        assert fi._pending_verification_reasons(config) == []
    verified = "verified for FLASHINFER with dtype bfloat16 with a bfloat16, fp8_e4m3 or fp8_e5m2 cache only"
    assert fi._pending_verification_reasons(
        selector_config(dtype="float16", has_sliding_window=True, head_size=64, block_size=64)
    ) == [
        f"head_size 64, block_size 64, sliding window: {verified}, not yet with dtype float16 and kv_cache_dtype "
        "auto (benchmarks/h200/backend_walk.py flashinfer)",
    ]
    fp8 = selector_config(dtype="float16", kv_cache_dtype="fp8", logits_soft_cap=30.0)
    assert fi._pending_verification_reasons(fp8) == [
        f"logits soft-cap: {verified}, not yet with dtype float16 and kv_cache_dtype fp8 "
        "(benchmarks/h200/backend_walk.py flashinfer)"
    ]


def test_flashinfer_pairs_in_words() -> None:
    assert describe_pairs([("bfloat16", "bfloat16")]) == "dtype bfloat16 with a bfloat16 cache"
    assert describe_pairs([("bfloat16", "bfloat16"), ("float16", "fp8_e5m2"), ("bfloat16", "fp8_e4m3")]) == (
        "dtype bfloat16 with a bfloat16 or fp8_e4m3 cache; dtype float16 with a fp8_e5m2 cache"
    )


def test_flashinfer_reason_for_what_is_implemented_but_verified_nowhere(
    packages_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _partly_verified(monkeypatch, {})
    assert FlashInferBackend._pending_verification_reasons(selector_config(head_size=64, block_size=64)) == [
        "head_size 64, block_size 64: implemented for FLASHINFER but not yet verified on an H200, so not "
        "declared (benchmarks/h200/backend_walk.py flashinfer)"
    ]


# ---- flash_attn_version ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [2, 3])
def test_flash_attn_versions_not_built_are_reasons(packages_present: None, version: int) -> None:
    reasons = FlashAttentionBackend.validate_configuration(selector_config(flash_attn_version=version), H200)
    assert reasons == [
        f"flash_attn_version {version} (FlashAttention-{version}) is not available in this build (available: FA4)"
    ]


@pytest.mark.parametrize("device", [H200, B200])
@pytest.mark.parametrize("version", [None, 4])
def test_fa4_default_or_requested_is_valid_on_hopper_and_blackwell(
    packages_present: None, device: DeviceInfo, version: int | None
) -> None:
    assert (
        FlashAttentionBackend.validate_configuration(selector_config(flash_attn_version=version), device)
        == []
    )


def test_fa4_on_ampere_names_the_capability(packages_present: None) -> None:
    reasons = FlashAttentionBackend.validate_configuration(selector_config(flash_attn_version=4), A100)
    assert "compute capability 8.0 not supported (needs 9.0-11.9)" in reasons
    assert "flash_attn_version 4 needs compute capability >= 9.0 (this device: 8.0)" in reasons
    default = FlashAttentionBackend.validate_configuration(selector_config(), A100)
    assert any(
        "FlashAttention-2 (the default on compute capability 8.0) is not available" in r for r in default
    )


def test_flash_attn_version_reason_carries_through_cpu(no_packages: None) -> None:
    reasons = FlashAttentionBackend.validate_configuration(selector_config(flash_attn_version=3), CPU)
    assert reasons == ["platform cpu not supported (supported: cuda)", FA_MISSING]


# ---- use_trtllm_attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", [H200, A100])
def test_trtllm_attention_off_blackwell_is_a_reason(packages_present: None, device: DeviceInfo) -> None:
    reasons = FlashInferBackend.validate_configuration(selector_config(use_trtllm_attention=True), device)
    cap = f"{device.capability[0]}.{device.capability[1]}"
    assert reasons == [
        "use_trtllm_attention needs compute capability 10.x (TRT-LLM kernels), which this build could not verify"
        f" (this device: {cap})"
    ]


def test_trtllm_attention_on_blackwell_is_unverified(packages_present: None) -> None:
    reasons = FlashInferBackend.validate_configuration(selector_config(use_trtllm_attention=True), B200)
    assert (
        len(reasons) == 1
        and "could not be verified" in reasons[0]
        and "use_trtllm_attention=False" in reasons[0]
    )


@pytest.mark.parametrize("value", [None, False])
def test_trtllm_attention_unset_or_off_is_fine(packages_present: None, value: bool | None) -> None:
    assert FlashInferBackend.validate_configuration(selector_config(use_trtllm_attention=value), H200) == []


# ---- host-side metadata ------------------------------------------------------------------------------


def test_kv_cache_shapes() -> None:
    assert FlashAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)


def _reference_page_lists(
    block_table: torch.Tensor, seq_lens: list[int], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    indptr, indices, last = [0], [], []
    for r, s in enumerate(seq_lens):
        pages = -(-s // block_size)
        indices.extend(block_table[r, :pages].tolist())
        indptr.append(indptr[-1] + pages)
        last.append(s - (pages - 1) * block_size)
    return indptr, indices, last


@pytest.mark.parametrize("seed", range(8))
def test_flashinfer_page_lists_match_per_sequence_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    block_size = [16, 32, 64][seed % 3]
    num_reqs = int(torch.randint(1, 12, (), generator=gen))
    seq_lens = torch.randint(1, 5 * block_size, (num_reqs,), generator=gen)
    if seed % 2:  # exact page multiples hit last_page_len == block_size
        seq_lens[0] = 2 * block_size
    max_blocks = int((seq_lens.max() + block_size - 1) // block_size) + 2
    block_table = torch.randperm(num_reqs * max_blocks, generator=gen)[: num_reqs * max_blocks]
    block_table = block_table.view(num_reqs, max_blocks).to(torch.int32)

    host = paged_kv_host_arrays(seq_lens.to(torch.int32), block_size, max_blocks)
    indices = paged_kv_indices(block_table, host.gather_index)
    ref_indptr, ref_indices, ref_last = _reference_page_lists(block_table, seq_lens.tolist(), block_size)
    assert host.indptr.dtype == host.last_page_len.dtype == indices.dtype == torch.int32
    assert host.indptr.tolist() == ref_indptr
    assert indices.tolist() == ref_indices
    assert host.last_page_len.tolist() == ref_last


def test_flashinfer_builder_splits_decode_and_prefill_without_flashinfer() -> None:
    batch = make_paged_batch([1, 1, 1, 7, 20], [40, 3, 16, 0, 33], 4, 2, 64, 16, seed=1)
    spec = KVCacheSpec(16, 2, 64, torch.bfloat16, "auto")
    builder = object.__new__(flashinfer_impl.FlashInferMetadataBuilder)  # no flashinfer, no workspace
    flashinfer_impl.AttentionMetadataBuilder.__init__(
        builder, FlashInferBackend, spec, torch.device("cpu"), 8, 64, 128
    )
    builder._wrappers = {}
    meta = builder.build(batch.metadata)
    indptr, indices, last = _reference_page_lists(batch.block_table, batch.seq_lens, 16)
    split = indptr[3]
    assert meta.num_decodes == 3 and meta.num_prefills == 2
    assert meta.decode_indptr.tolist() == indptr[:4]
    assert meta.decode_indices.tolist() == indices[:split]
    assert meta.decode_last_page_len.tolist() == last[:3]
    assert meta.prefill_indptr.tolist() == [p - split for p in indptr[3:]]
    assert meta.prefill_indices.tolist() == indices[split:]
    assert meta.prefill_last_page_len.tolist() == last[3:]
    assert meta.prefill_qo_indptr.tolist() == [0, 7, 27]
    assert meta.planned == {}  # no layer seen yet: nothing planned


def test_flash_attn_builder_passes_int32_contiguous_tables() -> None:
    batch = make_paged_batch([1, 5], [9, 4], 4, 2, 64, 16, seed=2)
    spec = KVCacheSpec(16, 2, 64, torch.bfloat16, "auto")
    meta = FlashAttentionMetadataBuilder(FlashAttentionBackend, spec, torch.device("cpu"), 8, 64, 128).build(
        batch.metadata
    )
    assert meta.block_table.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert meta.block_table.is_contiguous()
    assert meta.max_query_len == 5 and meta.num_actual_tokens == 6


def test_cache_writes_skip_padding_slots() -> None:
    batch = make_paged_batch([1, 6], [5, 10], 4, 2, 64, 16, seed=3)
    slots = torch.cat([batch.metadata.slot_mapping, torch.tensor([-1, -1])])
    key = torch.cat([batch.new_keys, torch.full((2, 2, 64), 99.0)])
    value = torch.cat([batch.new_values, torch.full((2, 2, 64), 99.0)])
    fa_cache = torch.zeros(2, batch.num_blocks, 16, 2, 64)
    write_kv_to_paged_cache(fa_cache[0], fa_cache[1], key, value, slots)
    fi_cache = torch.zeros(batch.num_blocks, 2, 16, 2, 64)
    write_to_flashinfer_cache(fi_cache, key, value, slots)
    for t, slot in enumerate(batch.metadata.slot_mapping.tolist()):
        b, o = divmod(slot, 16)
        assert torch.equal(fa_cache[0, b, o], batch.new_keys[t]) and torch.equal(
            fa_cache[1, b, o], batch.new_values[t]
        )
        assert torch.equal(fi_cache[b, 0, o], batch.new_keys[t]) and torch.equal(
            fi_cache[b, 1, o], batch.new_values[t]
        )
    assert not (fa_cache == 99.0).any() and not (fi_cache == 99.0).any()


def test_flashinfer_fp8_write_divides_by_scale() -> None:
    cache = torch.zeros(2, 2, 16, 1, 8, dtype=torch.float8_e4m3fn)
    key = torch.full((1, 1, 8), 2.0)
    write_to_flashinfer_cache(cache, key, key, torch.tensor([17]), torch.tensor(4.0), torch.tensor(0.5))
    assert cache[1, 0, 1].float().eq(0.5).all() and cache[1, 1, 1].float().eq(4.0).all()


# ---- FlashInfer's kernel cache -----------------------------------------------------------------------


def test_flashinfer_workspace_defaults_under_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = flashinfer_impl.flashinfer_workspace_base()
    assert base == tmp_path / "kvllm" / "flashinfer"
    import os

    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(base)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", "/somewhere/else")
    assert str(flashinfer_impl.flashinfer_workspace_base()) == "/somewhere/else"


def test_import_flashinfer_logs_first_compile_and_explains_missing_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with caplog.at_level(logging.INFO, logger=flashinfer_impl.__name__):
        with pytest.raises(RuntimeError, match=r"pip install 'kvllm\[flashinfer\]'"):
            flashinfer_impl.import_flashinfer()
    assert "FlashInfer is compiling kernels for first use; this can take a few minutes" in caplog.text


def test_import_flashinfer_is_quiet_with_a_warm_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cached = tmp_path / ".cache" / "flashinfer" / "90a" / "cached_ops"
    cached.mkdir(parents=True)
    (cached / "decode.so").write_bytes(b"")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with caplog.at_level(logging.INFO, logger=flashinfer_impl.__name__):
        with pytest.raises(RuntimeError):
            flashinfer_impl.import_flashinfer()
    assert "compiling kernels" not in caplog.text


@pytest.mark.parametrize("backend", [FlashAttentionBackend, FlashInferBackend])
def test_16bit_kv_dtype_must_match_model_dtype(packages_present: None, backend: type) -> None:
    assert backend.validate_configuration(selector_config(kv_cache_dtype="bfloat16"), H200) == []
    reasons = backend.validate_configuration(selector_config(kv_cache_dtype="float16"), H200)
    assert len(reasons) == 1 and reasons[0].startswith(
        "kv_cache_dtype float16 with dtype bfloat16 not supported"
    )
