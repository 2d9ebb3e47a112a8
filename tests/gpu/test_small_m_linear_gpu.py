"""The small-M linear kernel compiled on a CUDA GPU, against F.linear (cuBLAS) on the same GPU.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_small_m_linear_gpu.py`.
Both accumulate in float32 and round once, in different orders: 16-bit outputs agree within one ulp of
the largest output; float32 (no TF32 on either side) within 1e-4 of it (summation order over K <= 3072).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvllm.layers.linear import Linear
from kvllm.layers.ops.dispatch import fused_ops_mode
from kvllm.layers.ops.linear import MAX_ROWS, linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# Qwen3-0.6B's qkv, o, gate_up and down projections (N, K), then odd ones
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (40, 128), (1000, 208)]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_matches_f_linear(dtype, n, k, m, with_bias) -> None:
    gen = torch.Generator(CUDA).manual_seed(n + k + m)
    x = torch.randn(m, k, device=CUDA, generator=gen).to(dtype)
    weight = (torch.randn(n, k, device=CUDA, generator=gen) * k**-0.5).to(dtype)
    bias = torch.randn(n, device=CUDA, generator=gen).to(dtype) if with_bias else None
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    out = linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    scale = ref.abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale


def test_layer_runs_the_kernels_on_cuda_in_auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """o_proj-shaped (narrow) layer: the GEMV for 1-4 rows, the small-M kernel for 5-16, cuBLAS above."""
    import kvllm.layers.ops.gemv as gemv_ops
    import kvllm.layers.ops.linear as ops

    calls: list[tuple[str, int]] = []

    def spy(name, real):  # noqa: ANN001, ANN202
        def wrapper(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
            calls.append((name, x.shape[0]))
            return real(x, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(ops, "linear", spy("small_m", ops.linear))
    monkeypatch.setattr(gemv_ops, "gemv", spy("gemv", gemv_ops.gemv))
    layer = Linear(2048, 1024, bias=False).to(CUDA, torch.bfloat16)
    with fused_ops_mode("auto"), torch.no_grad():
        for rows in (1, 4, 8, MAX_ROWS + 1):
            layer(torch.randn(rows, 2048, device=CUDA, dtype=torch.bfloat16))
    assert calls == [("gemv", 1), ("gemv", 4), ("small_m", 8)]
