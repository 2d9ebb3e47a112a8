"""The W4A16 GEMV on tensor cores: y = x @ dequant(W)^T (+ bias) for 1 to 4 rows of x, with W's
columns as the MMA's M dimension (16 per instruction) and x's rows, padded, as its N.

Reference: `dequantize` (int4_layout.py) and a float32 matmul. The CUDA-core kernel
(w4a16_gemv.py) spends about 3.2 SASS instructions on a weight value at one row (a mask, an FMA and
its share of the activations' handling); this one about 1.8 (sm_90, 64 columns per warp; the offline
compile test counts them), so an SM decodes about twice the weight bytes per issue slot:

- nibble pair p of a word (nibbles p and p + 4, bits 4p and 16 + 4p) becomes two 16-bit floats in one
  register with a shift and one `lop3`: the nibbles in the mantissas of the magic constant M (128 in
  bfloat16, 1024 in float16, where the spacing of representable values is 1), so the register holds
  M + q exactly, no conversion instruction;
- that register is one A-fragment register of the MMA: pair p of a tile's words is an A tile [columns,
  2 x words] whose K index 2c + e is word c's nibble p + 4e, and the activations are gathered to the
  same order (in registers: the tile of x is loaded whole and permuted, once per warp);
- the products (M + q) x are exact in the MMA's float32 accumulator; the offset and the zero point
  leave the sum once per group: sum (q - z) x = sum (M + q) x - (M + z) sum x, then the group's scale.
  The cancellation of M sum x costs about M * sum|x| * 2^-24 of the float32 sum, far below the
  output's 16-bit rounding;
- tiles lie within one group (block_k divides the group size), copied into shared memory by Triton's
  software pipeline (`num_stages`), as in the CUDA-core kernel; K can be split over programs
  (`split_k`: the last program of a column block sums the parts in split order).

It runs where a config says mma=True (a tuned table's entry, benchmarks/h200/w4a16_gemv_m1.py --set mma);
default_config never picks it: its first sweep (H100, docs/benchmarks.md) was not faster than the
CUDA-core kernel but on one shape.

The gated form (gate_up with SiLU) reads the gate and up tiles of the same columns against the same
activations and applies silu(gate) * up in the epilogue, rounding where the unfused path does.
Under the Triton interpreter the pair is built with plain integer and float ops (the inline PTX does
not run there), to the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, gated_silu, mma_dot

GROUP_VALUES = 128  # values of a tile's block: K and the group size must be multiples of it
MMA_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _pair_asm(w2, SHIFT: tl.constexpr, MAGIC_BITS: tl.constexpr, like):
    """w2 [..., 2] int32 (each word twice) -> [..., 2] of like's dtype: M + nibble p, M + nibble p + 4 of the
    word (SHIFT = 4p), in one 32-bit register (pack=2: element 0 in the low half). Operands: $1, $2
    the word (twice), $3, $4 the shift, $5, $6 M's bits in both halves."""
    shift = tl.full(w2.shape, SHIFT, tl.int32)
    magic = tl.full(w2.shape, MAGIC_BITS, tl.int32)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 $0, t, 0x000F000F, $5, 0xea; }",
        "=r,r,r,r,r,r,r",
        [w2, shift, magic],
        dtype=like.dtype,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _pair_tile(words, P: tl.constexpr, MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr, like,
               INTERPRET: tl.constexpr):  # fmt: skip
    """words [BLOCK_N, C] -> the A tile [BLOCK_N, 2C] of nibble pair P in like's dtype: column 2c + e
    is M + nibble P + 4e of word c."""
    if INTERPRET:
        lo = ((words >> (4 * P)) & 0xF).to(tl.float32) + MAGIC
        hi = ((words >> (4 * P + 16)) & 0xF).to(tl.float32) + MAGIC
        pair = tl.join(lo, hi).to(like.dtype)
    else:
        pair = _pair_asm(tl.join(words, words), 4 * P, MAGIC_BITS, like)
    return tl.reshape(pair, (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _x_pairs(xt, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations tile [BLOCK_M, BLOCK_K] as the B tiles of the four nibble pairs, [2C, BLOCK_M]
    each: row 2c + e of pair p is x at k = 128 * (c // 16) + 16 * (p + 4e) + c % 16 (the layout's
    nibble p + 4e of the tile's word c)."""
    blocks: tl.constexpr = BLOCK_K // 128
    t = tl.reshape(xt, (BLOCK_M, blocks, 2, 4, 16))  # m, block, e, p, b
    t = tl.permute(t, (3, 0, 1, 4, 2))  # p, m, block, b, e
    t = tl.reshape(t, (2, 2, BLOCK_M, BLOCK_K // 4))  # p // 2, p % 2, m, 2c + e
    t = tl.permute(t, (2, 3, 0, 1))
    even, odd = tl.split(t)  # p % 2 == 0 / 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return tl.trans(x0), tl.trans(x1), tl.trans(x2), tl.trans(x3)


@triton.jit
def _group_sum(words, x0, x1, x2, x3, x_sum, s, z, MAGIC: tl.constexpr, MAGIC_BITS: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """sum over the tile of (q - z) * s * x: [BLOCK_N, BLOCK_M] float32 (the tile lies in one group)."""
    acc = mma_dot(_pair_tile(words, 0, MAGIC, MAGIC_BITS, x0, INTERPRET), x0, None, INTERPRET)
    acc = mma_dot(_pair_tile(words, 1, MAGIC, MAGIC_BITS, x1, INTERPRET), x1, acc, INTERPRET)
    acc = mma_dot(_pair_tile(words, 2, MAGIC, MAGIC_BITS, x2, INTERPRET), x2, acc, INTERPRET)
    acc = mma_dot(_pair_tile(words, 3, MAGIC, MAGIC_BITS, x3, INTERPRET), x3, acc, INTERPRET)
    return s[:, None] * (acc - (z + MAGIC)[:, None] * x_sum[None, :])


@triton.jit
def _factors(s_ptr, z_ptr, g, up_groups, GATED: tl.constexpr):
    """The scales and zeros at group offsets g (and the up rows' at g + up_groups when GATED; zeros
    otherwise), in float32."""
    s = tl.load(s_ptr + g).to(tl.float32)
    z = tl.load(z_ptr + g).to(tl.float32)
    if GATED:
        s_up = tl.load(s_ptr + up_groups + g).to(tl.float32)
        z_up = tl.load(z_ptr + up_groups + g).to(tl.float32)
    else:
        s_up = tl.zeros_like(s)
        z_up = tl.zeros_like(z)
    return s, z, s_up, z_up


@triton.jit
def _finish(y, up, bias_ptr, out_ptr, cols, rows, N, M, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
            INTERPRET: tl.constexpr):  # fmt: skip
    """Bias, the gated epilogue and the store of [BLOCK_N, BLOCK_M] sums (rows past M and columns past
    N are not stored)."""
    in_n = cols < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=in_n, other=0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=in_n, other=0).to(tl.float32)[:, None]
        y = gated_silu(y, up, dtype, INTERPRET)
    ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
    tl.store(ptrs, cast_to(y, dtype, INTERPRET), mask=in_n[:, None] & (rows < M)[None, :])


@triton.jit(do_not_specialize=["M", "num_groups"])
def _w4a16_gemv_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, stride_wn, num_groups, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # GATED: N is the output width d; the weight has 2d rows (gate, then up), out gets silu(gate) * up.
    # SPLIT_K > 1: program (pid, s) sums the s-th K / SPLIT_K values of its columns.
    C: tl.constexpr = BLOCK_K // 8  # words of a column in a tile
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
    MAGIC_BITS: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    pid = tl.program_id(0)
    k_len = K // SPLIT_K
    if SPLIT_K > 1:  # whole tiles (the launcher checks)
        k_start = tl.multiple_of(tl.program_id(1) * k_len, BLOCK_K)
    else:
        k_start = 0
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n = cols
    else:
        offs_n = tl.minimum(cols, N - 1)  # columns past N read column N - 1 and are not stored
    rows = tl.arange(0, BLOCK_M)
    words_k = tl.arange(0, C)
    x_k = tl.arange(0, BLOCK_K)
    qw_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_start // 8 + words_k[None, :]
    # Rows past M read row M - 1 (never stored); tiles are whole (block_k divides the group size, and
    # the split cuts K into whole tiles), so no load needs a mask.
    x_ptrs = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm + x_k[None, :]
    g_ptrs = offs_n * num_groups
    up_words = N.to(tl.int64) * stride_wn
    up_groups = N * num_groups
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The group factors come one tile ahead, in registers: 16-bit loads with a column stride, which
    # Triton's pipeline does not copy. Loaded in the tile that used them, their latency held up every
    # iteration (the twenty-seventh session's H100 sweep: 0.24-1.98 TB/s, rising with the programs in
    # flight); two tiles ahead, Triton dropped the shared-memory pipeline of the weight tiles.
    last_group = g_ptrs + (k_start + k_len - 1) // GROUP_SIZE
    s_next, z_next, s_up_next, z_up_next = _factors(
        s_ptr, z_ptr, g_ptrs + k_start // GROUP_SIZE, up_groups, GATED
    )
    for k0 in tl.range(k_start, k_start + k_len, BLOCK_K, num_stages=NUM_STAGES):
        s = s_next
        z = z_next
        s_up = s_up_next
        z_up = z_up_next
        s_next, z_next, s_up_next, z_up_next = _factors(
            s_ptr, z_ptr, tl.minimum(g_ptrs + (k0 + BLOCK_K) // GROUP_SIZE, last_group), up_groups, GATED
        )
        xt = tl.load(x_ptrs + k0)
        words = tl.load(qw_ptrs)
        x0, x1, x2, x3 = _x_pairs(xt, BLOCK_M, BLOCK_K)
        x_sum = tl.sum(xt.to(tl.float32), axis=1)
        acc += _group_sum(words, x0, x1, x2, x3, x_sum, s, z, MAGIC, MAGIC_BITS, INTERPRET)
        if GATED:
            words_up = tl.load(qw_ptrs + up_words)
            acc_up += _group_sum(words_up, x0, x1, x2, x3, x_sum, s_up, z_up, MAGIC, MAGIC_BITS, INTERPRET)
        qw_ptrs += C
    if SPLIT_K > 1:
        # Park the part sums in this program's slice of the workspace [SPLIT_K, BLOCK_M, 2N], take a
        # ticket; the SPLIT_K-th to arrive sums the slices in split order (the same bits on every call),
        # stores, and puts the ticket back to zero for the next call (and CUDA-graph replays).
        split_stride = BLOCK_M * 2 * N
        part = ws_ptr + tl.program_id(1) * split_stride + rows[None, :] * (2 * N) + cols[:, None]
        in_n = (cols < N)[:, None]
        tl.store(part, acc, mask=in_n)
        if GATED:
            tl.store(part + N, acc_up, mask=in_n)
        tl.debug_barrier()  # every thread's parts precede the ticket (released with it)
        ticket = tl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            first = ws_ptr + rows[None, :] * (2 * N) + cols[:, None]
            for split in tl.static_range(SPLIT_K):  # other SMs wrote them: bypass L1 (.cg)
                acc += tl.load(first + split * split_stride, mask=in_n, other=0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(
                        first + split * split_stride + N, mask=in_n, other=0, cache_modifier=".cg"
                    )
            _finish(acc, acc_up, bias_ptr, out_ptr, cols, rows, N, M, stride_om, HAS_BIAS, GATED, INTERPRET)
            tl.atomic_xchg(ticket_ptr + pid, 0)
    else:
        _finish(acc, acc_up, bias_ptr, out_ptr, cols, rows, N, M, stride_om, HAS_BIAS, GATED, INTERPRET)


def mma_refusal(
    x: torch.Tensor, k: int, group_size: int, block_n: int, block_k: int, num_warps: int
) -> str | None:
    """Why the tensor-core GEMV cannot run this call with this config, or None."""
    if x.dtype not in MMA_DTYPES:
        return f"the tensor-core W4A16 GEMV (mma=True) needs x in {MMA_DTYPES}, got {x.dtype}"
    if k % GROUP_VALUES or group_size % GROUP_VALUES:
        return (
            f"mma=True needs K and the group size to be multiples of {GROUP_VALUES}, got K = {k}, "
            f"group size {group_size}"
        )
    if block_k < GROUP_VALUES or block_k & (block_k - 1) or group_size % block_k:
        return (
            f"mma=True needs block_k a power of two >= {GROUP_VALUES} dividing the group size {group_size} "
            f"(a tile within one group), got {block_k}"
        )
    if block_n % (16 * num_warps):
        return (
            f"mma=True needs block_n a multiple of 16 x num_warps (16 columns per MMA per warp), got "
            f"block_n {block_n} with {num_warps} warps"
        )
    return None


def launch_mma(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None, out: torch.Tensor, gated: bool, block_m: int, block_n: int, block_k: int,
    num_warps: int, num_stages: int, split: int, workspace: torch.Tensor, tickets: torch.Tensor,
    interpret: bool,
) -> None:  # fmt: skip
    """Launch the kernel into `out` [M, N] (operands checked by the caller, the config by mma_refusal)."""
    m, k = x.shape
    n = out.shape[1]
    _w4a16_gemv_mma_kernel[(triton.cdiv(n, block_n), split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, workspace, tickets,
        m, n, k, qweight.stride(0), scales.shape[1],
        x.stride(0) if m > 1 else k,
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=n % block_n == 0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        SPLIT_K=split,
        NUM_STAGES=num_stages,
        INTERPRET=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
