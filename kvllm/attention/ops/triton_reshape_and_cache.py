"""Triton kernel that writes new K/V rows into the paged KV cache through the slot mapping.

Cache layout (one of K or V): [num_blocks, block_size, num_kv_heads, head_size], head dim contiguous.
Slot s lives in block s // block_size at offset s % block_size; slot -1 is skipped (CUDA-graph padding).
An fp8 cache stores value / scale (an IEEE float32 division, tl.math.div_rn: Triton's `/` is an
approximate division on NVIDIA GPUs) rounded to nearest even: bit-identical to torch's
`(value.float() / scale).to(fp8)` where that quotient is a true division (on a CUDA tensor, torch divides
by a Python-float or CPU-scalar divisor as a multiplication by its reciprocal, which is not). Values past
the fp8 range saturate on the GPU (torch gives NaN / inf there).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from kvllm.utils.dtypes import FP8_DTYPES


def _interpreting() -> bool:
    """Triton kernels run in the CPU interpreter (as triton_unified_attention.is_interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round float32 x to the nearest (ties to even) value of an fp8 format, staying in float32.

    The cast of the result to fp8 is then exact in any rounding mode. Used only under the Triton
    interpreter, whose fp32 -> fp8 cast drops the carry when rounding up crosses a power of two
    (0.4871 -> 0.25 instead of 0.5); compiled kernels use the hardware's round-to-nearest-even cast.
    """
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)  # subnormals share the smallest normal's ulp
    ulp = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    # (y + 1.5 * 2^23) - 1.5 * 2^23 rounds y >= 0 to an integer, ties to even, for y < 2^22; the sign
    # goes back on afterwards so that tiny negatives give -0 like torch.
    rounded = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def fp8_quantize(
    x,
    scale,
    FP8_DTYPE: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_ROUND_BY_HAND: tl.constexpr,
):
    """What an fp8 cache stores for x: x / scale (IEEE float32 division), rounded to nearest even."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    if FP8_ROUND_BY_HAND:
        y = _round_to_fp8_grid(y, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT).to(FP8_DTYPE)
    else:
        y = y.to(FP8_DTYPE, fp_downcast_rounding="rtne")
    return y


def fp8_constexprs(cache_dtype: torch.dtype) -> dict[str, Any]:
    """The FP8_* compile-time arguments of `fp8_quantize` for a cache of this dtype."""
    return {
        "FP8_MANTISSA_BITS": 2 if cache_dtype == torch.float8_e5m2 else 3,
        "FP8_MIN_EXPONENT": -14 if cache_dtype == torch.float8_e5m2 else -6,
        "FP8_ROUND_BY_HAND": cache_dtype in FP8_DTYPES and _interpreting(),
    }


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_ROUND_BY_HAND: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, HEAD_SIZE_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if IS_FP8:
        k = fp8_quantize(k, tl.load(k_scale_ptr), key_cache_ptr.dtype.element_ty, FP8_MANTISSA_BITS,
                         FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND)  # fmt: skip
        v = fp8_quantize(v, tl.load(v_scale_ptr), value_cache_ptr.dtype.element_ty, FP8_MANTISSA_BITS,
                         FP8_MIN_EXPONENT, FP8_ROUND_BY_HAND)  # fmt: skip
    else:
        k = k.to(key_cache_ptr.dtype.element_ty)
        v = v.to(value_cache_ptr.dtype.element_ty)
    kc = (
        key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    )
    vc = (
        value_cache_ptr
        + block * stride_vcb
        + offset * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :]
    )
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_size]
    value: torch.Tensor,  # [T, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [>= num_tokens]; -1 = skip
    k_scale: torch.Tensor,  # float32 scalar tensor, used only for fp8 caches
    v_scale: torch.Tensor,
    num_tokens: int | None = None,
) -> None:
    """Store `key`/`value` rows 0..num_tokens-1 at their slots; rows with slot -1 are not written."""
    num_tokens = key.shape[0] if num_tokens is None else num_tokens
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_size = key_cache.shape
    if key.shape[1:] != (num_kv_heads, head_size) or value.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(
            f"key/value shapes {tuple(key.shape)}/{tuple(value.shape)} do not match the cache "
            f"(num_kv_heads={num_kv_heads}, head_size={head_size})"
        )
    if (
        key.stride(-1) != 1
        or value.stride(-1) != 1
        or key_cache.stride(-1) != 1
        or value_cache.stride(-1) != 1
    ):
        raise ValueError("reshape_and_cache needs a contiguous head dimension in key, value and caches")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    is_fp8 = key_cache.dtype in FP8_DTYPES
    head_size_pad = triton.next_power_of_2(head_size)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_size_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_size_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_SIZE=block_size,
        IS_FP8=is_fp8,
        **fp8_constexprs(key_cache.dtype),
        num_warps=4,
    )
