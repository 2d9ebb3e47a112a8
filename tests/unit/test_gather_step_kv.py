"""gather_step_kv: the step's K/V read back from the paged cache (TRITON_ATTN's auto prefill route)."""

import pytest
import torch

from kvllm.attention.backends.triton_attn_impl import gather_step_kv


def _reference(key_cache, value_cache, slot_mapping):
    slots = slot_mapping.long().clamp(min=0)
    block, offset = slots // key_cache.shape[1], slots % key_cache.shape[1]
    return key_cache[block, offset].clone(), value_cache[block, offset].clone()


def _cache_pair(dtype, generator, num_blocks=9, block_size=16, heads=2, head_size=8):
    kv = torch.randn(2, num_blocks, block_size, heads, head_size, generator=generator).to(dtype)
    return kv[0], kv[1]


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = ["rows", "block_major_heads", "odd_offset", "odd_row"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_step_kv_equals_indexing(dtype, layout):
    # A seed per case that is the same in every process (str hashes are salted per process).
    g = torch.Generator().manual_seed(len(LAYOUTS) * DTYPES.index(dtype) + LAYOUTS.index(layout))
    key_cache, value_cache = _cache_pair(dtype, g)
    if layout == "block_major_heads":  # slots are not rows of one stride: the indexing path
        key_cache = key_cache.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "odd_offset":  # rows, but not at a multiple of 8 bytes: index_select in the cache's dtype
        flat = torch.randn(1 + key_cache.numel(), generator=g).to(dtype)
        key_cache = flat[1:].view(key_cache.shape)
    elif layout == "odd_row":  # a row of 3 x 5 values: no 8-byte words
        key_cache, value_cache = _cache_pair(dtype, g, heads=3, head_size=5)
    slot_mapping = torch.randint(
        0, key_cache.shape[0] * key_cache.shape[1], (37,), generator=g, dtype=torch.int32
    )
    slot_mapping[-4:] = -1  # padding rows read slot 0
    key, value = gather_step_kv(key_cache, value_cache, slot_mapping)
    expected_key, expected_value = _reference(key_cache, value_cache, slot_mapping)
    for got, expected in ((key, expected_key), (value, expected_value)):
        assert got.dtype == dtype and got.shape == expected.shape and got.is_contiguous()
        assert torch.equal(got, expected)
    # A copy, not a view of the cache: the kernel may read it after the cache's next write.
    key_cache.zero_()
    assert torch.equal(key, expected_key)
