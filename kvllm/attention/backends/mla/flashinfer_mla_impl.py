"""FLASHINFER_MLA implementation: FlashInfer's BatchMLAPagedAttentionWrapper for the decode part.

The wrapper reads the latent and rotary parts as two caches; kvllm's one-plane cache gives them as
strided views ([..., :kv_lora_rank] and [..., kv_lora_rank:]), so nothing is copied. It is planned
once per step, by the first layer that decodes (every layer has the same heads, scale and dtypes).
FlashInfer's "fa2" MLA template is used: it runs from SM 8.0 on, which is what the backend declares.

Page lists come from vectorized host arrays plus one device gather (no device-to-host sync).
CUDA graphs: one wrapper per captured batch size in FlashInfer's graph mode, over index buffers
shared by all sizes (one graph runs at a time). Its plan writes the work partition into the
wrapper's workspace at offsets that do not depend on the lengths, so the builder re-plans before
every replay (with the parameters the capture's first layer planned with) and the graph reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvllm.attention.backends.flashinfer_impl import (
    WORKSPACE_BYTES,
    import_flashinfer,
    paged_kv_host_arrays,
    paged_kv_indices,
)
from kvllm.attention.backends.mla.common_impl import (
    MLAAttentionImpl,
    MLADecodeMetadata,
    MLALayer,
    MLAMetadataBuilder,
)


@dataclass(frozen=True)
class MLAPlanParams:
    """What a plan depends on besides the batch: the layer's heads, dims, scale and dtypes."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@dataclass
class FlashInferMLADecodeState:
    wrapper: Any
    builder: FlashInferMLAMetadataBuilder
    qo_indptr: torch.Tensor  # int32 [B + 1] on the host: one query per request
    kv_indptr: torch.Tensor  # int32 [B + 1] on the host: page offsets into kv_indices
    kv_indices: torch.Tensor  # int32 [sum pages] on the device: the requests' pages, in order
    kv_lens: torch.Tensor  # int32 [B] on the host
    planned: bool = False

    def plan(self, params: MLAPlanParams) -> None:
        self.wrapper.plan(
            self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_lens, params.num_heads,
            params.kv_lora_rank, params.rope_dim, params.page_size,
            False,  # one query per request: nothing to mask
            params.scale, params.q_dtype, params.kv_dtype,
        )  # fmt: skip
        self.planned = True
        self.builder.plan_params = params


class FlashInferMLAMetadataBuilder(MLAMetadataBuilder):
    """Owns the decode wrappers and their workspace; turns block tables into FlashInfer's page lists."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flashinfer = import_flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = self._flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="fa2")
        self.plan_params: MLAPlanParams | None = None  # set by the first plan (a layer's parameters)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_index_buffers: tuple[torch.Tensor, ...] | None = None

    def _state(self, wrapper: Any, decode: MLADecodeMetadata) -> FlashInferMLADecodeState:
        host = paged_kv_host_arrays(
            decode.seq_lens_cpu, self.kv_cache_spec.block_size, decode.block_table.shape[1]
        )
        return FlashInferMLADecodeState(
            wrapper=wrapper,
            builder=self,
            qo_indptr=torch.arange(decode.num_decodes + 1, dtype=torch.int32),
            kv_indptr=host.indptr,
            kv_indices=paged_kv_indices(decode.block_table, host.gather_index),
            kv_lens=decode.seq_lens_cpu.to(torch.int32),
        )

    def build_decode_extra(self, decode: MLADecodeMetadata) -> FlashInferMLADecodeState:
        return self._state(self.wrapper, decode)

    def build_graph_decode_extra(self, decode: MLADecodeMetadata) -> FlashInferMLADecodeState:
        """The size's graph wrapper; planned here once a capture has told the layer parameters (replays),
        else by the capture's warm-up run (never inside the captured stream)."""
        state = self._state(self._graph_wrapper(decode.num_decodes), decode)
        if self.plan_params is not None:
            state.plan(self.plan_params)
        return state

    def _graph_wrapper(self, size: int) -> Any:
        wrapper = self._graph_wrappers.get(size)
        if wrapper is None:
            if self._graph_index_buffers is None:
                max_blocks = -(-self.max_model_len // self.kv_cache_spec.block_size)
                n, device = self.max_num_reqs, self.device
                self._graph_index_buffers = (
                    torch.zeros(n + 1, dtype=torch.int32, device=device),
                    torch.zeros(n + 1, dtype=torch.int32, device=device),
                    torch.zeros(n * max_blocks, dtype=torch.int32, device=device),
                    torch.zeros(n, dtype=torch.int32, device=device),
                )
            qo, kv, indices, lens = self._graph_index_buffers
            wrapper = self._flashinfer.mla.BatchMLAPagedAttentionWrapper(
                self.workspace, use_cuda_graph=True, qo_indptr=qo[: size + 1], kv_indptr=kv[: size + 1],
                kv_indices=indices, kv_len_arr=lens[:size], backend="fa2",
            )  # fmt: skip
            self._graph_wrappers[size] = wrapper
        return wrapper


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
            params = MLAPlanParams(
                self.num_heads, L, R, kv_cache.shape[1], self.scale, q.dtype, kv_cache.dtype
            )
            state.plan(params)
        q_nope, q_pe = q[..., :L].contiguous(), q[..., L:].contiguous()
        return state.wrapper.run(q_nope, q_pe, kv_cache[..., :L], kv_cache[..., L:])
