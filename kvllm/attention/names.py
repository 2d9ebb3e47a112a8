"""Names of attention backends. Pure data: importable without torch or any kernel library."""

from __future__ import annotations

import enum


class AttentionBackendEnum(enum.Enum):
    """Every attention backend name kvllm knows. Only implemented ones are registered (see registry)."""

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
    def from_name(cls, name: str | AttentionBackendEnum) -> AttentionBackendEnum:
        """Parse a backend name; unknown names list the registered (implemented) ones."""
        if isinstance(name, cls):
            return name
        from kvllm.attention.registry import registered_backend_names

        key = str(name).strip().upper()
        if key in registered_backend_names():
            return cls[key] if key in cls.__members__ else _extension_member(key)
        raise ValueError(
            f"Unknown attention backend: {name!r}. Valid options are: {', '.join(registered_backend_names())}"
        )


def _extension_member(name: str) -> AttentionBackendEnum:
    """Out-of-tree backends registered at run time get an enum member of their own."""
    member = object.__new__(AttentionBackendEnum)
    member._name_ = name
    member._value_ = name
    AttentionBackendEnum._member_map_[name] = member
    AttentionBackendEnum._value2member_map_[name] = member
    return member
