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

Routes (`w4a16_linear`, fused ops on): the tensor-core GEMM for MMA_GEMM_MIN_ROWS to MMA_GEMM_MAX_ROWS rows
where it can run (w4a16_gemm_mma.py: 16-bit x, K and groups in multiples of 128); else the GEMV for up to 4
rows (w4a16_gemv.py), this module's Triton GEMM up to DEQUANT_MIN_ROWS - 1 rows, then dequantize + cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, interpreting, round_to
from kvllm.layers.ops.dispatch import use_fused_ops
from kvllm.layers.quantization.ops.int4_layout import PACK, block_words, dequantize

SMALL_M = 16
# From this many rows (those the tensor-core GEMM does not take): dequantize the weight, then cuBLAS. H100 probe (nineteenth session, Llama-3-8B
# projections): at 32 and 64 rows the Triton GEMM with split K is 2.0-2.7x faster than dequantize + cuBLAS
# (at 64 rows without split K and 64 columns it was 1.4-2.1x slower: the H200 sweep that set 17 here).
DEQUANT_MIN_ROWS = 65
# From MMA_GEMM_MIN_ROWS to MMA_GEMM_MAX_ROWS rows: the tensor-core GEMM (w4a16_gemm_mma.py) where it can
# run (16-bit x, K and the group size multiples of 128), before the routes above. H100 sweeps (Llama-3-8B's
# projections): 1.5-4.0x faster than those routes from 8 to 256 rows, 1.05-1.4x at 512; at 1,024 rows
# dequantize + cuBLAS is as fast or faster (0.85-1.04x), at 2,048 faster (0.69-0.86x) (twenty-eighth
# session); at 2 and 4 rows 1.7-5.8x faster than the GEMV, which keeps one row (twenty-ninth).
MMA_GEMM_MIN_ROWS = 2
MMA_GEMM_MAX_ROWS = 512
TARGET_PROGRAMS = 264  # two per SM on an H200


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, k_per_split, num_groups, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BW: tl.constexpr,
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
    offs_kw = (tl.arange(0, BLOCK_K // (8 * BW)) * BW)[:, None] + tl.arange(0, BW)[None, :]  # [blocks, BW]
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
            kk = k + offs_k  # value kk: word (block, kk % BW), nibble (kk % (8 BW)) // BW
            packed = tl.load(
                qw_ptr + offs_n[:, None] * words_per_row + ((kk // (8 * BW)) * BW + kk % BW)[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0,
            )
            q = (packed >> (((kk % (8 * BW)) // BW) * 4)[None, :]) & 0xF
        else:  # whole blocks: [BLOCK_N, blocks, 8 nibbles, BW words] is the tile in K order
            kw = k // 8 + offs_kw
            packed = tl.load(
                qw_ptr + offs_n[:, None, None] * words_per_row + kw[None, :, :],
                mask=n_mask[:, None, None] & (kw < k_end // 8)[None, :, :],
                other=0,
            )
            q = (packed[:, :, None, :] >> shifts[None, None, :, None]) & 0xF
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


@triton.jit
def _dequantize_kernel(
    qw_ptr, s_ptr, z_ptr, out_ptr, N, K, num_groups,
    GROUP_SIZE: tl.constexpr,
    BW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NBT: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_N columns x NBT layout blocks, written as [BLOCK_N, NBT, 8 nibbles, BW words].
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * NBT + tl.arange(0, NBT)
    b = tl.arange(0, BW)
    j = tl.arange(0, 8)
    n4 = offs_n[:, None, None, None]
    mask = (n4 < N) & (blk * (8 * BW) < K)[None, :, None, None]
    words = tl.load(qw_ptr + n4 * (K // 8) + (blk * BW)[None, :, None, None] + b[None, None, None, :],
                    mask=mask, other=0)  # fmt: skip
    q = (words >> (j * 4)[None, None, :, None]) & 0xF
    k = (blk * (8 * BW))[None, :, None, None] + (j * BW)[None, None, :, None] + b[None, None, None, :]
    g = n4 * num_groups + k // GROUP_SIZE
    s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
    w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)) * s
    tl.store(out_ptr + n4 * K + k, cast_to(w, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def dequantize_triton(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    block_n: int = 8,
    values_per_row: int = 512,  # K values of a row per program (rounded to whole layout blocks)
    num_warps: int = 4,
) -> torch.Tensor:
    """`dequantize` rounded to `dtype`, one Triton launch: the weight [N, K] for cuBLAS. The default launch
    shape was the H100 probe's fastest on Llama-3-8B's projections (1.3-1.5 TB/s; 16 x 256 values with 4
    warps, the one before, ran at 0.9-1.2)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    bw = block_words(k)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n == 0:
        return out
    nbt = max(1, values_per_row // (PACK * bw))
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // (PACK * bw), nbt))
    _dequantize_kernel[grid](
        qweight, scales, zeros, out, n, k, scales.shape[1],
        GROUP_SIZE=min(group_size, k), BW=bw, BLOCK_N=block_n, NBT=nbt, INTERPRET=interpreting(),
        num_warps=num_warps,
    )  # fmt: skip
    return out


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
    """Up to 16 rows: 16 rows, 32 columns, K split 4 ways below 4 * TARGET_PROGRAMS column tiles (the H200
    sweep's best at M = 16 on Llama-3-8B qkv and o: 1.4-2.8x faster than 64 columns). Up to 32 rows: 32 x 32
    tiles, K split 4 ways below TARGET_PROGRAMS tiles, else 2; up to 64 rows: 64 x 128 tiles, K split into the
    most of 1, 2, 4, 8 that keeps the programs within TARGET_PROGRAMS (the H100 probe's best or within 6% of
    it on each Llama-3-8B projection; 64-column tiles ran 2-4x slower at every split). More rows: 128 x 128,
    for explicit configs (the dispatch dequantizes there). K tiles of whole layout blocks (128 values), or one
    group where groups are longer."""
    block_k = max(PACK * block_words(k), min(128, group_size))
    blocks = max(1, k // block_k)
    if m <= SMALL_M:
        block_n = 32
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(4, blocks)) if tiles < 4 * TARGET_PROGRAMS else 1
        return W4A16Config(SMALL_M, block_n, block_k, split, num_warps=4, num_stages=4)
    if m <= 32:
        split = 4 if triton.cdiv(n, 32) < TARGET_PROGRAMS else 2
        return W4A16Config(32, 32, block_k, min(split, blocks), num_warps=4, num_stages=3)
    if m <= 64:
        tiles = triton.cdiv(n, 128)
        split = 1
        while split < 8 and tiles * split * 2 <= TARGET_PROGRAMS and split * 2 <= blocks:
            split *= 2
        return W4A16Config(64, 128, block_k, split, num_warps=4, num_stages=3)
    return W4A16Config(128, 128, block_k, num_warps=8, num_stages=3)


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
    x's columns first (act order). Where fused ops are on: the tensor-core GEMM from MMA_GEMM_MIN_ROWS to
    MMA_GEMM_MAX_ROWS where it can run; else the GEMV for up to 4 rows, the Triton GEMM for up to
    DEQUANT_MIN_ROWS - 1, then the dequantized weight through cuBLAS (`config` forces the Triton GEMM). Else
    dequantize + F.linear."""
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import w4a16_gemm_mma
    from kvllm.layers.quantization.ops.w4a16_gemv import MAX_ROWS, w4a16_gemv

    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if perm is not None:
        x = x.index_select(1, perm)
    _check(x, qweight, scales, zeros, group_size)
    if not use_fused_ops(x):
        weight = dequantize(qweight, scales, zeros, group_size).to(x.dtype)
        return F.linear(x, weight, bias).reshape(*shape[:-1], -1)
    x = x.contiguous()
    m = x.shape[0]
    # Groups shorter than a 128-value block would need the GEMM's multi-group tiles, which no GPU run
    # has checked: those layers dequantize instead.
    if config is None and _mma_gemm_takes(x, group_size):
        out = w4a16_gemm_mma(x, qweight, scales, zeros, group_size, bias)
    elif config is not None or (MAX_ROWS < m < DEQUANT_MIN_ROWS and group_size >= 128):
        out = w4a16_triton(x, qweight, scales, zeros, group_size, bias, config)
    elif m <= MAX_ROWS:
        out = w4a16_gemv(x, qweight, scales, zeros, group_size, bias)
    else:
        out = F.linear(x, dequantize_triton(qweight, scales, zeros, group_size, x.dtype), bias)
    return out.reshape(*shape[:-1], -1)


def _mma_gemm_takes(x: torch.Tensor, group_size: int) -> bool:
    """Whether w4a16_linear sends x [M, K] (fused ops on) to the tensor-core GEMM."""
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import mma_gemm_refusal

    if not MMA_GEMM_MIN_ROWS <= x.shape[0] <= MMA_GEMM_MAX_ROWS:
        return False
    return not mma_gemm_refusal(x, x.shape[1], group_size)


def w4a16_silu_and_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """silu(gate) * up of a gate_up projection (W's rows: gate, then up) in one GEMV launch, for up to
    4 rows of x [M, K] where fused ops are on; None where that kernel does not apply, or where the
    tensor-core GEMM takes the rows (w4a16_linear, then the activation, is faster there)."""
    from kvllm.layers.quantization.ops.w4a16_gemv import MAX_ROWS, w4a16_gemv_silu_and_mul

    if not use_fused_ops(x) or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return None
    if _mma_gemm_takes(x, group_size):
        return None
    if perm is not None:
        x = x.index_select(1, perm)
    return w4a16_gemv_silu_and_mul(x.contiguous(), qweight, scales, zeros, group_size, bias)


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
    block = PACK * block_words(k)
    if (
        bk < 16
        or bk & (bk - 1)
        or (bk <= group_size and group_size % bk)
        or (bk > group_size and bk % group_size)
        or (not config.gather and bk % block)
    ):
        raise ValueError(
            f"block_k {bk} must be a power of two >= 16 that divides the group size {group_size} or is a "
            f"multiple of it, and (without gather) a multiple of the layout's {block}-value block"
        )
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    # Rows of each split's float32 partial: a power of two (one compile per size class, not per M).
    partial_rows = max(SMALL_M, triton.next_power_of_2(m))
    partial = (
        torch.empty((split, partial_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    )
    bias_arg = bias if bias is not None else scales
    interpret = interpreting()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, bias_arg, out, partial,
        m, n, k, k_per_split, scales.shape[1], x.stride(0) if m > 1 else k, out.stride(0),
        GROUP_SIZE=group_size,
        BW=block // PACK,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        PARTIAL_ROWS=partial_rows,
        HAS_BIAS=bias is not None,
        GATHER=config.gather,
        INTERPRET=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_split_k(partial, bias, out, split, partial_rows)
    return out
