"""Attention backend selection (placeholder with the final signature; issue 3 completes it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig, DeviceInfo
from kvllm.attention.names import AttentionBackendEnum
from kvllm.attention.registry import get_backend_class


@dataclass(frozen=True)
class BackendChoice:
    backend: type[AttentionBackend]
    block_size: int


def choose_attention_backend(
    config: AttentionSelectorConfig, device: DeviceInfo, requested: AttentionBackendEnum | None = None
) -> BackendChoice:
    name = requested.name if requested is not None else "CPU_ATTN"
    backend = get_backend_class(name)
    reasons = backend.validate_configuration(config, device)
    if reasons:
        raise ValueError(f"Selected backend {name} is not valid for this configuration. Reason: {reasons}")
    return BackendChoice(backend, config.block_size or backend.preferred_block_size)
