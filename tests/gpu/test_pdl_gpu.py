"""Programmatic dependent launch on the GPU: a chain of decode kernels replayed in a CUDA graph gives
bit-for-bit the outputs it gives without PDL, and the float32 reference's within bf16 rounding.

Run on the H200: `PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py`. The chain is one
batch-1 decoder block's Triton kernels (add + RMSNorm, the qkv GEMV, the gated gate_up GEMV, the
down GEMV), 24 times over, so each kernel follows another PDL kernel that writes its input: with a
missing or misplaced wait the replay reads stale activations and differs.
"""

from __future__ import annotations

import pytest
import torch

from kvllm.layers.ops.gemv import gemv, gemv_silu_and_mul
from kvllm.layers.ops.rms_norm import fused_add_rms_norm
from kvllm.utils import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
HIDDEN, INTER, LAYERS = 1024, 3072, 24


def _weights(gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=CUDA, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    return [
        (
            (1 + 0.1 * torch.randn(HIDDEN, device=CUDA, generator=gen)).to(torch.bfloat16),
            rand(HIDDEN, HIDDEN),
            rand(2 * INTER, HIDDEN),
            rand(HIDDEN, INTER),
        )
        for _ in range(LAYERS)
    ]


def _chain(x: torch.Tensor, weights) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for norm_w, proj, gate_up, down in weights:
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        h = gemv(h, proj, constant_weight=True)
        h = gemv_silu_and_mul(h, gate_up, constant_weight=True)
        x = gemv(h, down, constant_weight=True)
    return x + residual


def _reference(x: torch.Tensor, weights) -> torch.Tensor:
    x, residual = x.float(), torch.zeros_like(x, dtype=torch.float32)
    for norm_w, proj, gate_up, down in weights:
        residual = x + residual
        h = torch.nn.functional.rms_norm(residual, (HIDDEN,), eps=1e-6) * norm_w.float()
        h = h @ proj.float().T
        gate, up = (h @ gate_up.float().T).chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up) @ down.float().T
    return x + residual


def _replayed(monkeypatch, enabled: bool, x: torch.Tensor, weights) -> torch.Tensor:
    monkeypatch.setenv("KVLLM_PDL", "1" if enabled else "0")
    pdl._device_has_pdl.cache_clear()
    assert pdl.pdl_enabled(x) is enabled
    static_x = x.clone()
    _chain(static_x, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, weights)
    outs = []
    for step in range(3):  # new inputs each replay, as decode steps have
        static_x.copy_(x * (1 + step))
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return torch.stack(outs)


def test_graph_replay_with_pdl_equals_without(monkeypatch) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs SM 9.0")
    gen = torch.Generator(CUDA).manual_seed(7)
    weights = _weights(gen)
    x = torch.randn(1, HIDDEN, device=CUDA, generator=gen).to(torch.bfloat16)
    try:
        with_pdl = _replayed(monkeypatch, True, x, weights)
        without = _replayed(monkeypatch, False, x, weights)
    finally:
        pdl._device_has_pdl.cache_clear()
    assert torch.equal(with_pdl, without)
    for step in range(3):
        ref = _reference(x * (1 + step), weights)
        err = (with_pdl[step].float() - ref).abs().max() / ref.abs().max()
        assert err < 0.05, (step, err.item())
