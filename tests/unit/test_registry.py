"""The backend registry: lazy imports, out-of-tree registration, unknown names."""

from __future__ import annotations

import sys

import pytest
from attention_fixtures import isolated_registry  # noqa: F401

from kvllm.attention import registry
from kvllm.attention.backend import AttentionBackend
from kvllm.config import backend_names
from kvllm.config.attention import AttentionConfig
from kvllm.config.backend_names import AttentionBackendEnum
from kvllm.config.engine import EngineArgs


class OutOfTreeBackend(AttentionBackend):
    name = "MY_ATTN"
    platforms = ("cpu",)


def test_builtins_registered_only_when_their_module_exists() -> None:
    names = registry.registered_backend_names()
    assert "CPU_ATTN" in names
    assert names == sorted(names)
    for name, path in backend_names.BUILTIN_BACKENDS.items():
        assert (name in names) == backend_names.module_exists(path.partition(":")[0])
    # Names with no implementation are known to the enum but never registered.
    assert "ROCM_AITER_MLA" not in names and "ROCM_ATTN" not in names
    # The MLA family is registered, the kernel-less ones (FLASHMLA, ...) too, so selection can explain them.
    assert {"CPU_MLA", "TRITON_MLA", "FLASHINFER_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA"} <= set(
        names
    )


def test_listing_names_imports_no_backend_module() -> None:
    registry.registered_backend_names()
    assert registry.backend_path("CPU_ATTN") == "kvllm.attention.backends.cpu_attn:CpuAttentionBackend"


def test_get_backend_class() -> None:
    cls = registry.get_backend_class("CPU_ATTN")
    assert issubclass(cls, AttentionBackend) and cls.name == "CPU_ATTN"
    assert registry.get_backend_class(AttentionBackendEnum.CPU_ATTN) is cls


def test_unknown_name_lists_valid_ones() -> None:
    valid = ", ".join(registry.registered_backend_names())
    expected = f"Unknown attention backend: 'FOO'. Valid options are: {valid}"
    for call in (
        lambda: AttentionBackendEnum.from_name("FOO"),
        lambda: registry.get_backend_class("FOO"),
        lambda: EngineArgs(attention_backend="FOO"),
        lambda: AttentionConfig(backend="FOO"),
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == expected


def test_from_name_accepts_lower_case_and_enum() -> None:
    assert AttentionBackendEnum.from_name("cpu_attn") is AttentionBackendEnum.CPU_ATTN
    assert AttentionBackendEnum.from_name(AttentionBackendEnum.CPU_ATTN) is AttentionBackendEnum.CPU_ATTN


def test_register_out_of_tree_backend(isolated_registry: None) -> None:  # noqa: F811
    registry.register_backend("MY_ATTN", f"{__name__}:OutOfTreeBackend")
    assert "MY_ATTN" in registry.registered_backend_names()
    assert registry.get_backend_class("MY_ATTN") is OutOfTreeBackend
    member = AttentionBackendEnum.from_name("MY_ATTN")
    assert member.name == "MY_ATTN" and str(member) == "MY_ATTN"
    assert EngineArgs(attention_backend="MY_ATTN").backend is member
    registry.unregister_backend("MY_ATTN")
    with pytest.raises(ValueError, match="Unknown attention backend: 'MY_ATTN'"):
        AttentionBackendEnum.from_name("MY_ATTN")


def test_register_rejects_duplicates_and_invalid(isolated_registry: None) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("CPU_ATTN", "somewhere:Else")
    for bad in ("my_attn", "1ATTN", "MY-ATTN", ""):
        with pytest.raises(ValueError, match="Invalid attention backend name"):
            registry.register_backend(bad, "pkg.mod:Cls")
    for bad in ("pkg.mod.Cls", "pkg.mod:", ":Cls", "pkg mod:Cls"):
        with pytest.raises(ValueError, match="Invalid class path"):
            registry.register_backend("MY_ATTN", bad)


def test_broken_module_is_an_import_error_naming_the_backend(isolated_registry: None) -> None:  # noqa: F811
    registry.register_backend("BROKEN_ATTN", "kvllm_no_such_module:Backend")
    with pytest.raises(
        ImportError, match="attention backend BROKEN_ATTN: cannot import kvllm_no_such_module"
    ):
        registry.get_backend_class("BROKEN_ATTN")
    from kvllm.attention.backend import AttentionSelectorConfig
    from kvllm.attention.selector import backend_reasons
    from kvllm.platforms.interface import DeviceInfo

    reasons = backend_reasons("BROKEN_ATTN", AttentionSelectorConfig(64, "float16"), DeviceInfo("cpu"))
    assert len(reasons) == 1 and "cannot import kvllm_no_such_module" in reasons[0]


def test_not_a_backend_class(isolated_registry: None) -> None:  # noqa: F811
    registry.register_backend("NOT_A_BACKEND", "json:JSONDecoder")
    with pytest.raises(ImportError, match="not an AttentionBackend subclass"):
        registry.get_backend_class("NOT_A_BACKEND")


def test_declarations_import_without_torch() -> None:
    import subprocess

    code = (
        "import sys\n"
        "from kvllm.attention import registry\n"
        "for n in registry.registered_backend_names(): registry.get_backend_class(n)\n"
        "import kvllm.platforms, kvllm.config.engine\n"
        "assert 'torch' not in sys.modules, 'torch imported by declarations'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
