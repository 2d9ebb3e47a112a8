"""The Triton KV-write kernel against plain torch indexing, on the CPU interpreter.

Stores are exact: 16/32-bit caches must equal the input cast to the cache dtype bit for bit, and fp8
caches must equal torch's own `(x.float() / scale).to(fp8)` bit for bit (round to nearest even).
"""

from __future__ import annotations

import pytest
import torch

from kvllm.attention.ops.triton_reshape_and_cache import reshape_and_cache

SENTINEL = 7.0  # never produced by the writes below; marks cache entries that must stay untouched


def expected_cache(
    cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    expect = cache.clone()
    keep = slots >= 0
    block_size = cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        expect[blocks, offsets] = (rows[keep].float() / scale).to(dtype)
    else:
        expect[blocks, offsets] = rows[keep].to(dtype)
    return expect


def bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize(
    "cache_dtype,model_dtype,k_scale,v_scale",
    [
        (torch.float16, torch.float16, 1.0, 1.0),
        (torch.float32, torch.float32, 1.0, 1.0),
        (torch.bfloat16, torch.bfloat16, 1.0, 1.0),
        (torch.float8_e4m3fn, torch.float16, 0.37, 1.7),
        (torch.float8_e4m3fn, torch.float32, 1.0, 1.0),
        (torch.float8_e5m2, torch.float16, 2.5, 0.21),
        (torch.float8_e5m2, torch.bfloat16, 0.5, 0.5),
    ],
    ids=["fp16", "fp32", "bf16", "e4m3-fp16", "e4m3-fp32", "e5m2-fp16", "e5m2-bf16"],
)
@pytest.mark.parametrize(
    "num_kv_heads,head_size,block_size", [(2, 64, 16), (3, 80, 32), (8, 128, 16), (1, 256, 32)]
)
def test_kv_write(cache_dtype, model_dtype, k_scale, v_scale, num_kv_heads, head_size, block_size) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_size)
    num_tokens, num_blocks = 23, 6
    # K and V as strided views of one fused qkv projection, as a model produces them.
    qkv = (torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen) * 2).to(model_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    # Scattered distinct slots in a random block order, with padding slots (-1) in between.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 22]] = -1
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), SENTINEL).to(cache_dtype)
    value_cache = torch.full_like(key_cache, SENTINEL)
    expect_k = expected_cache(key_cache, key, slots, k_scale, cache_dtype)
    expect_v = expected_cache(value_cache, value, slots, v_scale, cache_dtype)
    reshape_and_cache(
        key, value, key_cache, value_cache, slots, torch.tensor(k_scale), torch.tensor(v_scale)
    )  # fmt: skip
    assert torch.equal(bits(key_cache), bits(expect_k))
    assert torch.equal(bits(value_cache), bits(expect_v))


def test_kv_write_into_stacked_cache_views() -> None:
    """The backend's (2, num_blocks, block_size, Hkv, D) cache, written through its K and V views."""
    kv_cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.float16)
    key = torch.randn(5, 2, 32).half()
    value = torch.randn(5, 2, 32).half()
    slots = torch.tensor([17, -1, 3, 63, 40])
    one = torch.tensor(1.0)
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots, one, one, num_tokens=5)
    flat = kv_cache.view(2, 64, 2, 32)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], key[keep]) and torch.equal(flat[1, slots[keep]], value[keep])
    written = torch.zeros(64, dtype=torch.bool)
    written[slots[keep]] = True
    assert not flat[:, ~written].any()


def test_kv_write_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="do not match the cache"):
        reshape_and_cache(
            torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), cache, cache, torch.zeros(3).long(), one, one
        )


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_cache_write_paths_agree_on_interleaved_layout(cache_dtype: torch.dtype) -> None:
    """FlashInfer's (num_blocks, 2, block_size, Hkv, D) cache: the Triton path (CUDA) equals the torch one."""
    from kvllm.attention.ops.paged_cache_write import write_kv_to_paged_cache

    gen = torch.Generator().manual_seed(3)
    key = torch.randn(9, 2, 32, generator=gen).half()
    value = torch.randn(9, 2, 32, generator=gen).half()
    slots = torch.randperm(5 * 16, generator=gen)[:9]
    slots[4] = -1
    scales = (torch.tensor(0.75), torch.tensor(1.5)) if cache_dtype.itemsize == 1 else (None, None)
    caches = []
    for use_triton in (True, False):
        cache = torch.full((5, 2, 16, 2, 32), SENTINEL).to(cache_dtype)
        write_kv_to_paged_cache(cache[:, 0], cache[:, 1], key, value, slots, *scales, use_triton=use_triton)
        caches.append(cache)
    assert torch.equal(bits(caches[0]), bits(caches[1]))
    written = caches[1].float().ne(SENTINEL).any(-1).any(-1)  # [block, k/v, offset]
    assert int(written.sum()) == 2 * 8
