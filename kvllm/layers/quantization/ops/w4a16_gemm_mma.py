"""The W4A16 GEMM on tensor cores for 2 rows and more: y = x @ dequant(W)^T (+ bias), with W's columns
as the MMA's M dimension (the A operand, built in registers from the packed words) and x's rows as its N
(the B operand, copied into shared memory by Triton's pipeline and read there by the MMA).

Reference: `dequantize` (int4_layout.py), rounded to x's dtype, then a float32 matmul: the same products
as dequantize + F.linear, since each weight is rounded once, to the value the dequantize path uses.

- Nibble pair p of a word (nibbles p and p + 4) becomes one A register of two 16-bit floats: a shift and
  a `lop3` put the nibbles into the mantissas of the magic constant M (128 in bfloat16, 1024 in float16,
  where the spacing is 1), so the register holds M + q exactly; one packed FMA subtracts M + z (exact: the
  difference is the integer q - z, and zero points are integers 0..16), one more multiplies by the scale
  (the one rounding). Four instructions for two weight values, all in registers; the MMA accumulates
  straight into the output tile (no per-group correction of its result, unlike the GEMV).
- The A tile of pair p has K index 2c + e for word c's nibble p + 4e; in the layout (a 128-value block
  of 16 words, nibble j of word c holding value 16 j + c) that is value 16 p + 64 e + c. The activations
  are permuted once per call into that order (`permute_for_pairs`: one copy of x), so the four B tiles
  of a block are four contiguous 32-value slices of the permuted row, which the pipeline copies as they
  are: no shuffles of x in the loop, unlike the GEMV (w4a16_gemv_mma.py, too few rows for a copy to pay).
  In the compiled loop (sm_90) each of the four dots is waited on before the next pair is decoded, so the
  decode and the tensor cores take turns; `one_dot` stacks the four pair tiles in K order into one A
  operand of K = 128 (one MMA chain against one contiguous slice), whose MMAs issue back to back at 8
  warps in the SASS: 4-20% faster on an H100 up to 32 rows, 1-8% at 128-256 (twenty-ninth session), but
  slower on down's long K; the defaults use it where it wins.
- A tile is one 128-value block in one group (K and the group size are multiples of 128): one scale and
  one zero point per column and tile. K can be split over programs (float32 partials summed in a fixed
  order by linear.py's reduce kernel, as the Triton GEMM does).

Where it runs is `w4a16.py`'s `w4a16_linear`: from MMA_GEMM_MIN_ROWS to MMA_GEMM_MAX_ROWS, for bf16
and fp16 where `mma_gemm_refusal` has no objection. The default config (`default_mma_gemm_config`) follows
the H100 sweep (benchmarks/h200/w4a16_gemm_mma_sweep.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, interpreting, mma_dot
from kvllm.layers.quantization.ops.w4a16_gemv_mma import MMA_DTYPES

BLOCK_VALUES = 128  # values of a layout block: one tile's K


@dataclass(frozen=True)
class W4A16MMAConfig:
    """Launch parameters of the tensor-core GEMM: a [block_n columns x block_m rows] output tile per
    program, K split over `split_k` programs."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    one_dot: bool = False  # a tile's four pair tiles as one MMA chain of K = 128 (see the docstring)


