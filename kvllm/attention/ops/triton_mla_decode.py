"""Triton MLA decode: each query attends over its request's latent pages, split over KV segments.

Layout: latent cache [num_blocks, block_size, L + R] (L = kv_lora_rank, R = rope dims), row
contiguous. Queries q [B, H, L + R]: the absorbed nope part (q_nope @ W_UK) then the rotated rope
part. Scores over the whole width; values are the first L entries of the same rows, so each
latent tile is loaded once for both products.

One program = BLOCK_H query heads of one request x one KV segment. MLA is MQA in the latent space:
every head reads the same latent, so the heads are the M rows of both tensor-core products
(scores [BLOCK_H, BLOCK_N] = q . k^T, acc [BLOCK_H, L] += p . v). The grid is (head blocks,
segments, requests) with head blocks fastest: programs that read the same tiles run side by side,
so a request with more heads than BLOCK_H reads its latent from DRAM once and from L2 after.

Segments write (normalised partial output, base-2 log-sum-exp) and a second kernel merges them;
with one segment the first kernel writes the output itself. The segment count is a runtime
argument (no recompiles), and each request cuts its own length into that many tile-aligned
segments, so a CUDA graph captured with a count serves any sequence lengths. A request of length
0 (graph padding) gets zeros. Softmax in base 2 (scale * log2(e) folded into the scores). An fp8
cache is converted exactly to q's dtype and k_scale is applied to the scores and the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.utils.dtypes import FP8_DTYPES

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 128  # a segment below this many keys costs more in the merge than it saves


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile sizes and launch options of the segment kernel."""

    block_h: int  # query heads per program (the M rows of the dots), power of two >= 16
    block_n: int  # latent rows per inner-loop tile, power of two >= 16
    num_warps: int
    num_stages: int
    # Programs of this config an SM runs at once (registers, shared memory): one wave is
    # programs_per_sm x SMs, and the split count fills one wave without starting a second.
    programs_per_sm: int = 2


def decode_config(num_heads: int, dtype: torch.dtype, interpret: bool = False) -> MLADecodeConfig:
    """The config for a model, from a sweep of 15 configs x split counts on an H200 (bf16, DeepSeek dims,
    4k context; docs/benchmarks.md, sixth session):
    - 16 heads: 16-head blocks, 32-row tiles, 4 warps, 2 stages: best or within 8% of the best at batch
      1, 32 and 128 (2.81 TB/s of latent at batch 128, 2.38 at 32);
    - more than 32 heads: 64-head blocks, 64-row tiles, 8 warps, one stage (a [64, 512] float32
      accumulator; one program per SM): best at batch 32 and 128 (164 / 172 TFLOP/s), 1.27x the best
      at batch 1;
    - 32 heads (not measured): 32-head blocks; float32: 16-row tiles (registers); the interpreter: wide
      tiles (its cost is per op, not per element)."""
    if interpret:
        return MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    if num_heads <= 16:
        return MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2)
    if num_heads <= 32:
        return MLADecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=2)
    return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=1, programs_per_sm=1)


