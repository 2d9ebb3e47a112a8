"""FLASHINFER kernel side: paged-KV index arrays, per-step planning, per-layer runs.

Each step the batch is split into its decode part (the first `num_decodes` requests, one token
each) and its prefill part (the rest). The builder turns block tables into FlashInfer's CSR page
lists (indptr / indices / last_page_len) with vectorized host ops plus one device gather, and
plans each wrapper once per step; every layer then only calls run().

A plan depends on per-layer hyperparameters (query heads, scale, window, soft-cap) that the
builder's constructor does not receive, so the first step plans when the first layer runs and
remembers those parameters; from then on build() plans eagerly for every parameter set seen.

Nothing in this module imports flashinfer at import time: the host-side index construction is
usable (and tested) on a machine without it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvllm.attention.impl import AttentionImpl, AttentionLayer, AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.attention.ops.paged_cache_write import write_kv_to_paged_cache
from kvllm.utils.dtypes import FP8_DTYPES

if TYPE_CHECKING:
    from types import ModuleType


logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024
# Decode through the tensor-core (prefill) kernels once this many query heads share a KV head.
TENSOR_CORE_DECODE_MIN_GQA = 4


# ---- host-side page lists (no flashinfer needed) ------------------------------------------------


@dataclass
class PagedKVHostArrays:
    """FlashInfer's CSR description of which pages each request reads, built on the host."""

    indptr: torch.Tensor  # int32 [num_reqs + 1]: request r's pages are indices[indptr[r]:indptr[r+1]]
    last_page_len: torch.Tensor  # int32 [num_reqs], in 1..block_size
    gather_index: torch.Tensor  # int64 [indptr[-1]]: flat position in the block table of each page


def paged_kv_host_arrays(
    seq_lens_cpu: torch.Tensor, block_size: int, max_blocks_per_req: int
) -> PagedKVHostArrays:
    """indptr, last_page_len and block-table gather positions for requests of the given lengths."""
    seq_lens = seq_lens_cpu.to(torch.int64)
    num_pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), num_pages.cumsum(0)])
    total = int(indptr[-1])
    rows = torch.repeat_interleave(torch.arange(seq_lens.numel()), num_pages, output_size=total)
    cols = torch.arange(total) - indptr[:-1].repeat_interleave(num_pages, output_size=total)
    return PagedKVHostArrays(
        indptr=indptr.to(torch.int32),
        last_page_len=((seq_lens - 1) % block_size + 1).to(torch.int32),
        gather_index=rows * max_blocks_per_req + cols,
    )


