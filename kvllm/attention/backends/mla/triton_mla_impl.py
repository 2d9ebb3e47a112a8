"""TRITON_MLA implementation: the Triton latent decode kernel behind the shared MLA code."""

from __future__ import annotations

import functools

import torch

from kvllm.attention.backends.mla.common_impl import MLAAttentionImpl, MLADecodeMetadata, MLALayer
from kvllm.attention.ops.triton_mla_decode import mla_decode
from kvllm.attention.ops.triton_unified_attention import is_interpreter

MIN_SPLIT_TOKENS = 256  # a KV segment shorter than this costs more in the merge than it saves
MAX_SPLITS = 16


def num_splits_for(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """KV segments per request: split only when too few (request, head-block) programs fill the GPU."""
    if num_programs >= 2 * num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // max(num_programs, 1))
    by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter runs: any fixed value keeps the plan deterministic
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonMLAImpl(MLAAttentionImpl):
    """Decode with `kvllm.attention.ops.triton_mla_decode`; `num_splits` overrides the split heuristic."""

    num_splits: int | None = None
    block_h = 16
    # The interpreter's cost is per op, not per element: wide tiles keep CI's interpreted runs short.
    block_n = 64 if is_interpreter() else 16

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: MLADecodeMetadata, layer: MLALayer
    ) -> torch.Tensor:
        if self.num_splits is not None:
            splits = self.num_splits
        else:
            num_sms = _num_sms(q.device)
            programs = md.num_decodes * -(-self.num_heads // self.block_h)
            splits = num_splits_for(programs, md.max_seq_len, num_sms)
        return mla_decode(
            q.contiguous(),
            kv_cache,
            md.block_table,
            md.seq_lens,
            self.kv_lora_rank,
            self.scale,
            k_scale=layer.k_scale,
            num_splits=splits,
            block_h=self.block_h,
            block_n=self.block_n,
        )
