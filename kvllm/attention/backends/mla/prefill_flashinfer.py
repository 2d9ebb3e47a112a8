"""FLASHINFER MLA prefill: FlashInfer's BatchPrefillWithRaggedKVCacheWrapper over up-projected K/V.

Queries [Tp, H, qk_nope + rope] (192 for DeepSeek) against keys of the same width and values of
v_head_dim (128), ragged by request; causal with FlashInfer's bottom-right alignment (a request's
queries are its last tokens). Planned once per step, by the first layer.
"""

from __future__ import annotations

import torch

from kvllm.attention.backends.flashinfer_impl import WORKSPACE_BYTES, import_flashinfer
from kvllm.attention.backends.mla.common_impl import MLAPrefillImpl, MLAPrefillMetadata


class FlashInferMLAPrefill(MLAPrefillImpl):
    """One wrapper and workspace for all layers (their runs are serialized on one stream)."""

    def __init__(self) -> None:
        self.wrapper = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: MLAPrefillMetadata, scale: float
    ) -> torch.Tensor:
        if self.wrapper is None:
            flashinfer = import_flashinfer()
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self.wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        if not md.backend_state.get("flashinfer_planned"):
            num_heads = q.shape[1]
            self.wrapper.plan(  # host indptrs: FlashInfer plans on the host
                torch.tensor(md.query_start_loc_cpu, dtype=torch.int32),
                torch.tensor(md.kv_start_loc_cpu, dtype=torch.int32),
                num_heads,
                num_heads,
                q.shape[-1],
                head_dim_vo=v.shape[-1],
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=k.dtype,
            )
            md.backend_state["flashinfer_planned"] = True
        return self.wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())