def paged_kv_indices(block_table: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """The page ids each request reads, concatenated: int32 [indptr[-1]] on block_table's device."""
    index = gather_index.to(block_table.device, non_blocking=True)
    return block_table.reshape(-1)[index].to(torch.int32)


# ---- importing flashinfer ---------------------------------------------------------------------------


def flashinfer_workspace_base() -> Path:
    """Where FlashInfer keeps compiled kernels; defaults under the user's cache dir so they persist."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE")
    if not base:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache_home, "kvllm", "flashinfer")
        os.environ["FLASHINFER_WORKSPACE_BASE"] = base
    return Path(base)


def import_flashinfer() -> ModuleType:
    """Import flashinfer with its kernel cache set up; a missing package is a clear error."""
    import sys

    if sys.modules.get("flashinfer") is not None:
        return sys.modules["flashinfer"]
    # FlashInfer reads FLASHINFER_WORKSPACE_BASE once, when it is first imported.
    jit_dir = flashinfer_workspace_base() / ".cache" / "flashinfer"
    if not jit_dir.is_dir() or not any(p.is_file() for p in jit_dir.rglob("*")):
        logger.info(
            "FlashInfer is compiling kernels for first use; this can take a few minutes (cache: %s)", jit_dir
        )
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(
            f"FLASHINFER needs the flashinfer package: pip install 'kvllm[flashinfer]'. Import failed with: {exc}"
        ) from exc
    return flashinfer


# ---- per-step metadata and planning ----------------------------------------------------------------


@dataclass(frozen=True)
class FlashInferPlanParams:
    """Per-layer hyperparameters a FlashInfer plan is specific to."""

    num_qo_heads: int
    sm_scale: float
    window_left: int  # -1 = no window
    logits_soft_cap: float | None
    q_dtype: torch.dtype


@dataclass
class _Wrappers:
    decode: Any
    prefill: Any


@dataclass
class FlashInferMetadata:
    """One step: the decode part and the prefill part of the batch, as FlashInfer page lists."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]; -1 = do not write
    decode_indptr: torch.Tensor  # host int32 [num_decodes + 1]
    decode_last_page_len: torch.Tensor  # host int32 [num_decodes]
    prefill_qo_indptr: torch.Tensor  # host int32 [num_prefills + 1]
    prefill_indptr: torch.Tensor  # host int32 [num_prefills + 1]
    prefill_last_page_len: torch.Tensor  # host int32 [num_prefills]
    decode_indices: torch.Tensor  # device int32
    prefill_indices: torch.Tensor  # device int32
    builder: FlashInferMetadataBuilder
    planned: dict[FlashInferPlanParams, _Wrappers] = field(default_factory=dict)
    graph_size: int | None = None  # a CUDA-graph batch: planned on that size's graph wrappers

    def wrappers(self, params: FlashInferPlanParams) -> _Wrappers:
        """The wrappers planned for this step and these layer parameters (planning them at most once)."""
        wrappers = self.planned.get(params)
        if wrappers is None:
            wrappers = self.builder.plan(self, params)
            self.planned[params] = wrappers
        return wrappers


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Builds the page lists of a step and plans FlashInfer's wrappers for it.

    One 128 MiB float workspace is shared by all wrappers (their runs are serialized on one
    stream); each wrapper keeps its own plan state.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flashinfer = import_flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[FlashInferPlanParams, _Wrappers] = {}
        # CUDA graphs: one decode wrapper per (layer parameters, batch size), over fixed buffers
        # shared by all sizes (one graph runs at a time and is re-planned before it replays).
        self._graph_wrappers: dict[tuple[FlashInferPlanParams, int], Any] = {}
        max_pages = self.max_num_reqs * -(-self.max_model_len // self.kv_cache_spec.block_size)
        self._graph_indptr = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(
            max(max_pages, self.max_num_reqs), dtype=torch.int32, device=self.device
        )
        self._graph_last_page_len = torch.ones(self.max_num_reqs, dtype=torch.int32, device=self.device)

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        return self._build(common, graph_size=None)

    def prepare_for_capture(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        return self._build(common, graph_size=self._graph_size_of(common))

    def prepare_for_replay(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan the size's graph wrappers for this batch (host work and a copy into their buffers)."""
        return self._build(common, graph_size=self._graph_size_of(common))

    def _graph_size_of(self, common: CommonAttentionMetadata) -> int:
        if common.max_query_len > 1 or common.num_decodes != common.num_reqs:
            raise ValueError("FLASHINFER captures uniform single-token decode batches only")
        return common.num_reqs

    def _build(self, common: CommonAttentionMetadata, graph_size: int | None) -> FlashInferMetadata:
        num_decodes = common.num_decodes
        if common.num_decode_tokens != num_decodes:
            raise ValueError(
                f"FLASHINFER: decode requests must have one query token each "
                f"(num_decodes={num_decodes}, num_decode_tokens={common.num_decode_tokens})"
            )
        block_table = common.block_table
        seq_lens_cpu = common.seq_lens_cpu
        if graph_size is not None:
            # A graph's batch size is fixed, so padded requests (length 0) must be planned too:
            # each reads one token of the first page of its (arbitrary) block-table row.
            seq_lens_cpu = seq_lens_cpu.clamp(min=1)
        host = paged_kv_host_arrays(seq_lens_cpu, self.kv_cache_spec.block_size, block_table.shape[1])
        indices = paged_kv_indices(block_table, host.gather_index)
        split = int(host.indptr[num_decodes])
        qsl = common.query_start_loc_cpu.to(torch.int32)
        metadata = FlashInferMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=common.num_decode_tokens,
            num_prefills=common.num_prefills,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            decode_indptr=host.indptr[: num_decodes + 1],
            decode_last_page_len=host.last_page_len[:num_decodes],
            prefill_qo_indptr=qsl[num_decodes:] - qsl[num_decodes],
            prefill_indptr=host.indptr[num_decodes:] - split,
            prefill_last_page_len=host.last_page_len[num_decodes:],
            decode_indices=indices[:split],
            prefill_indices=indices[split:],
            builder=self,
            graph_size=graph_size,
        )
        for params in self._wrappers:
            metadata.wrappers(params)
        return metadata

    def plan(self, metadata: FlashInferMetadata, params: FlashInferPlanParams) -> _Wrappers:
        """Plan this step's decode and prefill wrappers for one set of layer parameters."""
        wrappers = self._wrappers.get(params)
        if wrappers is None:
            wrappers = self._new_wrappers(params)
            self._wrappers[params] = wrappers
        spec = self.kv_cache_spec
        common_args = dict(
            num_qo_heads=params.num_qo_heads,
            num_kv_heads=spec.num_kv_heads,
            page_size=spec.block_size,
            window_left=params.window_left,
            logits_soft_cap=params.logits_soft_cap,
            q_data_type=params.q_dtype,
            kv_data_type=spec.dtype,
            sm_scale=params.sm_scale,
        )
        if metadata.graph_size is not None:
            wrappers = _Wrappers(decode=self._graph_wrapper(params, metadata.graph_size), prefill=None)
        if metadata.num_decodes:
            wrappers.decode.plan(
                metadata.decode_indptr,
                metadata.decode_indices,
                metadata.decode_last_page_len,
                head_dim=spec.head_size,
                **common_args,
            )
        if metadata.num_prefills:
            wrappers.prefill.plan(
                metadata.prefill_qo_indptr,
                metadata.prefill_indptr,
                metadata.prefill_indices,
                metadata.prefill_last_page_len,
                head_dim_qk=spec.head_size,
                causal=True,
                **common_args,
            )
        return wrappers

    def _graph_wrapper(self, params: FlashInferPlanParams, size: int) -> Any:
        wrapper = self._graph_wrappers.get((params, size))
        if wrapper is None:
            gqa = params.num_qo_heads // self.kv_cache_spec.num_kv_heads
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=gqa >= TENSOR_CORE_DECODE_MIN_GQA,
                paged_kv_indptr_buffer=self._graph_indptr[: size + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:size],
            )
            self._graph_wrappers[(params, size)] = wrapper
        return wrapper

    def _new_wrappers(self, params: FlashInferPlanParams) -> _Wrappers:
        fi = self._flashinfer
        gqa = params.num_qo_heads // self.kv_cache_spec.num_kv_heads
        # FlashInfer's FA3 prefill kernels (chosen automatically on SM 9.0) want q and KV of one dtype.
        prefill_backend = "fa2" if self.kv_cache_spec.dtype in FP8_DTYPES else "auto"
        return _Wrappers(
            decode=fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=gqa >= TENSOR_CORE_DECODE_MIN_GQA
            ),
            prefill=fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend),
        )


