"""Triton MLA decode: each query attends over its request's latent pages, split over KV segments.

Layout: latent cache [num_blocks, block_size, L + R] (L = kv_lora_rank, R = rope dims), row
contiguous. Queries q [B, H, L + R]: the absorbed nope part (q_nope @ W_UK) then the rotated rope
part. Scores over the whole width; values are the first L entries of the same rows, so each
latent tile is read once for both products.

One program = BLOCK_H query heads of one request x one KV segment (every head reads the same
latent: MLA is MQA in the latent space, so heads are packed into the rows of the dot products).
Segments write (normalised partial output, log-sum-exp); a second kernel merges them. Softmax in
base 2 (scale * log2(e) folded into the scores); an fp8 cache is read back times k_scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.utils.dtypes import FP8_DTYPES

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_segment(
    q_ptr,  # [B, H, L + R]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, L + R]
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    k_scale_ptr,  # float32 scalar
    mid_o_ptr,  # float32 [B, H, NUM_SPLITS, L]
    mid_lse_ptr,  # float32 [B, H, NUM_SPLITS]
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models (tf32 would cost ~1e-3 relative error)
):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L
    r_ok = offs_r < R
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_l[None, :], mask=head_ok[:, None] & l_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + L + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)

    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(block_table_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        kv = tl.load(rows[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :], other=0.0)
        kpe = tl.load(rows[:, None] + L + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        if IS_FP8:
            kv = kv.to(tl.float32) * k_scale
            kpe = kpe.to(tl.float32) * k_scale
        # A 16-bit cache under a model of another dtype (or a dequantized fp8 one): compute in q's dtype.
        kv = kv.to(q_nope.dtype)
        kpe = kpe.to(q_nope.dtype)
        scores = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION) + tl.dot(
            q_pe, tl.trans(kpe), input_precision=DOT_PRECISION
        )  # [BLOCK_H, BLOCK_N]
        scores = tl.where(pos_ok[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new

    mid = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(mid_o_ptr + mid[:, None] * L + offs_l[None, :], out, mask=head_ok[:, None] & l_ok[None, :])
    tl.store(mid_lse_ptr + mid, lse, mask=head_ok)


@triton.jit
def _mla_decode_reduce(
    mid_o_ptr,  # float32 [B, H, NUM_SPLITS, L]
    mid_lse_ptr,  # float32 [B, H, NUM_SPLITS] (base 2)
    out_ptr,  # [B, H, L]
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = tl.arange(0, BLOCK_L)
    s_ok = offs_s < NUM_SPLITS
    base = (b * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    parts = tl.load(
        mid_o_ptr + (base + offs_s)[:, None] * L + offs_l[None, :],
        mask=s_ok[:, None] & (offs_l[None, :] < L),
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_l, out, mask=offs_l < L)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    num_splits: int = 1,
    block_n: int = 16,
    block_h: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Latent-space decode attention -> [B, H, kv_lora_rank] in q's dtype (see the module docstring).

    q [B, H, L + R] with a contiguous last dim; kv_cache [num_blocks, block_size, L + R] contiguous;
    block_table int32 [B, >= blocks of the longest sequence]; seq_lens int32 [B], every one >= 1.
    """
    B, H, width = q.shape
    L, R = kv_lora_rank, width - kv_lora_rank
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [num_blocks, block_size, {width}] tensor, got {tuple(kv_cache.shape)}"
        )
    if q.stride(-1) != 1 or block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("q needs a contiguous last dim; block_table and seq_lens must be int32")
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8 and k_scale is None:
        raise ValueError("an fp8 latent cache needs k_scale")
    out = torch.empty(B, H, L, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    mid_o = torch.empty(B, H, num_splits, L, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    scale_arg = k_scale if k_scale is not None else mid_lse  # unread unless IS_FP8
    block_l, block_r = triton.next_power_of_2(L), max(16, triton.next_power_of_2(R))
    _mla_decode_segment[(B, triton.cdiv(H, block_h), num_splits)](
        q, kv_cache, block_table, seq_lens, scale_arg, mid_o, mid_lse, scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        NUM_HEADS=H, L=L, R=R, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[1], NUM_SPLITS=num_splits, IS_FP8=is_fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _mla_decode_reduce[(B, H)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=H, L=L, BLOCK_L=block_l, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )  # fmt: skip
    return out
