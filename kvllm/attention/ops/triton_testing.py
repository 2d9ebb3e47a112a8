"""Checks of the Triton attention kernels against the float32 reference (tests and benchmarks share them)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from kvllm.attention.metadata import KVCacheSpec
from kvllm.attention.reference import PagedBatch, make_paged_batch, reference_attention

FP8_TORCH_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def fp8_roundtrip(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What an fp8 cache gives back for x: (x / scale) rounded to fp8, times scale, in float32."""
    return (x.float() / scale).to(fp8_dtype).float() * scale


@dataclass
class AttentionCase:
    """One correctness case: a random paged batch, the kernels' output and the float32 reference."""

    batch: PagedBatch
    out: torch.Tensor  # [T, Hq, D], model dtype
    ref: torch.Tensor  # [T, Hq, D], float32
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hkv, D) after the step

    def rel_error(self) -> float:
        """Relative L2 error of the kernel output against the reference."""
        return ((self.out.float() - self.ref).norm() / self.ref.norm()).item()

    def max_abs_error(self) -> float:
        return (self.out.float() - self.ref).abs().max().item()


def run_attention_case(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    use_sinks: bool = False,
    num_splits: int | None = None,
    decode_config: object | None = None,
    prefill_config: object | None = None,
    seed: int = 0,
) -> AttentionCase:
    """Build a batch, run TRITON_ATTN's impl (KV write + attention) through its builder, and the reference.

    `num_splits` forces the decode launch's split-KV segment count (None = the builder's choice).
    """
    from kvllm.attention.backends.triton_attn import TritonAttentionBackend
    from kvllm.attention.backends.triton_attn_impl import TritonAttentionImpl, TritonAttentionMetadataBuilder

    device = torch.device(device)
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    fp8 = FP8_TORCH_DTYPES.get(kv_cache_dtype)
    cache_dtype = fp8 if fp8 is not None else dtype
    staging = torch.zeros(
        2, batch.num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32, device=device
    )
    batch.fill_cache(staging[0], staging[1])
    if fp8 is not None:
        kv_cache = torch.stack([(staging[0] / k_scale).to(fp8), (staging[1] / v_scale).to(fp8)])
        keys = [fp8_roundtrip(k, fp8, k_scale) for k in batch.keys]
        values = [fp8_roundtrip(v, fp8, v_scale) for v in batch.values]
    else:
        kv_cache = staging.to(cache_dtype)
        keys, values = batch.keys, batch.values
    gen = torch.Generator().manual_seed(seed + 1)
    sinks = (torch.randn(num_heads, generator=gen) * 2).to(device) if use_sinks else None

    spec = KVCacheSpec(block_size, num_kv_heads, head_size, cache_dtype, kv_cache_dtype)
    max_model_len = max(batch.seq_lens) + block_size
    builder = TritonAttentionMetadataBuilder(
        TritonAttentionBackend, spec, device, len(query_lens), sum(query_lens), max_model_len
    )
    md = builder.build(batch.metadata)
    if num_splits is not None:
        md.num_splits = num_splits
    impl = TritonAttentionImpl(
        num_heads,
        head_size,
        head_size**-0.5,
        num_kv_heads,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        kv_cache_dtype=kv_cache_dtype,
        sinks=sinks,
    )
    impl.decode_config = decode_config
    impl.prefill_config = prefill_config
    layer = types.SimpleNamespace(
        k_scale=torch.tensor(k_scale, dtype=torch.float32, device=device),
        v_scale=torch.tensor(v_scale, dtype=torch.float32, device=device),
    )
    out = torch.full_like(batch.query, float("nan"))  # poisoned: every real token must be written
    impl.forward(layer, batch.query, batch.new_keys, batch.new_values, kv_cache, md, output=out)
    ref = reference_attention(
        batch.query,
        keys,
        values,
        batch.query_lens,
        head_size**-0.5,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
    )
    return AttentionCase(batch=batch, out=out, ref=ref, kv_cache=kv_cache)
