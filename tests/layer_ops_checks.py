"""Comparisons of the fused layer kernels with the layers' torch path, shared by the CPU-interpreter
tests (tests/kernels/test_layer_ops.py) and the GPU tests (tests/gpu/test_layer_ops_gpu.py)."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_matches_eager(out: torch.Tensor, ref: torch.Tensor, tol32: float, exact: bool = False) -> None:
    """Bit-identical if `exact`; else float32 within `tol32` relative, 16-bit within two ulps in under 1%."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if exact:
        assert torch.equal(bits(out), bits(ref)), f"{int((out != ref).sum())} of {out.numel()} differ"
        return
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=tol32, atol=tol32)
        return
    differ = out != ref
    if differ.any():
        info = torch.finfo(out.dtype)
        got, want = out[differ].float(), ref[differ].float()
        ulp = torch.maximum(got.abs(), want.abs()).clamp_min(info.tiny) * info.eps  # >= one ulp
        assert ((got - want).abs() <= 2 * ulp).all(), "a 16-bit value is off by more than two ulps"
        assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {out.numel()} values differ"


def assert_qk_norm_rope_matches(
    out: torch.Tensor, ref: torch.Tensor, head_size: int, rotary_dim: int, tol32: float
) -> None:
    """QK-norm then RoPE: a one-ulp flip in a normed value n moves o1 = n1 cos - n2 sin by about
    eps |n|, which is small against |(n1, n2)| = |(o1, o2)| but may be many ulps of a small o1."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=tol32, atol=tol32)
        return
    differ = out != ref
    assert float(differ.float().mean()) < 0.01, f"{int(differ.sum())} of {out.numel()} values differ"
    got = out.float().view(out.shape[0], -1, head_size)
    want = ref.float().view(ref.shape[0], -1, head_size)
    half = rotary_dim // 2
    pair = torch.hypot(want[..., :half], want[..., half:rotary_dim])
    scale = torch.cat([pair, pair, want[..., rotary_dim:].abs()], dim=-1)
    info = torch.finfo(out.dtype)
    assert bool(((got - want).abs() <= 3 * info.eps * scale + info.tiny).all()), (
        "QK-norm + RoPE off by more than 3 eps"
    )