def default_mma_gemm_config(m: int, n: int, k: int) -> W4A16MMAConfig:
    """Rules on the shape from the H100 sweeps of Llama-3-8B's projections (twenty-eighth session at M = 8
    .. 2,048; twenty-ninth at M = 2 .. 256 with `one_dot`; docs/benchmarks.md). "Long K" is K > 8,192
    (down), "wide" N > 8,192 (gate_up).
    - Up to 16 rows: a 16-row tile of 256 columns over 8 warps as one MMA chain (`one_dot`), K split 4
      ways (wide: unsplit); long K: 64 columns over 4 warps, K split 4 ways.
    - 17 to 64 rows: the smallest row tile that holds them, 64 columns (128 from 33 rows on N > 4,096), K
      split 4 ways; wide: 256 columns over 8 warps unsplit (one chain up to 32 rows).
    - From 65 rows: 128-row tiles; 256 columns over 8 warps where N or M is large, K split 2-4 ways where
      N is small; one chain up to 256 rows except on long K."""
    blocks = k // BLOCK_VALUES
    long_k = k > 8192

    def split(want: int) -> int:
        while want > 1 and blocks % want:
            want //= 2
        return want

    if m <= 16 and not long_k:
        return W4A16MMAConfig(16, 256, 1 if n > 8192 else split(4), 8, 4, one_dot=True)
    if m <= 64:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        if n > 8192:
            if m <= 16:
                return W4A16MMAConfig(block_m, 128, split(4), 4, 4)
            if m <= 32:
                if long_k:
                    return W4A16MMAConfig(32, 128, 1, 4, 4)
                return W4A16MMAConfig(32, 256, 1, 8, 4, one_dot=True)
            return W4A16MMAConfig(64, 256, 1, 8, 3)
        return W4A16MMAConfig(block_m, 128 if m > 32 and n > 4096 else 64, split(4), 4, 4)
    if m <= 256 and n <= 8192:
        if m > 128 and not long_k:
            return W4A16MMAConfig(128, 256, split(2) if n > 4096 else split(4), 8, 3, one_dot=True)
        if m > 128 and n > 4096:
            return W4A16MMAConfig(128, 256, split(2), 8, 3)
        return W4A16MMAConfig(128, 128, split(4), 4, 3)
    if long_k:
        return W4A16MMAConfig(128, 128, split(2), 4, 3)
    return W4A16MMAConfig(128, 256, split(2) if m <= 512 and n <= 4096 else 1, 8, 3, one_dot=m <= 256)


