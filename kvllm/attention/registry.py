"""Registry from backend names to lazily imported backend classes (placeholder; issue 3 completes it)."""

from __future__ import annotations

import importlib

from kvllm.attention.backend import AttentionBackend

_BACKENDS: dict[str, str] = {
    "CPU_ATTN": "kvllm.attention.backends.cpu_attn:CpuAttentionBackend",
}


def registered_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[AttentionBackend]:
    module_name, _, class_name = _BACKENDS[str(name)].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