# ---- per-layer implementation ------------------------------------------------------------------------


def write_to_paged_cache(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; -1 = skip
    k_scale: torch.Tensor | None = None,  # fp8 caches store K / k_scale
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V at its slot (block * block_size + offset), skipping slot -1."""
    write_kv_to_paged_cache(kv_cache[:, 0], kv_cache[:, 1], key, value, slot_mapping, k_scale, v_scale)


class FlashInferImpl(AttentionImpl):
    """One layer's attention through FlashInfer: cache write, decode run, prefill run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sinks is not None:
            raise ValueError("FLASHINFER: attention sinks not supported (they need the TRT-LLM kernels)")
        if self.attn_type != "decoder":
            raise ValueError(
                f"FLASHINFER: attention type {self.attn_type} not supported (supported: decoder)"
            )
        # Our window w admits keys k with p - w < k; FlashInfer's window_left admits p - k <= window_left.
        self.window_left = self.sliding_window - 1 if self.sliding_window else -1
        self._is_fp8 = self.kv_cache_dtype.startswith("fp8")
        self._scales: tuple[float, float] | None = None

    def kv_cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[:, 0], kv_cache[:, 1]

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        meta = attn_metadata
        num_tokens, num_decode_tokens = meta.num_actual_tokens, meta.num_decode_tokens
        # q arrives as a strided view of the fused qkv buffer; FlashInfer's support for that was not
        # run on a GPU yet, so it gets a contiguous copy (one small kernel beside the library's).
        query = query.contiguous()
        k_scale = layer.k_scale if self._is_fp8 else None
        v_scale = layer.v_scale if self._is_fp8 else None
        if not kv_written:
            write_to_paged_cache(
                kv_cache, key[:num_tokens], value[:num_tokens], meta.slot_mapping, k_scale, v_scale
            )
        if self._is_fp8 and self._scales is None:
            # Scales are fixed once weights are loaded; read them to the host once, not every step.
            self._scales = (float(layer.k_scale), float(layer.v_scale))
        run_scales = {"k_scale": self._scales[0], "v_scale": self._scales[1]} if self._scales else {}
        wrappers = meta.wrappers(
            FlashInferPlanParams(
                num_qo_heads=self.num_heads,
                sm_scale=self.scale,
                window_left=self.window_left,
                logits_soft_cap=self.logits_soft_cap or None,
                q_dtype=query.dtype,
            )
        )
        output = torch.empty_like(query) if num_tokens == query.shape[0] else torch.zeros_like(query)
        if meta.num_decodes:
            wrappers.decode.run(
                query[:num_decode_tokens], kv_cache, out=output[:num_decode_tokens], **run_scales
            )
        if meta.num_prefills:
            wrappers.prefill.run(
                query[num_decode_tokens:num_tokens],
                kv_cache,
                out=output[num_decode_tokens:num_tokens],
                **run_scales,
            )
        return output