def permute_for_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 128-value block reordered to the A tiles' K order: position 32 p + 2 c + e of a
    block holds value 16 p + 64 e + c (c < 16, p < 4, e < 2). One copy."""
    m, k = x.shape
    return x.view(m, k // BLOCK_VALUES, 2, 4, 16).permute(0, 1, 3, 4, 2).reshape(m, k)


@triton.jit
def _dequant_pair_asm(w2, zz, ss, one, neg_zero, SHIFT: tl.constexpr, MAGIC_BITS: tl.constexpr,
                      IS_BF16: tl.constexpr, like):  # fmt: skip
    """w2 [..., 2] int32 (each word twice) -> [..., 2] of like's dtype, one 32-bit register per pair:
    ((M + nibble) - (M + z)) * s for nibbles SHIFT / 4 and SHIFT / 4 + 4. zz holds -(M + z), ss the
    scale, `one` 1.0 and `neg_zero` -0.0, each in both halves (int32 bit patterns)."""
    shift = tl.full(w2.shape, SHIFT, tl.int32)
    magic = tl.full(w2.shape, MAGIC_BITS, tl.int32)
    if IS_BF16:
        asm: tl.constexpr = (
            "{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 t, t, 0x000F000F, $5, 0xea; "
            "fma.rn.bf16x2 t, t, $9, $7; fma.rn.bf16x2 $0, t, $11, $13; }"
        )
    else:
        asm: tl.constexpr = (
            "{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 t, t, 0x000F000F, $5, 0xea; "
            "fma.rn.f16x2 t, t, $9, $7; fma.rn.f16x2 $0, t, $11, $13; }"
        )
    return tl.inline_asm_elementwise(
        asm,
        "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [w2, shift, magic, zz, one, ss, neg_zero],
        dtype=like.dtype,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _halves(v, DTYPE: tl.constexpr):
    """v [BLOCK_N] float32 -> int32 bit patterns with v in DTYPE in both 16-bit halves."""
    bits = v.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def _pair_tile(words, P: tl.constexpr, z, s, MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr, like,
               INTERPRET: tl.constexpr):  # fmt: skip
    """words [BLOCK_N, 16] -> the A tile [BLOCK_N, 32] of nibble pair P in like's dtype: column 2 c + e is
    (nibble P + 4 e of word c - z) * s, rounded once. z and s are [BLOCK_N] float32."""
    dtype: tl.constexpr = like.dtype
    if INTERPRET:
        lo = ((words >> (4 * P)) & 0xF).to(tl.float32)
        hi = ((words >> (4 * P + 16)) & 0xF).to(tl.float32)
        pair = cast_to((tl.join(lo, hi) - z[:, None, None]) * s[:, None, None], dtype, INTERPRET)
    else:
        shape: tl.constexpr = (words.shape[0], words.shape[1], 2)
        zz = tl.broadcast_to(_halves(-(z + MAGIC), dtype)[:, None, None], shape)
        ss = tl.broadcast_to(_halves(s, dtype)[:, None, None], shape)
        one = tl.full(shape, 0x3F803F80 if dtype == tl.bfloat16 else 0x3C003C00, tl.int32)
        neg_zero = tl.full(shape, 0x80008000, tl.int32)
        pair = _dequant_pair_asm(
            tl.join(words, words), zz, ss, one, neg_zero, 4 * P, MAGIC_BITS, dtype == tl.bfloat16, like
        )
    return tl.reshape(pair, (words.shape[0], 2 * words.shape[1]))


@triton.jit(do_not_specialize=["M", "num_groups"])
def _w4a16_gemm_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, stride_wn, num_groups, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
    ONE_DOT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # x is permute_for_pairs(x). Program (n tile, m tile, s) sums the s-th K / SPLIT_K values.
    BLOCK_K: tl.constexpr = 128
    C: tl.constexpr = BLOCK_K // 8  # words of a column in a tile
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
    MAGIC_BITS: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    k_len = K // SPLIT_K
    if SPLIT_K > 1:  # whole tiles (the launcher checks)
        k_start = tl.multiple_of(tl.program_id(2) * k_len, BLOCK_K)
    else:
        k_start = 0
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n = cols
    else:
        offs_n = tl.minimum(cols, N - 1)  # columns past N read column N - 1 and are not stored
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows past M read row M - 1 (never stored); tiles are whole, so no load needs a mask.
    qw_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_start // 8 + tl.arange(0, C)[None, :]
    X_ROWS: tl.constexpr = BLOCK_K if ONE_DOT else 32
    x_ptrs = (  # [X_ROWS, BLOCK_M]: a tile's permuted values (or a pair's), K-contiguous
        x_ptr
        + tl.minimum(rows, M - 1)[None, :].to(tl.int64) * stride_xm
        + k_start
        + tl.arange(0, X_ROWS)[:, None]
    )
    # The group factors come one tile ahead, in registers: 16-bit loads with a column stride, which
    # Triton's pipeline does not copy; loaded in the tile that uses them, each iteration waited for them.
    g_base = offs_n * num_groups
    last_group = g_base + (k_start + k_len - 1) // GROUP_SIZE
    s_next = tl.load(s_ptr + g_base + k_start // GROUP_SIZE)
    z_next = tl.load(z_ptr + g_base + k_start // GROUP_SIZE)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
        s = s_next.to(tl.float32)
        z = z_next.to(tl.float32)
        g_next = tl.minimum(g_base + (k_start + k0 + BLOCK_K) // GROUP_SIZE, last_group)
        s_next = tl.load(s_ptr + g_next)
        z_next = tl.load(z_ptr + g_next)
        words = tl.load(qw_ptrs)
        if ONE_DOT:  # the four pair tiles stacked in K order: one MMA chain of K = 128
            b = tl.load(x_ptrs + k0)  # [128, BLOCK_M]
            a0 = _pair_tile(words, 0, z, s, MAGIC, MAGIC_BITS, b, INTERPRET)
            a1 = _pair_tile(words, 1, z, s, MAGIC, MAGIC_BITS, b, INTERPRET)
            a2 = _pair_tile(words, 2, z, s, MAGIC, MAGIC_BITS, b, INTERPRET)
            a3 = _pair_tile(words, 3, z, s, MAGIC, MAGIC_BITS, b, INTERPRET)
            a = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [n, 32, a, b]: pair 2 b + a
            a = tl.reshape(tl.permute(a, (0, 3, 2, 1)), (BLOCK_N, BLOCK_K))
            acc = mma_dot(a, b, acc, INTERPRET)
        else:  # one dot of K = 32 per pair
            for p in tl.static_range(4):
                b = tl.load(x_ptrs + k0 + 32 * p)  # [32, BLOCK_M]: the permuted values 32 p .. 32 p + 31
                a = _pair_tile(words, p, z, s, MAGIC, MAGIC_BITS, b, INTERPRET)
                acc = mma_dot(a, b, acc, INTERPRET)
        qw_ptrs += C
    in_n = cols < N
    mask = in_n[:, None] & (rows < M)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=in_n, other=0).to(tl.float32)[:, None]
        ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
        tl.store(ptrs, cast_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
    else:
        part = partial_ptr + (tl.program_id(2) * PARTIAL_ROWS + rows[None, :]) * N + cols[:, None]
        tl.store(part, acc, mask=mask)


def _capability(x: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of x's CUDA device (None off CUDA, e.g. the interpreter's CPU tensors)."""
    return _device_capability(x.device.index or 0) if x.device.type == "cuda" else None


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:  # asked on every eager call: once per device
    return torch.cuda.get_device_capability(index)


