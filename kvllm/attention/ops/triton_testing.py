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


def fp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the KV write stores for x: the IEEE float32 quotient x / scale, rounded to nearest even fp8.

    Divides by a float32 tensor on x's device: on a CUDA tensor, torch turns division by a Python
    float into a multiplication by its reciprocal, which rounds differently in the last bit.
    """
    return (x.float() / torch.tensor(scale, dtype=torch.float32, device=x.device)).to(fp8_dtype)


def fp8_roundtrip(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What an fp8 cache gives back for x: fp8_quantize(x), times scale, in float32."""
    return fp8_quantize(x, fp8_dtype, scale).float() * scale


def read_back(batch: PagedBatch, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float = 1.0,
              v_scale: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """Every request's whole context [seq_len, Hkv, D] as the cache holds it, dequantized, in float32."""
    keys, values = [], []
    for r, seq_len in enumerate(batch.seq_lens):
        pos = torch.arange(seq_len, device=key_cache.device)
        blocks = batch.block_table[r].to(key_cache.device).long()[pos // batch.block_size]
        keys.append(key_cache[blocks, pos % batch.block_size].float() * k_scale)
        values.append(value_cache[blocks, pos % batch.block_size].float() * v_scale)
    return keys, values


def check_read_back(stored: list[torch.Tensor], original: list[torch.Tensor], fp8_dtype: torch.dtype | None,
                    scale: float, what: str) -> None:  # fmt: skip
    """The cache holds every context row (the KV write's new rows too) up to one rounding to its dtype.

    Exact for a model-dtype cache; for fp8, half an ulp of x / scale (eps / 2 relative, or half the
    smallest subnormal step), times scale. Catches rows written to the wrong slot or not at all.
    """
    for r, (got, want) in enumerate(zip(stored, original)):
        want = want.float()
        if fp8_dtype is None:
            bad = got != want
        else:
            info = torch.finfo(fp8_dtype)
            bound = torch.clamp(want.abs() * (info.eps / 2), min=scale * info.tiny * info.eps / 2)
            bad = (got - want).abs() > bound * (1 + 1e-5)
        if bad.any():
            pos = int(bad.nonzero()[0, 0])
            raise AssertionError(f"{what} cache of request {r} is wrong at context position {pos}")


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
        kv_cache = torch.stack(
            [fp8_quantize(staging[0], fp8, k_scale), fp8_quantize(staging[1], fp8, v_scale)]
        )
    else:
        kv_cache = staging.to(cache_dtype)
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
    # The reference attends over exactly what the cache holds after the step (the new rows as the KV
    # write rounded them), so it differs from the kernel only in accumulation order and in the
    # kernel's roundings of P and of the output; the cache itself is checked against the inputs.
    if fp8 is None:
        k_scale = v_scale = 1.0
    keys, values = read_back(batch, kv_cache[0], kv_cache[1], k_scale, v_scale)
    check_read_back(keys, batch.keys, fp8, k_scale, "key")
    check_read_back(values, batch.values, fp8, v_scale, "value")
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
