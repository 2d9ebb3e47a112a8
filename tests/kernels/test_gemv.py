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
    norm_gemv,
    use_gemv,
    use_norm_gemv,
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


def unfused_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's eager path (kvllm.layers.norm): the sum rounded to x's dtype, normalised in float32 and
    rounded, then the weight product rounded: (h, x + residual)."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    normed = torch.nn.functional.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("gated", [False, True], ids=["proj", "gated"])
def test_norm_gemv_matches_the_norm_then_the_projection(dtype, m, with_residual, gated):
    n, k, eps = 38, 96, 1e-6  # K = 96 in a 128-wide tile: the norm's sum and mean see a masked tail
    x = randn(m, k, dtype=dtype, seed=10 + m) * 3
    residual = randn(m, k, dtype=dtype, seed=20 + m) if with_residual else None
    norm_weight = 1 + randn(k, dtype=dtype, seed=30) * 0.2
    w = randn(n, k, dtype=dtype, seed=40) * 0.3
    bias = randn(n, dtype=dtype, seed=41)
    out, residual_out = norm_gemv(x, residual, norm_weight, eps, w, bias, gated=gated)
    h, s = unfused_norm(x, residual, norm_weight, eps)
    ref = unfused_silu_and_mul(h, w, bias) if gated else reference(h, w, bias)
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == dtype
    # x + residual is exact: one rounding of an exact float32 sum, the same in both paths.
    assert torch.equal(residual_out, s) and (residual is not None or residual_out is x)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * k**0.5)
    # The same within an ulp of the two launches it replaces (the norm kernel, then the GEMV).
    from kvllm.layers.ops.rms_norm import fused_add_rms_norm, rms_norm

    h2, _ = (
        fused_add_rms_norm(x, residual, norm_weight, eps)
        if with_residual
        else (rms_norm(x, norm_weight, eps), x)
    )
    two = gemv_silu_and_mul(h2, w, bias) if gated else gemv(h2, w, bias)
    torch.testing.assert_close(out.float(), two.float(), rtol=rtol, atol=atol)


def test_norm_gemv_predicate_and_errors():
    x, residual = randn(1, 64, dtype=torch.bfloat16, seed=1), randn(1, 64, dtype=torch.bfloat16, seed=2)
    norm_weight, w = torch.ones(64, dtype=torch.bfloat16), randn(32, 64, dtype=torch.bfloat16, seed=3)
    assert use_norm_gemv(x, residual, norm_weight, w, narrow=False)
    assert use_norm_gemv(x, None, norm_weight, w, narrow=False)
    assert not use_norm_gemv(x, residual, norm_weight.float(), w, narrow=False)  # would promote h to fp32
    assert not use_norm_gemv(x, residual[:, :32], norm_weight, w, narrow=False)
    assert not use_norm_gemv(x, residual.half(), norm_weight, w, narrow=False)
    assert not use_norm_gemv(x.float(), residual.float(), norm_weight.float(), w, narrow=False)  # GEMV's own
    long_x = randn(1, 8192, dtype=torch.bfloat16, seed=4)  # two tiles of the default config
    long_w, long_norm = randn(8, 8192, dtype=torch.bfloat16, seed=5), torch.ones(8192, dtype=torch.bfloat16)
    assert not use_norm_gemv(long_x, None, long_norm, long_w, narrow=True)
    with pytest.raises(ValueError, match="use_norm_gemv"):
        norm_gemv(long_x, None, long_norm, 1e-6, long_w)
    with pytest.raises(ValueError, match="even number of rows"):
        norm_gemv(x, residual, norm_weight, 1e-6, w[:-1], gated=True)


def test_decoder_layer_runs_its_norms_inside_qkv_and_gate_up(monkeypatch):
    """A Llama layer at one row: the two pre-norms go into the qkv and gate_up GEMVs (no norm kernel),
    and the layer's output and residual match the unfused kernels'."""
    import kvllm.layers.ops.gemv as gemv_ops
    import kvllm.layers.ops.rms_norm as norm_ops
    from kvllm.layers.linear import MergedLinear
    from kvllm.layers.norm import RMSNorm
    from kvllm.layers.ops.dispatch import fused_ops_mode
    from kvllm.models.llama import LlamaMLP

    torch.manual_seed(0)
    mlp, norm = LlamaMLP(64, 96), RMSNorm(64)
    qkv = MergedLinear(64, [64, 32, 32])
    for p in (*mlp.parameters(), *qkv.parameters()):
        p.data.normal_(0, 0.2)
    norm.weight.data.normal_(1, 0.1)
    calls = []
    for module, name in ((gemv_ops, "norm_gemv"), (norm_ops, "fused_add_rms_norm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    x, residual = torch.randn(1, 64), torch.randn(1, 64)
    with fused_ops_mode("1"), torch.no_grad():
        out, res = mlp.forward_normed(x, residual, norm)
        q, res_q = qkv.normed(x, residual, norm)
    assert calls == ["norm_gemv", "norm_gemv"]
    with fused_ops_mode("0"), torch.no_grad():
        h, ref_res = norm(x, residual)
        ref, ref_q = mlp(h), qkv(h)
    assert torch.equal(res, ref_res) and torch.equal(res_q, ref_res)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