def mma_gemm_refusal(
    x: torch.Tensor, k: int, group_size: int, config: W4A16MMAConfig | None = None
) -> str | None:
    """Why the tensor-core GEMM cannot run this call (with this config), or None."""
    if x.dtype not in MMA_DTYPES:
        return f"the tensor-core W4A16 GEMM needs x in {MMA_DTYPES}, got {x.dtype}"
    capability = _capability(x)
    if x.dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
        return (
            f"the tensor-core W4A16 GEMM needs SM 8.0+ for bfloat16 (packed bf16 FMAs), got SM {capability}"
        )
    if k % BLOCK_VALUES or group_size % BLOCK_VALUES:
        return (
            f"the tensor-core W4A16 GEMM needs K and the group size to be multiples of {BLOCK_VALUES}, got "
            f"K = {k}, group size {group_size}"
        )
    if config is not None:
        if config.block_m < 16 or config.block_m & (config.block_m - 1):
            return f"block_m must be a power of two >= 16, got {config.block_m}"
        if config.block_n % (16 * config.num_warps) or config.block_n & (config.block_n - 1):
            return f"block_n must be a power of two, a multiple of 16 x num_warps, got {config.block_n}"
        blocks = k // BLOCK_VALUES
        if config.split_k < 1 or blocks % config.split_k:
            return f"split_k {config.split_k} must divide K's {blocks} blocks of {BLOCK_VALUES} values"
    return None


def w4a16_gemm_mma(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: W4A16MMAConfig | None = None,
) -> torch.Tensor:
    """y [M, N] for a contiguous x [M, K] (shapes checked by the caller, w4a16.py's `_check`); raises
    ValueError with `mma_gemm_refusal`'s reason where it cannot run."""
    from kvllm.layers.ops.linear import reduce_split_k

    m, k = x.shape
    n = qweight.shape[0]
    group_size = min(group_size, k)
    reason = mma_gemm_refusal(x, k, group_size, config)
    if reason:
        raise ValueError(reason)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or default_mma_gemm_config(m, n, k)
    split = config.split_k
    # Rows of each split's float32 partial (rows past M are never stored): a power of two, so the kernel and
    # the reduce compile once per size class, not per M; 1 without a split (no partial).
    partial_rows = max(16, triton.next_power_of_2(m)) if split > 1 else 1
    partial = (
        torch.empty((split, partial_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    )
    xp = permute_for_pairs(x)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _w4a16_gemm_mma_kernel[grid](
        xp, qweight, scales, zeros, bias if bias is not None else scales, out, partial,
        m, n, k, qweight.stride(0), scales.shape[1], xp.stride(0), out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        EVEN_N=n % config.block_n == 0,
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        PARTIAL_ROWS=partial_rows,
        ONE_DOT=config.one_dot,
        NUM_STAGES=config.num_stages,
        INTERPRET=interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_split_k(partial, bias, out, split, partial_rows)
    return out
