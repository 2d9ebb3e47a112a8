"""The torch side shared by every MLA backend: per-step metadata and the per-layer MLA computation.

Per layer and step (as vLLM's MLA common code does):
1. the new tokens' latent (normalised kv_c, then rotated k_pe) is written at the slot mapping;
   an fp8 cache stores latent / k_scale;
2. decode requests (the first `num_decodes`, one query each) attend in the latent space: W_UK is
   folded into the query (q_nope @ W_UK -> kv_lora_rank wide), the decode kernel attends over the
   whole latent (keys) and its first kv_lora_rank entries (values), and W_UV maps the result to
   v_head_dim per head;
3. prefill requests read their whole sequence back from the cache, up-project it with kv_b_proj to
   per-head keys (nope + rope) and values, and run the prefill backend's causal attention.
Both parts use the same softmax scale (the model's, YaRN mscale included).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvllm.attention.impl import AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.utils.dtypes import FP8_DTYPES, FP8_TORCH_DTYPES


class MLALayer(Protocol):
    """What an MLA implementation reads from its layer (kvllm.layers.mla_attention.MLAAttention)."""

    k_scale: torch.Tensor  # float32 scalar: an fp8 latent cache stores latent / k_scale


@dataclass
class MLADecodeMetadata:
    """The decode part of a step: requests [0, num_decodes), one query token each."""

    num_decodes: int
    block_table: torch.Tensor  # int32 [num_decodes, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_decodes], device
    seq_lens_cpu: torch.Tensor  # int32 [num_decodes]
    max_seq_len: int
    extra: Any = None  # what a decode backend's builder adds (e.g. a planned FlashInfer wrapper)


@dataclass
class MLAPrefillMetadata:
    """The prefill part of a step: requests [num_decodes, num_reqs), tokens [token_start, num_actual_tokens)."""

    token_start: int
    query_start_loc_cpu: list[int]  # per prefill request, relative to token_start, + total
    seq_lens_cpu: list[int]
    kv_slots: torch.Tensor  # int64 [sum(seq_lens)]: flat cache slot of every key, request after request
    kv_start_loc_cpu: list[int]  # offsets into kv_slots per request, + total
    query_start_loc: torch.Tensor  # int32 device copy of query_start_loc_cpu
    kv_start_loc: torch.Tensor  # int32 device copy of kv_start_loc_cpu
    # Per-step state a prefill kernel keeps across layers (e.g. "planned"); fresh every step.
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prefills(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class MLAMetadata:
    num_actual_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding, not written
    decode: MLADecodeMetadata | None
    prefill: MLAPrefillMetadata | None


@dataclass
class _GraphBuffers:
    """The decode metadata CUDA graphs read, at fixed addresses (allocated on first capture)."""

    seq_lens: torch.Tensor  # int32 [max_num_reqs]
    block_table: torch.Tensor  # int32 [max_num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [max_num_reqs]

    @classmethod
    def allocate(cls, max_num_reqs: int, max_blocks: int, device: torch.device) -> _GraphBuffers:
        return cls(
            torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
            torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32, device=device),
            torch.full((max_num_reqs,), -1, dtype=torch.int64, device=device),
        )


class MLAMetadataBuilder(AttentionMetadataBuilder):
    """Splits a step into its decode and prefill parts (decodes come first in the batch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graph: _GraphBuffers | None = None

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        if not common.causal:
            raise NotImplementedError("MLA attention is causal only")
        if common.num_decodes and common.decode_query_len != 1:
            raise NotImplementedError("MLA decode takes one query token per request")
        nd = common.num_decodes
        decode = None
        if nd:
            decode = MLADecodeMetadata(
                num_decodes=nd,
                block_table=common.block_table[:nd],
                seq_lens=common.seq_lens[:nd],
                seq_lens_cpu=common.seq_lens_cpu[:nd],
                max_seq_len=int(common.seq_lens_cpu[:nd].max()),
            )
            decode.extra = self.build_decode_extra(decode)
        prefill = self._build_prefill(common) if common.num_reqs > nd else None
        return MLAMetadata(
            common.num_actual_tokens, common.num_decode_tokens, common.slot_mapping, decode, prefill
        )

    def build_decode_extra(self, decode: MLADecodeMetadata) -> Any:
        """Backend-specific decode state (override); None by default."""
        return None

    # ---- CUDA graphs (backends declaring cudagraph_support="decode_only") -----------------------
    # A graph reads its metadata from buffers at fixed addresses, and every launch decision in it
    # depends on the padded batch size only: max_seq_len is max_model_len, never the step's.
    # Padded requests have sequence length 0 and slot -1 (no write, zero attention output).

    def prepare_for_capture(self, common: CommonAttentionMetadata) -> MLAMetadata:
        return self._build_static(common)

    def prepare_for_replay(self, common: CommonAttentionMetadata) -> MLAMetadata:
        return self._build_static(common)

    def build_graph_decode_extra(self, decode: MLADecodeMetadata) -> Any:
        """Backend-specific decode state of a graph step (override); None by default."""
        return None

    def _build_static(self, common: CommonAttentionMetadata) -> MLAMetadata:
        n, num_tokens = common.num_reqs, common.num_actual_tokens
        if common.max_query_len > 1 or num_tokens != n or not common.causal:
            raise ValueError(
                f"an MLA graph step is a uniform decode batch (one token per request), got {n} requests, "
                f"{num_tokens} tokens, max query length {common.max_query_len}"
            )
        if n > self.max_num_reqs:
            raise ValueError(f"graph batch of {n} requests exceeds max_num_reqs={self.max_num_reqs}")
        if self._graph is None:
            max_blocks = -(-self.max_model_len // self.kv_cache_spec.block_size)
            self._graph = _GraphBuffers.allocate(self.max_num_reqs, max_blocks, torch.device(self.device))
        buffers = self._graph
        cols = common.block_table.shape[1]
        if cols > buffers.block_table.shape[1]:
            raise ValueError(f"block table has {cols} columns, more than max_model_len allows")
        buffers.seq_lens[:n].copy_(common.seq_lens[:n], non_blocking=True)
        buffers.block_table[:n, :cols].copy_(common.block_table[:n], non_blocking=True)
        buffers.slot_mapping[:n].copy_(common.slot_mapping[:n], non_blocking=True)
        decode = MLADecodeMetadata(
            num_decodes=n,
            block_table=buffers.block_table[:n],
            seq_lens=buffers.seq_lens[:n],
            seq_lens_cpu=common.seq_lens_cpu[:n],
            max_seq_len=self.max_model_len,
        )
        decode.extra = self.build_graph_decode_extra(decode)
        return MLAMetadata(n, n, buffers.slot_mapping[:n], decode, None)

    def _build_prefill(self, common: CommonAttentionMetadata) -> MLAPrefillMetadata:
        """Every key's cache slot from host-side (request, position) arrays and one device gather of the
        block table: no device-to-host copy, so the step does not wait for the previous one."""
        nd, block_size = common.num_decodes, self.kv_cache_spec.block_size
        qsl = common.query_start_loc_cpu[nd:].long()
        token_start = int(qsl[0])
        seq_lens = common.seq_lens_cpu[nd : common.num_reqs].long()
        kv_start = torch.zeros(seq_lens.numel() + 1, dtype=torch.long)
        torch.cumsum(seq_lens, 0, out=kv_start[1:])
        total = int(kv_start[-1])
        req = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens, output_size=total)
        pos = torch.arange(total) - kv_start[req]
        device = common.slot_mapping.device
        table = common.block_table.reshape(-1)
        cols = common.block_table.shape[1]
        index = ((req + nd) * cols + pos // block_size).to(device, non_blocking=True)
        pos_dev = pos.to(device, non_blocking=True)
        kv_slots = table[index].long() * block_size + pos_dev % block_size
        q_start = (qsl - token_start).tolist()
        kv_start_list = kv_start.tolist()
        return MLAPrefillMetadata(
            token_start=token_start,
            query_start_loc_cpu=q_start,
            seq_lens_cpu=seq_lens.tolist(),
            kv_slots=kv_slots,
            kv_start_loc_cpu=kv_start_list,
            query_start_loc=torch.tensor(q_start, dtype=torch.int32).to(device, non_blocking=True),
            kv_start_loc=kv_start.to(torch.int32).to(device, non_blocking=True),
        )


class MLAPrefillImpl(ABC):
    """A prefill kernel: causal attention of each prefill request's queries over its up-projected sequence."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [Tp, H, qk_head_dim]
        k: torch.Tensor,  # [S, H, qk_head_dim]: every prefill request's whole sequence, one after another
        v: torch.Tensor,  # [S, H, v_head_dim]
        md: MLAPrefillMetadata,
        scale: float,
    ) -> torch.Tensor:  # [Tp, H, v_head_dim]
        """Query i of request r (of n_r) sits at position seq_len_r - n_r + i and sees keys 0..that position."""


class MLAAttentionImpl(ABC):
    """Per-layer MLA: latent write, absorbed decode, up-projected prefill (see the module docstring).

    Subclasses implement `forward_decode`, the decode kernel over the latent paged cache.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_cache_dtype: str = "auto",
        prefill_impl: MLAPrefillImpl | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = FP8_TORCH_DTYPES.get(kv_cache_dtype)
        self.prefill_impl = prefill_impl  # None: decode-only use (a step with prefills is an error)

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,  # [B, H, kv_lora_rank + rope]: absorbed nope part, then the rotated rope part
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope]
        md: MLADecodeMetadata,
        layer: MLALayer,
    ) -> torch.Tensor:  # [B, H, kv_lora_rank], in q's dtype
        """Attend each decode query over its request's latent: scores over the whole width, values = the
        first kv_lora_rank entries, softmax scaled by self.scale; fp8 caches read back times k_scale."""

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        is_fp8 = kv_cache.dtype in FP8_DTYPES
        if (self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype) or (
            self.fp8_dtype is None and is_fp8
        ):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} does not match the latent cache dtype {kv_cache.dtype}"
            )
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(
                f"MLA latent cache must be [num_blocks, block_size, {width}], got {tuple(kv_cache.shape)}"
            )

    def write_latent(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        layer: MLALayer,
    ) -> None:
        """Store [kv_c_normed, k_pe] at the slots (slot -1 = padding, skipped); fp8: latent / k_scale."""
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)
        if kv_cache.is_cuda:
            # The Triton KV write skips slot -1 without a host sync; the latent goes in as both "K"
            # and "V" of a one-head cache view (the same rows, written twice with the same values).
            from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

            rows = latent.view(latent.shape[0], 1, -1)
            view = kv_cache.view(*kv_cache.shape[:2], 1, kv_cache.shape[-1])
            reshape_and_cache(
                rows, rows, view, view, slot_mapping, layer.k_scale, layer.k_scale, latent.shape[0]
            )
            return
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        valid = slot_mapping >= 0
        latent = latent[valid]
        if self.fp8_dtype is not None:
            latent = latent.float() / layer.k_scale
        flat[slot_mapping[valid]] = latent.to(kv_cache.dtype)

    def read_latent(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, layer: MLALayer
    ) -> torch.Tensor:
        """The latent rows at `slots` in `dtype` (fp8 rows multiplied back by k_scale)."""
        rows = kv_cache.view(-1, kv_cache.shape[-1])[slots]
        if self.fp8_dtype is not None:
            return (rows.float() * layer.k_scale).to(dtype)
        return rows.to(dtype)

    def forward(
        self,
        layer: MLALayer,
        q: torch.Tensor,  # [T, H, qk_nope + rope], rope part rotated
        kv_c_normed: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, rope], rotated
        kv_cache: torch.Tensor,
        attn_metadata: MLAMetadata,
        kv_b_weight: torch.Tensor,  # kv_b_proj.weight [H * (qk_nope + v), kv_lora_rank]
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        self._check_cache(kv_cache)
        md = attn_metadata
        self.write_latent(kv_c_normed, k_pe, kv_cache, md.slot_mapping, layer)
        num_tokens, H = q.shape[0], self.num_heads
        P, V = self.qk_nope_head_dim, self.v_head_dim
        w = kv_b_weight.view(H, P + V, self.kv_lora_rank)
        w_uk, w_uv = w[:, :P], w[:, P:]  # [H, P, L], [H, V, L]
        output = torch.empty(num_tokens, H, V, dtype=q.dtype, device=q.device)
        covered = 0  # decodes, then prefill tokens; anything after them (padding) is zeroed
        if md.decode is not None:
            nd = md.num_decode_tokens
            q_nope, q_pe = q[:nd].split([P, self.qk_rope_head_dim], dim=-1)
            ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, L]
            latent_out = self.forward_decode(torch.cat([ql_nope, q_pe], dim=-1), kv_cache, md.decode, layer)
            # Straight into the [B, H, V] rows (a head-major view: cuBLAS writes it with ldc = H * V).
            torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2), out=output[:nd].transpose(0, 1))
            covered = nd
        if md.prefill is not None:
            if self.prefill_impl is None:
                raise RuntimeError(
                    "this MLA layer has no prefill backend bound (see -ac.mla_prefill_backend)"
                )
            pf = md.prefill
            end = pf.token_start + pf.query_start_loc_cpu[-1]
            latent = self.read_latent(kv_cache, pf.kv_slots, q.dtype, layer)
            kv_c, k_pe_all = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv = torch.nn.functional.linear(kv_c, kv_b_weight).view(-1, H, P + V)
            k_nope, v = kv.split([P, V], dim=-1)
            k = torch.cat([k_nope, k_pe_all[:, None, :].expand(-1, H, -1)], dim=-1)
            output[pf.token_start : end] = self.prefill_impl.forward(
                q[pf.token_start : end], k, v.contiguous(), pf, self.scale
            )
            covered = end
        if covered < num_tokens:
            output[covered:].zero_()
        return output.view(num_tokens, H * V)
