"""The fused-MoE Triton kernels compiled on a CUDA GPU, against a float32 torch reference on that GPU.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py`.
The reference is `fused_experts_torch` on float32 copies of the same inputs (TF32 off). 16-bit outputs
round GEMM 1, the activation and GEMM 2 once each, so they agree within a few ulp of values ~ 1.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.moe import fused_experts_torch, softmax_topk
from kvllm.layers.moe.fused_moe_triton import fused_experts_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
# Over up to 1.4M outputs the largest of three roundings' error reaches ~5 sigma: bf16 ~ 1e-2, fp16 ~ 2e-3.
TOLERANCES = {torch.bfloat16: (5e-2, 5e-2), torch.float16: (1e-2, 1e-2), torch.float32: (1e-4, 1e-4)}
# (experts, top_k, hidden, intermediate): Qwen3-30B-A3B's (128, 8, 2048, 768), Mixtral-like, gpt-oss-like
SHAPES = [(128, 8, 2048, 768), (8, 2, 1024, 1792), (32, 4, 2880, 2880), (6, 3, 200, 72)]


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, bias=False):
    gen = torch.Generator(CUDA).manual_seed(num_tokens + num_experts + hidden)
    x = torch.randn(num_tokens, hidden, device=CUDA, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=CUDA, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=CUDA, generator=gen) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, device=CUDA, generator=gen)
    tw, ti = softmax_topk(logits, top_k, renormalize=True)
    b13 = torch.randn(num_experts, 2 * inter, device=CUDA, generator=gen) if bias else None
    b2 = torch.randn(num_experts, hidden, device=CUDA, generator=gen) if bias else None
    cast = [t.to(dtype) if t is not None else None for t in (x, w13, w2, b13, b2)]
    return cast[0], cast[1], cast[2], tw, ti, cast[3], cast[4]


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"E{s[0]}k{s[1]}H{s[2]}I{s[3]}" for s in SHAPES])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 700])
def test_matches_float32_torch(num_tokens, shape, dtype):
    x, w13, w2, tw, ti, _, _ = make_inputs(num_tokens, *shape, dtype=dtype)
    out = fused_experts_triton(x, w13, w2, tw, ti)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), tw, ti)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_swigluoai_with_bias(dtype):
    x, w13, w2, tw, ti, b13, b2 = make_inputs(48, 32, 4, 2880, 2880, dtype=dtype, bias=True)
    out = fused_experts_triton(x, w13, w2, tw, ti, "swigluoai", b13, b2)
    ref = fused_experts_torch(
        x.float(), w13.float(), w2.float(), tw, ti, "swigluoai", b13.float(), b2.float()
    )
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


def test_captures_in_a_cuda_graph():
    """No host sync on the Triton path: it captures, and a replay on new routing gives the new result."""
    x, w13, w2, tw, ti, _, _ = make_inputs(8, 16, 2, 256, 128, dtype=torch.bfloat16)
    static = [t.clone() for t in (x, tw, ti)]
    fused_experts_triton(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(static[0], w13, w2, static[1], static[2])
    x2, _, _, tw2, ti2, _, _ = make_inputs(8, 16, 2, 256, 128, dtype=torch.bfloat16)
    ti2 = torch.roll(ti2, 1, dims=0)  # a different routing than the captured one
    for dst, src in zip(static, (x2, tw2, ti2)):
        dst.copy_(src)
    graph.replay()
    expected = fused_experts_triton(x2, w13, w2, tw2, ti2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
