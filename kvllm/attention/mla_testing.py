"""The harness for MLA backends: a random mixed batch over a latent paged cache, run through a backend's
builder and implementation, against the float32 reference of MLA without weight absorption.

The reference up-projects every latent with kv_b_proj to per-head keys (nope + rope) and values and
runs causal softmax attention, which is what HF transformers computes; the backend decodes in the
latent space (absorbed) and prefills by up-projection, so both paths are checked against the math
they must equal. Used by the declared-equals-implemented walk, the GPU tests and the MLA benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.backends.mla.common_impl import MLAAttentionImpl, MLAPrefillImpl
from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.reference import PagedBatch, make_paged_batch
from kvllm.attention.testing import ScaledLayer, dequantized, stored
from kvllm.utils.dtypes import kv_cache_torch_dtype


@dataclass(frozen=True)
class MLADims:
    num_heads: int = 4
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 8
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


DEEPSEEK_V2_LITE = MLADims(
    num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)


@dataclass
class MLACase:
    """A backend bound to one batch: cache filled with the context, builder, impl and step inputs."""

    backend: type[AttentionBackend]
    dims: MLADims
    batch: PagedBatch  # keys = the latents [seq_len, 1, L + R] of each request
    kv_cache: torch.Tensor
    builder: Any
    impl: MLAAttentionImpl
    layer: ScaledLayer
    q: torch.Tensor  # [T, H, P + R]
    kv_c: torch.Tensor  # [T, L]
    k_pe: torch.Tensor  # [T, R]
    kv_b_weight: torch.Tensor  # [H * (P + V), L]
    metadata: Any = None

    def first_layer(self) -> torch.Tensor:
        self.metadata = self.builder.build(self.batch.metadata)
        return self.forward()

    def forward(self) -> torch.Tensor:
        return self.impl.forward(
            self.layer, self.q, self.kv_c, self.k_pe, self.kv_cache, self.metadata, self.kv_b_weight
        )


def prepare_mla_case(
    backend: type[AttentionBackend],
    query_lens: list[int],
    context_lens: list[int],
    dims: MLADims,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    prefill_impl: MLAPrefillImpl | None = None,
    builder_limits: tuple[int, int, int] | None = None,
) -> MLACase:
    batch = make_paged_batch(
        query_lens, context_lens, dims.num_heads, 1, dims.latent, block_size, dtype, device, seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    P, R, V, L, H = (
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
        dims.kv_lora_rank,
        dims.num_heads,
    )
    num_tokens = batch.query.shape[0]
    q = torch.randn(num_tokens, H, P + R, generator=gen).to(dtype).to(device)
    kv_b_weight = (torch.randn(H * (P + V), L, generator=gen) * L**-0.5).to(dtype).to(device)
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    kv_cache = torch.zeros(
        backend.get_kv_cache_shape(batch.num_blocks, block_size, 1, dims.latent),
        dtype=cache_dtype,
        device=device,
    )
    for blocks, offsets, latent, _ in batch.cached_context():
        kv_cache[blocks, offsets] = stored(latent[:, 0], cache_dtype, k_scale)
    if prefill_impl is None:
        from kvllm.attention.backends.mla.prefill_impl import TorchSDPAPrefill

        prefill_impl = TorchSDPAPrefill()
    impl = backend.get_impl_cls()(
        num_heads=H, scale=dims.scale, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R,
        v_head_dim=V, kv_cache_dtype=kv_cache_dtype, prefill_impl=prefill_impl,
    )  # fmt: skip
    md = batch.metadata
    spec = KVCacheSpec(block_size, 1, dims.latent, cache_dtype, kv_cache_dtype, use_mla=True)
    limits = builder_limits or (md.num_reqs, md.num_actual_tokens, md.max_seq_len + block_size)
    builder = backend.get_builder_cls()(backend, spec, torch.device(device), *limits)
    new = batch.new_keys[:, 0]
    return MLACase(
        backend=backend,
        dims=dims,
        batch=batch,
        kv_cache=kv_cache,
        builder=builder,
        impl=impl,
        layer=ScaledLayer.of(k_scale, 1.0, torch.device(device)),
        q=q,
        kv_c=new[:, :L].contiguous(),
        k_pe=new[:, L:].contiguous(),
        kv_b_weight=kv_b_weight,
    )


def mla_reference(case: MLACase) -> torch.Tensor:
    """float32 [T, H * V]: up-projected causal attention over each request's latents as the cache holds them."""
    d, batch = case.dims, case.batch
    P, V, L, H = d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank, d.num_heads
    scale_k = float(case.layer.k_scale)
    w = case.kv_b_weight.float()
    out, start = [], 0
    for latent, qlen in zip(batch.keys, batch.query_lens):
        lat = dequantized(latent[:, 0], case.kv_cache.dtype, scale_k)  # [S, L + R]
        kv = (lat[:, :L] @ w.T).view(-1, H, P + V)
        k = torch.cat([kv[..., :P], lat[:, None, L:].expand(-1, H, -1)], dim=-1)
        v = kv[..., P:]
        q = case.q[start : start + qlen].float()
        s = lat.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * d.scale
        allowed = (
            torch.arange(s, device=q.device)[None, :] <= torch.arange(s - qlen, s, device=q.device)[:, None]
        )
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v).reshape(qlen, H * V))
        start += qlen
    return torch.cat(out)
