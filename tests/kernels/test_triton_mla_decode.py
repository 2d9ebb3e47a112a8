"""The Triton MLA decode kernel against a float32 plain-torch reference, on the CPU interpreter.

Shapes are small but cover what the kernel's structure branches on: head counts below, equal to and
above a head block (a partly masked second block), latent and rope widths that are and are not
powers of two, tiles that span several pages and pages that span several tiles, one segment (the
direct write) and several (segments shorter than a tile, empty ones, the merge), length-0 requests
(CUDA-graph padding: zeros), an fp8 latent cache with k_scale and scrambled block tables.

Tolerances (relative L2 error of the whole output and max abs error; outputs are O(0.1-1)): float32
computes with IEEE dots, only the summation order differs: 1e-5. float16 rounds P for the P.V dot and
the output (2^-11 relative each): 2e-3 / 5e-3. fp8 adds no error of its own: the reference reads the
same fp8 values times k_scale.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.attention.ops.triton_mla_decode import (
    MAX_SPLITS,
    MLADecodeConfig,
    decode_config,
    mla_decode,
    num_splits_for,
)

TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 5e-3)}
SEQ_LENS = [0, 1, 15, 16, 17, 150, 63]


def _case(num_heads, L, R, block_size, dtype, seed, cache_dtype=None, k_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in SEQ_LENS]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(SEQ_LENS), max(pages) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[start : start + n].int()
        start += n
    latent = torch.randn(num_blocks, block_size, L + R, generator=gen)
    cache = (latent / k_scale).to(cache_dtype or dtype)
    q = (torch.randn(len(SEQ_LENS), num_heads, L + R, generator=gen) * 0.5).to(dtype)
    return q, cache, table, torch.tensor(SEQ_LENS, dtype=torch.int32)


def reference(q, cache, table, seq_lens, L, scale, k_scale=1.0):
    """float32 [B, H, L]: softmax(scale * q . latent) . latent[:, :L] per request; zeros without keys."""
    block_size = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], L)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        lat = cache[table[b, pos // block_size].long(), pos % block_size].float() * k_scale
        probs = (q[b].float() @ lat.T * scale).softmax(dim=-1)
        out[b] = probs @ lat[:, :L]
    return out


def check(out, ref, dtype):
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert torch.isfinite(out).all()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    max_abs = (out.float() - ref).abs().max().item()
    assert rel < rel_tol and max_abs < abs_tol, f"relative error {rel:.2e}, max abs {max_abs:.2e}"
    assert (out[0] == 0).all(), "a length-0 request must get zeros"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,L,R,block_size",
    [(4, 32, 8, 16), (16, 32, 16, 32), (20, 48, 8, 16)],
    ids=["h4-L32-R8-b16", "h16-L32-R16-b32", "h20-L48-R8-b16"],
)
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_matches_reference(dtype, num_heads, L, R, block_size, num_splits):
    q, cache, table, seq_lens = _case(num_heads, L, R, block_size, dtype, seed=num_heads + num_splits)
    scale = 0.3
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    out = mla_decode(q, cache, table, seq_lens, L, scale, num_splits=num_splits, config=config)
    assert out.dtype == dtype and out.shape == (len(SEQ_LENS), num_heads, L)
    check(out, reference(q, cache, table, seq_lens, L, scale), dtype)


@pytest.mark.parametrize(
    "config",
    [
        MLADecodeConfig(block_h=32, block_n=64, num_warps=4, num_stages=1),
        MLADecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2),
    ],
    ids=["h32-n64", "h64-n32"],
)
def test_wide_head_blocks_and_tiles(config):
    """Head blocks wider than the heads (all in one program) and tiles wider than a page."""
    q, cache, table, seq_lens = _case(40, 32, 8, 16, torch.float16, seed=11)
    out = mla_decode(q, cache, table, seq_lens, 32, 0.25, num_splits=2, config=config)
    check(out, reference(q, cache, table, seq_lens, 32, 0.25), torch.float16)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_latent_cache(fp8, num_splits):
    k_scale = 0.5
    q, cache, table, seq_lens = _case(8, 32, 8, 16, torch.float16, seed=5, cache_dtype=fp8, k_scale=k_scale)
    out = mla_decode(q, cache, table, seq_lens, 32, 0.3, k_scale=torch.tensor(k_scale), num_splits=num_splits)
    check(out, reference(q, cache, table, seq_lens, 32, 0.3, k_scale), torch.float16)


def test_bad_arguments_are_refused():
    q, cache, table, seq_lens = _case(4, 32, 8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(q, cache, table, seq_lens, 32, 0.3, num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, cache, table.long(), seq_lens, 32, 0.3)
    with pytest.raises(ValueError, match="k_scale"):
        mla_decode(q.half(), cache.to(torch.float8_e4m3fn), table, seq_lens, 32, 0.3)


def test_split_and_config_choices_depend_on_sizes_only():
    # One wave of programs at most (132 SMs): what the H200 sweep found fastest at 4k context.
    small, large = decode_config(16, torch.bfloat16), decode_config(128, torch.bfloat16)
    assert (small.block_h, large.block_h) == (16, 64)
    assert num_splits_for(128, 16, small, 4096, 132) == 2  # 256 programs: not 3 (384, a second wave)
    assert num_splits_for(32, 16, small, 4096, 132) == 8
    assert num_splits_for(32, 128, large, 4096, 132) == 2  # one 64-head program per SM
    assert num_splits_for(256, 16, small, 4096, 132) == 1
    assert 16 <= num_splits_for(1, 16, small, 4096, 132) <= MAX_SPLITS
    assert num_splits_for(1, 16, small, 200, 132) == 1  # no segment below MIN_SPLIT_TOKENS
    assert num_splits_for(0, 16, small, 4096, 132) == 1
