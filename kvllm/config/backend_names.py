"""Attention backend names: the enum every floor speaks, and which names this build registers.

Pure data (no torch, no kernel library). A registered name maps to the "module:Class" path of its
declarations; `kvllm.attention.registry` imports the class on first use and adds out-of-tree
backends (`register_backend`). The paths below are strings, so this module imports nothing from
the attention package it names.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

# Every built-in backend kvllm knows how to load, in no particular order (priority lives in
# kvllm.platforms). A line here whose module is absent from this build registers nothing, so a
# backend becomes available by adding its module (and, for a new backend, one line here).
BUILTIN_BACKENDS: dict[str, str] = {
    "CPU_ATTN": "kvllm.attention.backends.cpu_attn:CpuAttentionBackend",
    "TRITON_ATTN": "kvllm.attention.backends.triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "kvllm.attention.backends.flex_attention:FlexAttentionBackend",
    "FLASH_ATTN": "kvllm.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER": "kvllm.attention.backends.flashinfer:FlashInferBackend",
    "CPU_MLA": "kvllm.attention.backends.mla.cpu_mla:CpuMLABackend",
    "TRITON_MLA": "kvllm.attention.backends.mla.triton_mla:TritonMLABackend",
    "FLASHINFER_MLA": "kvllm.attention.backends.mla.flashinfer_mla:FlashInferMLABackend",
    "FLASHMLA": "kvllm.attention.backends.mla.flashmla:FlashMLABackend",
    "FLASH_ATTN_MLA": "kvllm.attention.backends.mla.flash_attn_mla:FlashAttnMLABackend",
    "CUTLASS_MLA": "kvllm.attention.backends.mla.cutlass_mla:CutlassMLABackend",
}

# MLA prefill backends (vLLM's names plus kvllm's TORCH_SDPA), in automatic order: the vocabulary of
# -ac.mla_prefill_backend. Their declarations live in kvllm.attention.backends.mla.prefill.
MLA_PREFILL_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "CUDNN", "TORCH_SDPA")

_backends: dict[str, str] | None = None  # name -> "module:Class"; built on first use


def module_exists(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


def backend_table() -> dict[str, str]:
    """The registered backends, name -> "module:Class" (the one mutable table; the registry edits it)."""
    global _backends
    if _backends is None:
        _backends = {
            name: path for name, path in BUILTIN_BACKENDS.items() if module_exists(path.partition(":")[0])
        }
    return _backends


def registered_backend_names() -> list[str]:
    """Names of every registered (implemented) backend, sorted."""
    return sorted(backend_table())


def is_registered(name: object) -> bool:
    """Whether `name` (a backend name or enum member) is registered."""
    return str(name) in backend_table()


def unknown_backend_error(name: object) -> ValueError:
    return ValueError(
        f"Unknown attention backend: {name!r}. Valid options are: {', '.join(registered_backend_names())}"
    )


class AttentionBackendEnum(enum.Enum):
    """Every attention backend name kvllm knows. Only implemented ones are registered (see above)."""

    FLASH_ATTN = "FLASH_ATTN"
    FLASHINFER = "FLASHINFER"
    TRITON_ATTN = "TRITON_ATTN"
    FLEX_ATTENTION = "FLEX_ATTENTION"
    CPU_ATTN = "CPU_ATTN"
    TRITON_MLA = "TRITON_MLA"
    FLASHMLA = "FLASHMLA"
    FLASH_ATTN_MLA = "FLASH_ATTN_MLA"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    CUTLASS_MLA = "CUTLASS_MLA"
    CPU_MLA = "CPU_MLA"
    ROCM_ATTN = "ROCM_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    ROCM_AITER_UNIFIED_ATTN = "ROCM_AITER_UNIFIED_ATTN"
    ROCM_AITER_MLA = "ROCM_AITER_MLA"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_name(cls, name: str | BackendName) -> BackendName:
        """Parse a registered backend name; unknown names list the registered (implemented) ones.

        An out-of-tree name gets a CustomBackendName (one object per name), not an enum member.
        """
        if isinstance(name, cls | AutoTune):
            return name
        if is_auto_tune(name):
            return AUTO_TUNE
        key = str(name).strip().upper()
        if not is_registered(key):
            raise unknown_backend_error(name)
        return cls[key] if key in cls.__members__ else CustomBackendName.named(key)


@dataclass(frozen=True)
class CustomBackendName:
    """The name of an out-of-tree backend (registered at run time), in the enum's place.

    Like a member, it has `name` and `value` and prints as its name; `named` returns one object
    per name, so choices made from the same name are identical.
    """

    name: str

    @property
    def value(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name

    @classmethod
    def named(cls, name: str) -> CustomBackendName:
        return _custom_names.setdefault(name, cls(name))


_custom_names: dict[str, CustomBackendName] = {}


@dataclass(frozen=True)
class AutoTune:
    """`--attention-backend auto-tune` (beyond vLLM): at start-up, time every backend valid for the
    model on this machine on the model's own shapes and use the fastest (kvllm.attention.autotune).

    Not a backend: the engine resolves it to one before binding the model.
    """

    name: str = "auto-tune"

    @property
    def value(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name


AUTO_TUNE = AutoTune()


def is_auto_tune(name: object) -> bool:
    """Whether `name` asks for auto-tuning: "auto-tune" (also written AUTO_TUNE or auto_tune)."""
    if isinstance(name, AutoTune):
        return True
    return isinstance(name, str) and name.strip().lower().replace("_", "-") == AUTO_TUNE.name


BackendName = AttentionBackendEnum | CustomBackendName | AutoTune
