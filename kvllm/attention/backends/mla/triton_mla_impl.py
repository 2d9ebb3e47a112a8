"""TRITON_MLA implementation: the Triton latent decode kernel behind the shared MLA code."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvllm.attention.backends.mla.common_impl import MLAAttentionImpl, MLADecodeMetadata, MLALayer
from kvllm.attention.ops.triton_mla_decode import MLADecodeConfig, decode_config, mla_decode, num_splits_for
from kvllm.attention.ops.triton_unified_attention import is_interpreter


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any fixed value keeps the plan deterministic
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonMLAImpl(MLAAttentionImpl):
    """Decode with `kvllm.attention.ops.triton_mla_decode`.

    The segment count comes from the decode batch size and md.max_seq_len, which a CUDA-graph step
    sets to max_model_len, so a captured graph's launches never depend on the sequence lengths.
    `num_splits` and `config` override the heuristic and the config table (tests, tuning).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_splits: int | None = None
        self.config: MLADecodeConfig | None = None

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: MLADecodeMetadata, layer: MLALayer
    ) -> torch.Tensor:
        config = self.config or decode_config(self.num_heads, q.dtype, is_interpreter())
        splits = self.num_splits
        if splits is None:
            splits = num_splits_for(
                md.num_decodes, self.num_heads, config, md.max_seq_len, _num_sms(q.device)
            )
        return mla_decode(
            q.contiguous(),
            kv_cache,
            md.block_table,
            md.seq_lens,
            self.kv_lora_rank,
            self.scale,
            k_scale=layer.k_scale,
            num_splits=splits,
            config=config,
        )
