"""W4A16: y = x @ dequant(W)^T for 4-bit weights with per-group scales and zero points (AWQ, GPTQ and
compressed-tensors W4A16 all run here, after repacking into one layout at load time).

Layout ("kvllm int4"): `qweight` [N, K/8] int32, eight unsigned 4-bit values per word along K, value
k % 8 in bits 4 * (k % 8) .. +3 (compressed-tensors' pack-quantized order); `scales` and `zeros`
[N, K/G] in the activations' dtype; W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G].
Act-order checkpoints (GPTQ desc_act) are permuted along K at load time so groups are contiguous; the
activations are then gathered with the same permutation (`perm`).

Reference: `dequantize` (float32) and a float32 matmul. The Triton kernel dequantizes each [BLOCK_N,
BLOCK_K] tile in registers (scales per column when the tile is within one group), rounds it to x's dtype as the
dequantize-then-F.linear path does, and accumulates x @ W^T in float32 with tensor-core dots. Small M
(decode) uses a 16-row tile and splits K over programs when N gives too few (partial sums reduced in a
fixed order, kvllm/layers/ops/linear.py's reduce kernel); large M uses 64/128-row tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, interpreting, round_to
from kvllm.layers.ops.dispatch import use_fused_ops

PACK = 8  # 4-bit values per int32
SMALL_M = 16
TARGET_PROGRAMS = 264  # two per SM on an H200
MAX_SPLIT_K = 8


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in [0, 15] -> [R, C / 8] int32, value c % 8 of each word in bits 4 * (c % 8)."""
    if values.shape[-1] % PACK:
        raise ValueError(f"int4 packing needs a multiple of {PACK} columns, got {values.shape[-1]}")
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64, device=values.device) * 4
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: [R, C / 8] int32 -> [R, C] uint8 values in [0, 15]."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * 4
    values = (packed.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [N, K] of the kvllm int4 layout (the reference of every W4A16 path)."""
    q = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    return (q - z) * s


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, k_per_split, num_groups, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    dtype = x_ptr.dtype.element_ty
    words_per_row = K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + offs_k) < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if GATHER:  # each word loaded once per value it holds (cache hits), no reshape
            packed = tl.load(
                qw_ptr + offs_n[:, None] * words_per_row + ((k + offs_k) // 8)[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0,
            )
            q = (packed >> (((k + offs_k) % 8) * 4)[None, :]) & 0xF
        else:
            kw = k // 8 + offs_kw
            packed = tl.load(
                qw_ptr + offs_n[:, None] * words_per_row + kw[None, :],
                mask=n_mask[:, None] & (kw < k_end // 8)[None, :],
                other=0,
            )
            q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
            q = tl.reshape(q, (BLOCK_N, BLOCK_K))
        if BLOCK_K <= GROUP_SIZE:  # one group per tile: a scale and a zero per column
            group = k // GROUP_SIZE
            s = tl.load(s_ptr + offs_n * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + offs_n * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        else:  # several groups per tile: gathered per value (repeated addresses, from the cache)
            group_ptrs = offs_n[:, None] * num_groups + ((k + offs_k) // GROUP_SIZE)[None, :]
            gmask = n_mask[:, None] & k_mask[None, :]
            s = tl.load(s_ptr + group_ptrs, mask=gmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group_ptrs, mask=gmask, other=0.0).to(tl.float32)
        # q as a float32 without an int-to-float conversion: the bits 0x4B000000 | q are 2^23 + q, and
        # (2^23 + q) - (2^23 + z) is exactly q - z; one rounding in the product, as the reference.
        w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)) * s
        if INTERPRET:
            # The interpreter's 16-bit dots are unreliable; float32 products of 16-bit values are exact.
            w = round_to(w, dtype, INTERPRET)
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        elif dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(dtype)), acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        partial_ptrs = partial_ptr + (pid_k * PARTIAL_ROWS + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(partial_ptrs, acc, mask=mask)


@dataclass(frozen=True)
class W4A16Config:
    """Launch parameters of the W4A16 kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gather: bool = False  # unpack by loading each word per value (True) or by a reshape (False)


def default_config(m: int, n: int, k: int, group_size: int) -> W4A16Config:
    """Small M: 16 rows, 64 columns, K split up to TARGET_PROGRAMS programs; large M: 64 or 128 rows."""
    block_k = min(128, group_size)
    if m <= SMALL_M:
        block_n = 64
        tiles = triton.cdiv(n, block_n)
        split = 1
        while tiles * split < TARGET_PROGRAMS and split * 2 <= min(MAX_SPLIT_K, k // block_k):
            split *= 2
        return W4A16Config(SMALL_M, block_n, block_k, split, num_warps=4, num_stages=4)
    if m <= 64:
        return W4A16Config(64, 64, block_k, num_warps=4, num_stages=4)
    return W4A16Config(128, 128, min(64, block_k), num_warps=8, num_stages=3)


def _check(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> None:
    if (
        x.dim() != 2
        or qweight.dim() != 2
        or qweight.dtype != torch.int32
        or qweight.shape[1] * PACK != x.shape[1]
    ):
        raise ValueError(
            f"w4a16 needs x [M, K] and an int32 qweight [N, K/8], got x {tuple(x.shape)} and qweight "
            f"{tuple(qweight.shape)} {qweight.dtype}"
        )
    k = x.shape[1]
    if group_size != k and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group size {group_size} must be a power of two >= 16, or K = {k}")
    groups = triton.cdiv(k, group_size)
    expected = (qweight.shape[0], groups)
    if scales.shape != expected or zeros.shape != expected:
        raise ValueError(
            f"scales and zeros must be [N, K/G] = {expected}, got {tuple(scales.shape)}, {tuple(zeros.shape)}"
        )


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W in the kvllm int4 layout; `perm` [K] gathers
    x's columns first (act order). The Triton kernel where fused ops are on, else dequantize + F.linear."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if perm is not None:
        x = x.index_select(1, perm)
    _check(x, qweight, scales, zeros, group_size)
    if not use_fused_ops(x):
        weight = dequantize(qweight, scales, zeros, group_size).to(x.dtype)
        return F.linear(x, weight, bias).reshape(*shape[:-1], -1)
    out = w4a16_triton(x.contiguous(), qweight, scales, zeros, group_size, bias, config)
    return out.reshape(*shape[:-1], -1)


def w4a16_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """The Triton W4A16 kernel on a contiguous x [M, K] (no checks beyond shapes; see w4a16_linear)."""
    from kvllm.layers.ops.linear import reduce_split_k

    _check(x, qweight, scales, zeros, group_size)
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    group_size = min(group_size, k)
    config = config or default_config(m, n, k, group_size)
    bk = config.block_k
    if (
        bk < 16
        or bk & (bk - 1)
        or (bk <= group_size and group_size % bk)
        or (bk > group_size and bk % group_size)
    ):
        raise ValueError(
            f"block_k {bk} must be a power of two >= 16 that divides the group size {group_size} or is a "
            "multiple of it"
        )
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    if split > 1 and m > SMALL_M:
        raise ValueError(f"split-K is for at most {SMALL_M} rows, got {m}")
    partial = torch.empty((split, SMALL_M, n), dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else scales
    interpret = interpreting()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, bias_arg, out, partial,
        m, n, k, k_per_split, scales.shape[1], x.stride(0) if m > 1 else k, out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        PARTIAL_ROWS=SMALL_M,
        HAS_BIAS=bias is not None,
        GATHER=config.gather,
        INTERPRET=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_split_k(partial, bias, out, split, SMALL_M)
    return out
