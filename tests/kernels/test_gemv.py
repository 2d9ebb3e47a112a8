"""The 1-4 row GEMV kernel (kvllm/layers/ops/gemv.py) on the CPU interpreter, against float32 torch.

It accumulates in float32 and rounds once to the output dtype, so 16-bit results are within about one
ulp of the float32 reference; float32 results differ by summation order only.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.ops.gemv import (
    MAX_ROWS,
    GemvConfig,
    block_m_for,
    default_config,
    gemv,
    gemv_silu_and_mul,
    use_gemv,
)

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


def unfused_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused path's roundings in plain torch: the projection to x's dtype, then silu, then the product."""
    y = reference(x, weight, bias).to(x.dtype).float()
    gate, up = y.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_silu_and_mul_matches_the_unfused_roundings(dtype, m):
    d, k = 40, 96
    x, w = randn(m, k, dtype=dtype, seed=m), randn(2 * d, k, dtype=dtype, seed=5) * 0.3
    bias = randn(2 * d, dtype=dtype, seed=6)
    out = gemv_silu_and_mul(x, w, bias, GemvConfig(block_n=8, block_k=32))
    ref = unfused_silu_and_mul(x, w, bias)
    assert out.shape == (m, d) and out.dtype == dtype
    # One ulp apart at most where the float32 sums, rounded to 16 bits, fall on different sides.
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv_silu_and_mul(x, w[:-1])


def test_merged_linear_gated_fuses_silu_for_one_row(monkeypatch):
    import kvllm.layers.ops.gemv as gemv_ops
    from kvllm.layers.activation import SiluAndMul
    from kvllm.layers.linear import MergedLinear
    from kvllm.layers.ops.dispatch import fused_ops_mode

    calls = []
    real = gemv_ops.gemv_silu_and_mul
    monkeypatch.setattr(
        gemv_ops, "gemv_silu_and_mul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    torch.manual_seed(0)
    layer = MergedLinear(64, [48, 48])
    layer.weight.data.normal_()
    act = SiluAndMul()
    for rows in (1, 2):  # 96 columns: narrow, so up to 4 rows fuse
        x = torch.randn(rows, 64)
        with fused_ops_mode("1"), torch.no_grad():
            out = layer.gated(x, act)
        with fused_ops_mode("0"), torch.no_grad():
            ref = act(layer(x))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == [1, 2]
