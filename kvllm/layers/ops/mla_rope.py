"""DeepSeek's MLA RoPE in one Triton launch: the rotated query (nope part copied, rope part rotated) and
the rotated shared key, each written to a fresh tensor.

Reference: `DeepseekRotaryEmbedding`'s torch path (kvllm/layers/deepseek_rotary.py) followed by the
concatenation of q's nope part with its rotated rope part. The rope part is rotated in float32 with the
float32 `cos_sin_cache` [max_position, R] (cos halves, then sin halves, YaRN's attention factor
included) and rounded once to the activation dtype; pairs are (x[2i], x[2i+1]) when interleaved (the
output is evens then odds), else (x[i], x[i + R/2]). Eager decode ran about twenty small kernels per
layer for this (float casts, strided halves, products, concatenations); CUDA graphs replay those too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, interpreting


@triton.jit
def _rotate(x_ptr, first, second, cos, sin, mask):
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + second, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_kernel(
    positions_ptr,  # [T]
    cache_ptr,  # float32 [max_position, R]
    q_ptr,  # [T, H, P + R], head dim contiguous
    k_ptr,  # [T, R], last dim contiguous
    q_out_ptr,  # [T, H, P + R] contiguous
    k_out_ptr,  # [T, R] contiguous
    num_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    P: tl.constexpr,
    HALF: tl.constexpr,  # R / 2
    BLOCK_P: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cache_ptr + pos * (2 * HALF) + i, mask=i_ok, other=0.0)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + i, mask=i_ok, other=0.0)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    out_rows = q_out_ptr + t * (num_heads * (P + 2 * HALF)) + heads[:, None] * (P + 2 * HALF)
    p = tl.arange(0, BLOCK_P)
    p_mask = h_ok[:, None] & (p < P)[None, :]
    tl.store(out_rows + p[None, :], tl.load(q_rows + p[None, :], mask=p_mask), mask=p_mask)
    r_mask = h_ok[:, None] & i_ok[None, :]
    o1, o2 = _rotate(q_rows + P, first[None, :], second[None, :], cos[None, :], sin[None, :], r_mask)
    tl.store(out_rows + P + i[None, :], cast_to(o1, dtype, INTERPRET), mask=r_mask)
    tl.store(out_rows + P + HALF + i[None, :], cast_to(o2, dtype, INTERPRET), mask=r_mask)

    if head_block == 0:
        k1, k2 = _rotate(k_ptr + t * stride_kt, first, second, cos, sin, i_ok)
        tl.store(k_out_ptr + t * (2 * HALF) + i, cast_to(k1, dtype, INTERPRET), mask=i_ok)
        tl.store(k_out_ptr + t * (2 * HALF) + HALF + i, cast_to(k2, dtype, INTERPRET), mask=i_ok)


def mla_rope(
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q: torch.Tensor,
    k_pe: torch.Tensor,
    qk_nope_head_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q with its rope part rotated [T, H, P + R] contiguous, rotated k_pe [T, R] contiguous).

    positions [T]; cos_sin_cache float32 [max_position, R] contiguous; q [T, H, P + R] and k_pe [T, R]
    with contiguous last dims (k_pe may be a column slice of the kv_a projection's output).
    """
    num_tokens, num_heads, width = q.shape
    R = width - qk_nope_head_dim
    if R <= 0 or R % 2 or k_pe.shape != (num_tokens, R) or cos_sin_cache.shape[-1] != R:
        raise ValueError(
            f"q {tuple(q.shape)} with nope dim {qk_nope_head_dim}, k_pe {tuple(k_pe.shape)} and cos_sin_cache "
            f"{tuple(cos_sin_cache.shape)} do not agree on an even rope dim"
        )
    if q.stride(-1) != 1 or k_pe.stride(-1) != 1 or not cos_sin_cache.is_contiguous():
        raise ValueError("q and k_pe need contiguous last dims and cos_sin_cache must be contiguous")
    if cos_sin_cache.dtype != torch.float32 or k_pe.dtype != q.dtype:
        raise ValueError(
            f"cos_sin_cache must be float32 and k_pe of q's dtype, got {cos_sin_cache.dtype}, {k_pe.dtype}"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    if num_tokens == 0:
        return q_out, k_out
    block_h = min(16, triton.next_power_of_2(num_heads))
    _mla_rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        positions, cos_sin_cache, q, k_pe, q_out, k_out, num_heads, q.stride(0), q.stride(1), k_pe.stride(0),
        P=qk_nope_head_dim, HALF=R // 2, BLOCK_P=triton.next_power_of_2(max(qk_nope_head_dim, 1)),
        BLOCK_HALF=triton.next_power_of_2(R // 2), BLOCK_H=block_h, INTERLEAVED=interleaved,
        INTERPRET=interpreting(),
    )  # fmt: skip
    return q_out, k_out