def num_splits_for(
    num_reqs: int, num_heads: int, config: MLADecodeConfig, max_seq_len: int, num_sms: int
) -> int:
    """KV segments per request: as many as fit in one wave of programs (a second, partly filled wave
    cost up to 25% on the H200: 3 segments at batch 128 x 16 heads ran 270 us against 218 for 2), none
    shorter than MIN_SPLIT_TOKENS of the longest sequence, at most MAX_SPLITS. Sizes only, no lengths."""
    programs = num_reqs * -(-num_heads // config.block_h)
    wave = config.programs_per_sm * num_sms
    if programs == 0 or programs >= wave:
        return 1
    by_length = max(1, max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(wave // programs, by_length, MAX_SPLITS))


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _mla_decode_segment(
    q_ptr,  # [B, H, L + R]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, L + R]
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    k_scale_ptr,  # float32 scalar
    out_ptr,  # [B, H, L] (DIRECT)
    mid_o_ptr,  # float32 [B, H, num_splits, L]
    mid_lse_ptr,  # float32 [B, H, num_splits]
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DIRECT: tl.constexpr,  # one segment: write the normalised output, no merge
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models (tf32 would cost ~1e-3 relative error)
):
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L
    r_ok = offs_r < R
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_l[None, :], mask=head_ok[:, None] & l_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + L + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)

    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    score_scale = qk_scale
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        score_scale = qk_scale * k_scale
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        if BLOCK_L == L:
            kv = tl.load(rows[:, None] + offs_l[None, :], mask=pos_ok[:, None], other=0.0)
        else:
            kv = tl.load(rows[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :], other=0.0)
        kpe = tl.load(rows[:, None] + L + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        # fp8 -> 16/32-bit is exact; a 16-bit cache under a model of another dtype is computed in q's.
        kv = kv.to(q_nope.dtype)
        kpe = kpe.to(q_nope.dtype)
        scores = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(kpe), scores, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        scores = tl.where(pos_ok[None, :], scores * score_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    if IS_FP8:
        inv = inv * k_scale
    out = acc * inv[:, None]
    o_mask = head_ok[:, None] & l_ok[None, :]
    if DIRECT:
        o_rows = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(o_rows + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        mid = (b.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(mid_o_ptr + mid[:, None] * L + offs_l[None, :], out, mask=o_mask)
        tl.store(mid_lse_ptr + mid, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _mla_decode_reduce(
    mid_o_ptr,  # float32 [B, H, num_splits, L]
    mid_lse_ptr,  # float32 [B, H, num_splits] (base 2)
    out_ptr,  # [B, H, L]
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits: MAX_SPLITS, so no split count compiles a variant
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every segment empty (a length-0 request): zeros
    total = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0), axis=0)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for s in range(0, num_splits):
        # An empty segment stored zeros and -inf: weight 0, nothing added.
        w = tl.exp2(tl.load(mid_lse_ptr + base + s) - m)
        acc += w * tl.load(mid_o_ptr + (base + s) * L + offs_l, mask=l_ok, other=0.0)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_l, out, mask=l_ok)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    num_splits: int = 1,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Latent-space decode attention -> [B, H, kv_lora_rank] in q's dtype (see the module docstring).

    q [B, H, L + R] with a contiguous last dim; kv_cache [num_blocks, block_size, L + R] contiguous;
    block_table int32 [B, >= blocks of the longest sequence]; seq_lens int32 [B] (0 = no keys: zeros);
    num_splits in [1, MAX_SPLITS]; config defaults to `decode_config(H, q.dtype)`.
    """
    B, H, width = q.shape
    L, R = kv_lora_rank, width - kv_lora_rank
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [num_blocks, block_size, {width}] tensor, got {tuple(kv_cache.shape)}"
        )
    if q.stride(-1) != 1 or block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("q needs a contiguous last dim; block_table and seq_lens must be int32")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8 and k_scale is None:
        raise ValueError("an fp8 latent cache needs k_scale")
    if config is None:
        from kvllm.attention.ops.triton_unified_attention import is_interpreter

        config = decode_config(H, q.dtype, is_interpreter())
    out = torch.empty(B, H, L, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    direct = num_splits == 1
    mid_shape = (1,) if direct else (B, H, num_splits)  # unused with one segment
    mid_o = torch.empty(*mid_shape, 1 if direct else L, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    scale_arg = k_scale if k_scale is not None else mid_lse  # unread unless IS_FP8
    block_l, block_r = triton.next_power_of_2(L), max(16, triton.next_power_of_2(R))
    _mla_decode_segment[(triton.cdiv(H, config.block_h), num_splits, B)](
        q, kv_cache, block_table, seq_lens, scale_arg, out, mid_o, mid_lse, scale * LOG2E, H, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        L=L, R=R, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        BLOCK_SIZE=kv_cache.shape[1], IS_FP8=is_fp8, DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if not direct:
        _mla_decode_reduce[(H, B)](
            mid_o, mid_lse, out, H, num_splits, out.stride(0), out.stride(1),
            L=L, BLOCK_L=block_l, BLOCK_S=MAX_SPLITS,
        )  # fmt: skip
    return out
