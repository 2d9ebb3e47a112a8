"""The 1-4 row GEMV kernel (kvllm/layers/ops/gemv.py) on the CPU interpreter, against float32 torch.

It accumulates in float32 and rounds once to the output dtype, so 16-bit results are within about one
ulp of the float32 reference; float32 results differ by summation order only.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.ops.gemv import MAX_ROWS, GemvConfig, block_m_for, default_config, gemv, use_gemv

TOLERANCES = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1e-2), torch.float32: (1e-5, 1e-4)}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(48, 96), (37, 256), (128, 80)])
def test_gemv_matches_float32_reference(dtype, m, n, k):
    x, w = randn(m, k, dtype=dtype, seed=m), randn(n, k, dtype=dtype, seed=100 + n)
    bias = randn(n, dtype=dtype, seed=7) if n % 2 else None
    config = GemvConfig(block_n=8, block_k=32)  # several programs and K tiles, ragged edges
    out = gemv(x, w, bias, config)
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), reference(x, w, bias), rtol=rtol, atol=atol * k**0.5)


def test_default_config_and_strided_rows():
    x_full = randn(3, 160, dtype=torch.float32, seed=1)
    x = x_full[:, :128]  # row stride 160: a view, not a copy
    w = randn(64, 128, dtype=torch.float32, seed=2)
    torch.testing.assert_close(gemv(x, w), reference(x, w, None), rtol=1e-5, atol=1e-4)
    assert default_config(1024, 3072, torch.bfloat16) == GemvConfig(block_n=4, block_k=4096, num_warps=4)
    assert default_config(4096, 1024, torch.bfloat16) == GemvConfig(block_n=2, block_k=1024, num_warps=1)
    assert default_config(8, 3072, torch.float32).block_k == 2048
    assert [block_m_for(m) for m in range(1, MAX_ROWS + 1)] == [1, 2, 4, 4]


def test_gemv_rejects_bad_inputs():
    x, w = randn(5, 32, dtype=torch.float32, seed=0), randn(16, 32, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 4"):
        gemv(x, w)
    with pytest.raises(ValueError, match="share one of"):
        gemv(x[:2].half(), w)
    with pytest.raises(ValueError, match="power of two"):
        gemv(x[:2], w, config=GemvConfig(block_n=3, block_k=32))
    assert gemv(x[:0], w).shape == (0, 16)


def test_use_gemv_predicate():
    w = randn(64, 32, dtype=torch.float16, seed=3)

    def rows(m: int) -> torch.Tensor:
        return randn(m, 32, dtype=torch.float16, seed=m)

    assert use_gemv(rows(1), w, narrow=False) and use_gemv(rows(1), w, narrow=True)
    assert use_gemv(rows(4), w, narrow=True) and not use_gemv(rows(4), w, narrow=False)
    assert not use_gemv(rows(5), w, narrow=True) and not use_gemv(rows(0), w, narrow=True)
    assert not use_gemv(rows(1)[None], w, narrow=True)  # 3-D
    assert not use_gemv(rows(1).float(), w, narrow=True)  # mixed dtypes
    assert not use_gemv(rows(1), w.t().contiguous().t(), narrow=True)  # strided weight
    assert not use_gemv(rows(1).double(), w.double(), narrow=True)
