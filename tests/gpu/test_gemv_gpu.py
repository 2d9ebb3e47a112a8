"""The 1-4 row GEMV kernel compiled on a CUDA GPU, against a float32 product on the same GPU.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_gemv_gpu.py`.
The kernel accumulates in float32 and rounds once: 16-bit outputs are within one ulp of the largest
output of the float32 reference; float32 outputs within 1e-5 of it (summation order over K <= 5000).
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.ops.gemv import MAX_ROWS, default_config, gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# Qwen3-0.6B's qkv, o, gate_up and down projections (N, K), a Llama-3-8B down_proj, then odd ones
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 14336), (40, 128), (1001, 5000)]
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", list(range(1, MAX_ROWS + 1)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_matches_float32_reference(dtype, n, k, m, with_bias) -> None:
    gen = torch.Generator(CUDA).manual_seed(n + k + m)
    x = torch.randn(m, k, device=CUDA, generator=gen).to(dtype)
    weight = (torch.randn(n, k, device=CUDA, generator=gen) * k**-0.5).to(dtype)
    bias = torch.randn(n, device=CUDA, generator=gen).to(dtype) if with_bias else None
    ref = x.double() @ weight.double().T + (bias.double() if with_bias else 0.0)
    out = gemv(x, weight, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= ULP[dtype], (default_config(n, k, dtype), err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,k", [(3072, 1024), (14336, 4096), (40, 128)])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_silu_and_mul_epilogue_matches_the_unfused_path(dtype, d, k, m) -> None:
    """Against the unfused path's roundings on a float64 product: the projection to 16 bits, silu, the
    product; where a float32 sum rounds the other way the outputs differ by one ulp of the output."""
    from kvllm.layers.ops.gemv import gemv_silu_and_mul

    gen = torch.Generator(CUDA).manual_seed(d + k + m)
    x = torch.randn(m, k, device=CUDA, generator=gen).to(dtype)
    weight = (torch.randn(2 * d, k, device=CUDA, generator=gen) * k**-0.5).to(dtype)
    y = (x.double() @ weight.double().T).to(dtype).float()
    gate, up = y.chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    out = gemv_silu_and_mul(x, weight)
    assert out.shape == (m, d) and out.dtype == dtype
    err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert err <= 2 * ULP[dtype], err
