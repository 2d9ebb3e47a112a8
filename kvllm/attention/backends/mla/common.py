"""Declarations shared by the MLA decode backends (pure Python: no torch, no kernel library)."""

from __future__ import annotations

from typing import ClassVar

from kvllm.attention.backend import AttentionBackend, AttentionSelectorConfig
from kvllm.platforms.interface import DeviceInfo

# DeepSeek-V2/V3's latent width: kv_lora_rank 512 + qk_rope_head_dim 64.
DEEPSEEK_LATENT_SIZE = 576


class MLABackend(AttentionBackend):
    """Base of the MLA decode backends: the latent cache layout and MLA's validation.

    `head_size` in the selector config is the latent width, kv_lora_rank + qk_rope_head_dim.
    The cache holds one plane per layer (no separate K and V) and is read by both decode (as
    keys over the whole width and values over the first kv_lora_rank entries) and prefill (up-
    projected to full keys and values).
    """

    is_mla: ClassVar[bool] = True
    kv_cache_layout: ClassVar[str] = "latent"
    # False for a backend that is declared (so selection can explain it) but has no kernel binding.
    implemented: ClassVar[bool] = True

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """(num_blocks, block_size, latent width): one plane, no K/V axis. num_kv_heads is 1 for MLA."""
        if num_kv_heads != 1:
            raise ValueError(f"an MLA latent cache has one KV head, got num_kv_heads={num_kv_heads}")
        return (num_blocks, block_size, head_size)

    @classmethod
    def extra_reasons(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> list[str]:
        reasons = list(super().extra_reasons(config, device))
        if not cls.implemented and cls.missing_package_reason() is None:
            # The package is there, but kvllm does not call it: say so rather than crash later.
            reasons.append(
                f"{cls.name} has no kernel binding in this build of kvllm "
                f"(package {cls.required_package} is installed but not used)"
            )
        return reasons
