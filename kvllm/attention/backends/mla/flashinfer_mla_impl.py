"""FLASHINFER_MLA implementation: FlashInfer's BatchMLAPagedAttentionWrapper for the decode part.

The wrapper reads the latent and rotary parts as two caches; kvllm's one-plane cache gives them as
strided views ([..., :kv_lora_rank] and [..., kv_lora_rank:]), so nothing is copied. It is planned
once per step, by the first layer that decodes (every layer has the same heads, scale and dtypes).
FlashInfer's "fa2" MLA template is used: it runs from SM 8.0 on, which is what the backend declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvllm.attention.backends.flashinfer_impl import WORKSPACE_BYTES, import_flashinfer
from kvllm.attention.backends.mla.common_impl import (
    MLAAttentionImpl,
    MLADecodeMetadata,
    MLALayer,
    MLAMetadataBuilder,
)


@dataclass
class FlashInferMLADecodeState:
    wrapper: Any
    qo_indptr: torch.Tensor  # int32 [B + 1] on the host: one query per request
    kv_indptr: torch.Tensor  # int32 [B + 1] on the host: page offsets into kv_indices
    kv_indices: torch.Tensor  # int32 [sum pages] on the device: the requests' pages, in order
    planned: bool = False


class FlashInferMLAMetadataBuilder(MLAMetadataBuilder):
    """Owns the decode wrapper and its workspace; turns block tables into FlashInfer's page lists."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        flashinfer = import_flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="fa2")

    def build_decode_extra(self, decode: MLADecodeMetadata) -> FlashInferMLADecodeState:
        block_size = self.kv_cache_spec.block_size
        pages = (decode.seq_lens_cpu.long() + block_size - 1) // block_size
        kv_indptr = torch.zeros(decode.num_decodes + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        width = int(pages.max())
        used = torch.arange(width)[None, :] < pages[:, None]
        kv_indices = decode.block_table[:, :width][used.to(decode.block_table.device)]
        # FlashInfer plans on the host: host indptrs and lengths cost no device-to-host copy.
        return FlashInferMLADecodeState(
            wrapper=self.wrapper,
            qo_indptr=torch.arange(decode.num_decodes + 1, dtype=torch.int32),
            kv_indptr=kv_indptr,
            kv_indices=kv_indices.to(torch.int32),
        )


class FlashInferMLAImpl(MLAAttentionImpl):
    """Latent-space decode by FlashInfer (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.fp8_dtype is not None:
            raise NotImplementedError("FLASHINFER_MLA does not declare an fp8 latent cache")

    def forward_decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: MLADecodeMetadata, layer: MLALayer
    ) -> torch.Tensor:
        state: FlashInferMLADecodeState = md.extra
        L, R = self.kv_lora_rank, self.qk_rope_head_dim
        if not state.planned:
            state.wrapper.plan(
                state.qo_indptr,
                state.kv_indptr,
                state.kv_indices,
                md.seq_lens_cpu,
                self.num_heads,
                L,
                R,
                kv_cache.shape[1],
                False,  # one query per request: nothing to mask
                self.scale,
                q.dtype,
                kv_cache.dtype,
            )
            state.planned = True
        q_nope, q_pe = q[..., :L].contiguous(), q[..., L:].contiguous()
        return state.wrapper.run(q_nope, q_pe, kv_cache[..., :L], kv_cache[..., L:])
