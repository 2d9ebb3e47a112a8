"""QK-norm + NeoX RoPE on the fused qkv projection, in place, in one Triton launch; optionally K/V to cache.

qkv is [T, (H + 2 * Hkv) * D]: H query heads, then Hkv key heads, then Hkv value heads, D = head size.
q and k are rewritten in place, so attention reads them (and v) as strided [T, heads, D] views of qkv; the
KV-write variant can put q in a buffer of its own instead (`q_out`: the piecewise graphs' shared query).

Reference: `LlamaAttention`'s torch path: the q_norm / k_norm `RMSNorm`s over D (weights [D]), then
`RotaryEmbedding` (rotate-half over the first rotary_dim dims, the rest passed through) with cos/sin
from the float32 `cos_sin_cache` [max_position, rotary_dim] (cos halves, then sin halves) cast to the
activation dtype. Every product, sum and difference is rounded to the activation dtype as torch's
elementwise ops round; differences from the eager path come only from float32 summation order in the
norms.

The KV-write variant also stores the rotated k and the untouched v at each token's slot of a paged cache
[num_blocks, block_size, Hkv, D] (any block/token/head strides, head dim contiguous; slot -1 = skip), as
`kvllm.attention.ops.triton_reshape_and_cache` does, fp8 caches included (value / scale, nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.attention.ops.triton_reshape_and_cache import fp8_constexprs, fp8_quantize
from kvllm.layers.ops.common import cast_to, interpreting, round_to
from kvllm.utils.dtypes import FP8_DTYPES
from kvllm.utils.pdl import pdl_enabled, pdl_launch_options, wait_for_previous_kernel

TILE_ELEMENTS = 2048  # padded head elements per program; heads are grouped up to this


@triton.jit
def _head_norm(x, rstd, q_weight_ptr, k_weight_ptr, offsets, mask, is_q, DTYPE: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """One piece [heads, dims] of RMSNorm: normalised, rounded, times the q or k weight, rounded."""
    normed = round_to(x * rstd, DTYPE, INTERPRET)
    q_w = tl.load(q_weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    k_w = tl.load(k_weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return round_to(normed * tl.where(is_q, q_w, k_w), DTYPE, INTERPRET)


@triton.jit
def _cache_store(key_cache_ptr, value_cache_ptr, k_offsets, v_offsets, x, is_k, is_v, scale,
                 IS_FP8: tl.constexpr, FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_EXPONENT: tl.constexpr,
                 FP8_ROUND_BY_HAND: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Store one piece of K heads (rows is_k) and V heads (rows is_v) into their caches."""
    cache_dtype = key_cache_ptr.dtype.element_ty
    if IS_FP8:
        y = fp8_quantize(x, scale, cache_dtype, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND)
    else:
        y = cast_to(x, cache_dtype, INTERPRET)
    tl.store(key_cache_ptr + k_offsets, y, mask=is_k)
    tl.store(value_cache_ptr + v_offsets, y, mask=is_v)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_out_ptr,  # Q_OUT only: the rotated q's rows go here ([T, H * D] rows of stride_q_out), not into qkv
    stride_qkv,
    stride_q_out,
    stride_cos_sin,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    ROT_HALF_PAD: tl.constexpr,
    PASS_SIZE: tl.constexpr,  # HEAD_SIZE - rotary_dim, not rotated
    PASS_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    Q_OUT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_ROUND_BY_HAND: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # Program (token, group of heads). Heads 0..H-1 are q, H..H+Hkv-1 are k; with WRITE_KV the
    # value heads H+Hkv..H+2Hkv-1 are programs' rows too, loaded only to be written to the cache.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    is_qk = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None]
    if WRITE_KV:
        live = (heads < NUM_HEADS + 2 * NUM_KV_HEADS)[:, None]
    else:
        live = is_qk
    dtype = qkv_ptr.dtype.element_ty
    row = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_SIZE
    half = tl.arange(0, ROT_HALF_PAD)[None, :]
    half_mask = half < ROT_HALF
    x1 = tl.load(row + half, mask=live & half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + ROT_HALF + half, mask=live & half_mask, other=0.0).to(tl.float32)
    rest = tl.arange(0, PASS_PAD)[None, :]
    rest_mask = rest < PASS_SIZE
    if PASS_SIZE > 0:
        x_rest = tl.load(row + 2 * ROT_HALF + rest, mask=live & rest_mask, other=0.0).to(tl.float32)
    else:
        x_rest = tl.zeros((HEADS_PER_PROGRAM, PASS_PAD), dtype=tl.float32)

    n1, n2, n_rest = x1, x2, x_rest
    if HAS_QK_NORM:
        square_sum = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS_SIZE > 0:
            square_sum += tl.sum(x_rest * x_rest, axis=1)
        rstd = tl.math.rsqrt(tl.math.div_rn(square_sum, HEAD_SIZE * 1.0) + eps)[:, None]
        is_q = (heads < NUM_HEADS)[:, None]
        n1 = _head_norm(x1, rstd, q_weight_ptr, k_weight_ptr, half, half_mask, is_q, dtype, INTERPRET)
        n2 = _head_norm(x2, rstd, q_weight_ptr + ROT_HALF, k_weight_ptr + ROT_HALF, half, half_mask, is_q,
                        dtype, INTERPRET)  # fmt: skip
        if PASS_SIZE > 0:
            n_rest = _head_norm(x_rest, rstd, q_weight_ptr + 2 * ROT_HALF, k_weight_ptr + 2 * ROT_HALF,
                                rest, rest_mask, is_q, dtype, INTERPRET)  # fmt: skip

    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + half, mask=half_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + ROT_HALF + half, mask=half_mask, other=0.0)
    cos = round_to(cos, dtype, INTERPRET)
    sin = round_to(sin, dtype, INTERPRET)
    o1 = round_to(
        round_to(n1 * cos, dtype, INTERPRET) - round_to(n2 * sin, dtype, INTERPRET), dtype, INTERPRET
    )
    o2 = round_to(
        round_to(n2 * cos, dtype, INTERPRET) + round_to(n1 * sin, dtype, INTERPRET), dtype, INTERPRET
    )

    in_place = is_qk  # rows rewritten in qkv: q and k, or k alone when q goes to q_out
    if Q_OUT:
        is_q_row = (heads < NUM_HEADS)[:, None]
        in_place = is_qk & (heads >= NUM_HEADS)[:, None]
        q_row = q_out_ptr + token * stride_q_out + heads[:, None] * HEAD_SIZE
        tl.store(q_row + half, o1.to(dtype), mask=is_q_row & half_mask)
        tl.store(q_row + ROT_HALF + half, o2.to(dtype), mask=is_q_row & half_mask)
        if PASS_SIZE > 0:  # the dims RoPE passes through, normed or not: q_out holds the whole head
            tl.store(q_row + 2 * ROT_HALF + rest, n_rest.to(dtype), mask=is_q_row & rest_mask)
    tl.store(row + half, o1.to(dtype), mask=in_place & half_mask)
    tl.store(row + ROT_HALF + half, o2.to(dtype), mask=in_place & half_mask)
    if HAS_QK_NORM and PASS_SIZE > 0:
        tl.store(row + 2 * ROT_HALF + rest, n_rest.to(dtype), mask=in_place & rest_mask)

    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            is_k = is_qk & (heads >= NUM_HEADS)[:, None]
            is_v = live & (heads >= NUM_HEADS + NUM_KV_HEADS)[:, None]
            kv_head = tl.where(is_k, heads[:, None] - NUM_HEADS, heads[:, None] - NUM_HEADS - NUM_KV_HEADS)
            k_base = (
                (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kcs + kv_head * stride_kch
            )
            v_base = (
                (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vcs + kv_head * stride_vch
            )
            scale = 1.0
            if IS_FP8:
                scale = tl.where(is_k, tl.load(k_scale_ptr), tl.load(v_scale_ptr))
            _cache_store(key_cache_ptr, value_cache_ptr, k_base + half, v_base + half,
                         tl.where(is_k, o1, x1), is_k & half_mask, is_v & half_mask, scale, IS_FP8,
                         FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND, INTERPRET)  # fmt: skip
            _cache_store(key_cache_ptr, value_cache_ptr, k_base + ROT_HALF + half, v_base + ROT_HALF + half,
                         tl.where(is_k, o2, x2), is_k & half_mask, is_v & half_mask, scale, IS_FP8,
                         FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND, INTERPRET)  # fmt: skip
            if PASS_SIZE > 0:
                _cache_store(key_cache_ptr, value_cache_ptr, k_base + 2 * ROT_HALF + rest,
                             v_base + 2 * ROT_HALF + rest, tl.where(is_k, n_rest, x_rest), is_k & rest_mask,
                             is_v & rest_mask, scale, IS_FP8, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT,
                             FP8_ROUND_BY_HAND, INTERPRET)  # fmt: skip


def _check_inputs(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_size: int, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None) -> int:  # fmt: skip
    """Raise on a layout the kernel cannot take; returns rotary_dim."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, {width}] ((num_heads + 2 * num_kv_heads) * head_size) with a contiguous last "
            f"dimension, got shape {tuple(qkv.shape)} strides {tuple(qkv.stride())}"
        )
    if positions.shape != (qkv.shape[0],) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"positions must be int64/int32 [{qkv.shape[0]}], got {positions.dtype} {tuple(positions.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            "cos_sin_cache must be a float32 [max_position, rotary_dim] tensor, last dim contiguous"
        )
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_size={head_size}]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q_weight and k_weight (QK-norm) or neither")
    for w in (q_weight, k_weight):
        if w is not None and (w.shape != (head_size,) or w.stride(0) != 1 or w.dtype != qkv.dtype):
            raise ValueError(
                f"QK-norm weights must be contiguous [{head_size}] tensors of qkv's dtype {qkv.dtype}"
            )
    return rotary_dim


def _launch(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
            num_kv_heads: int, head_size: int, rotary_dim: int, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float, key_cache: torch.Tensor | None,
            value_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            q_out: torch.Tensor | None = None) -> None:  # fmt: skip
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    write_kv = key_cache is not None
    num_rows = num_heads + (2 if write_kv else 1) * num_kv_heads
    rot_half_pad = triton.next_power_of_2(rotary_dim // 2)
    pass_pad = triton.next_power_of_2(head_size - rotary_dim) if head_size > rotary_dim else 1
    head_pad = 2 * rot_half_pad + (pass_pad if head_size > rotary_dim else 0)
    fit = max(1, TILE_ELEMENTS // head_pad)
    heads_per_program = min(triton.next_power_of_2(num_rows), 1 << (fit.bit_length() - 1))  # powers of two
    if key_cache is None or value_cache is None or slot_mapping is None:
        key_cache = value_cache = qkv  # not read: WRITE_KV is off
        slot_mapping = positions
        cache_strides = (0,) * 6
    else:
        cache_strides = (*key_cache.stride()[:3], *value_cache.stride()[:3])
    cache_dtype = key_cache.dtype
    use_pdl = pdl_enabled(qkv)
    _qk_norm_rope_kernel[(num_tokens, triton.cdiv(num_rows, heads_per_program))](
        qkv, positions, cos_sin_cache,
        qkv if q_weight is None else q_weight, qkv if k_weight is None else k_weight,
        key_cache, value_cache, slot_mapping,
        cos_sin_cache if k_scale is None else k_scale, cos_sin_cache if v_scale is None else v_scale,
        qkv if q_out is None else q_out,
        qkv.stride(0), qkv.stride(0) if q_out is None else q_out.stride(0), cos_sin_cache.stride(0), *cache_strides,
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        ROT_HALF=rotary_dim // 2,
        ROT_HALF_PAD=rot_half_pad,
        PASS_SIZE=head_size - rotary_dim,
        PASS_PAD=pass_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        HAS_QK_NORM=q_weight is not None,
        WRITE_KV=write_kv,
        Q_OUT=q_out is not None,
        BLOCK_SIZE=key_cache.shape[1] if write_kv else 1,
        IS_FP8=write_kv and cache_dtype in FP8_DTYPES,
        **fp8_constexprs(cache_dtype),
        USE_PDL=use_pdl,
        INTERPRET=interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_launch_options(use_pdl),
    )  # fmt: skip


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_size]; q and k rewritten in place
    positions: torch.Tensor,  # int [T]; each < max_position (not checked: that would sync)
    cos_sin_cache: torch.Tensor,  # float32 [max_position, rotary_dim]
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    q_weight: torch.Tensor | None = None,  # [head_size] QK-norm weights (Qwen3), both or neither
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Per-head RMSNorm of q and k (when weights are given), then NeoX RoPE, in place in qkv."""
    rotary_dim = _check_inputs(
        qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_size, q_weight, k_weight
    )
    _launch(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_size, rotary_dim, q_weight, k_weight,
            eps, None, None, None, None, None)  # fmt: skip


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], head dim contiguous
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [>= T]; -1 = skip the token (CUDA-graph padding)
    k_scale: torch.Tensor | None = None,  # float32 scalar tensors; fp8 caches store K / k_scale
    v_scale: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,  # [T, num_heads * head_size], last dim contiguous: see below
) -> None:
    """`qk_norm_rope`, and each token's rotated k and its v stored at its slot of the paged cache. With
    `q_out` the rotated q goes there instead of back into qkv (whose q part is then left as it was)."""
    rotary_dim = _check_inputs(
        qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_size, q_weight, k_weight
    )
    cache_shape = (num_kv_heads, head_size)
    if (
        key_cache.dim() != 4
        or key_cache.shape != value_cache.shape
        or key_cache.shape[2:] != cache_shape
        or key_cache.dtype != value_cache.dtype
        or key_cache.stride(-1) != 1
        or value_cache.stride(-1) != 1
    ):
        raise ValueError(
            f"key_cache/value_cache must be [num_blocks, block_size, {num_kv_heads}, {head_size}] of one dtype "
            f"with a contiguous head dim, got {tuple(key_cache.shape)} {key_cache.dtype} / "
            f"{tuple(value_cache.shape)} {value_cache.dtype}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < qkv.shape[0]:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {qkv.shape[0]} entries, got {tuple(slot_mapping.shape)}"
        )
    if key_cache.dtype in FP8_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    width = num_heads * head_size
    if q_out is not None and (
        q_out.dim() != 2
        or q_out.shape != (qkv.shape[0], width)
        or q_out.stride(1) != 1
        or q_out.dtype != qkv.dtype
    ):
        raise ValueError(
            f"q_out must be [{qkv.shape[0]}, {width}] of qkv's dtype {qkv.dtype} with a contiguous last dimension, "
            f"got {tuple(q_out.shape)} {q_out.dtype} strides {tuple(q_out.stride())}"
        )
    _launch(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_size, rotary_dim, q_weight, k_weight,
            eps, key_cache, value_cache, slot_mapping, k_scale, v_scale, q_out)  # fmt: skip
