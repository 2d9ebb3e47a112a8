"""W4A16 GEMV: y = x @ dequant(W)^T (+ bias) for 1 to 4 rows of x (decode), one Triton launch, no reduce.

Reference: `dequantize` (int4_layout.py) and a float32 matmul. At these row counts the layer is a read
of its packed weight, and with 4-bit values the CUDA cores' instruction issue, not the FMAs, is what
keeps a kernel off HBM bandwidth: a bfloat16 stream delivers one weight per 2 bytes, this one per half
byte, so each value gets a quarter of the instructions. The kernel spends about 3.4 SASS instructions
on a value at one row (sm_90, 8 columns per program; 3.0 at 16), 1.1 of them outside the decode and FMA:

- a program owns BLOCK_N output columns and the whole of K (as kvllm/layers/ops/gemv.py's bf16 GEMV:
  small programs, enough of them for any width), or 2 x BLOCK_N read as two weight streams (`paired`,
  the gated kernel's loop; the default at one row), or its columns' K / split_k values (`split_k`: the
  last program of a column block sums the parts, in split order);
- it loads [BLOCK_N, blocks, B / 4, 4] words (16-byte vectors along K) and reads nibble j of every
  word in place: `w & (0xF << 4p)` viewed as a float32 is the subnormal q * 2^(4p - 149), one logic
  op per value, and the FMA with x * 2^(100 - 4p) (scaled once per activation, shared by the
  columns) adds q * x * 2^-49 (p = j, or j - 3 in the word shifted by 12 for j >= 5);
- the zero point leaves the sum: sum (q - z) x = sum q x - z sum x, and the group scale multiplies
  each thread's part of a block's sum, in registers (a block lies in one group when the group size
  is a multiple of its 8 * B values; otherwise each nibble's group is scaled apart); the sum across
  threads runs once, after the loop;
- in the kvllm layout (int4_layout.py) nibble j of a block's B words meets B consecutive activations:
  x is a vector load in the same register layout as the words (the [.., 4] last dimension makes
  Triton pick it for both), and the scales and zeros are loaded in the shape of the per-thread sums
  ([BLOCK_N, blocks, B / 4]), so nothing is converted between layouts in the loop;
- the K loop is software-pipelined by Triton (`num_stages`: tiles copied into shared memory with
  cp.async, stages - 1 in flight while one is decoded), which keeps enough of the weight in flight per
  SM: carried in registers instead, ptxas issued the next tile's loads only after most of the
  current tile's arithmetic.

With `prefetch` (off by default: 10-20% slower on an H100), each program first asks the L2 for its
columns' whole weight, scale and zero rows (sm_90's bulk prefetch, one instruction per row: fire and
forget, no registers); under programmatic dependent launch (kvllm/utils/pdl.py) that comes before the
wait for the previous kernel, whose tail it overlaps, and every load comes after it (the pipeline's
first tiles load x too). Launch configs per GPU model come from a tuned table (TUNED_CONFIGS), else
`default_config`.

Accumulation is in float32 throughout; the dequantized weight is never rounded to 16 bits, so results
are the float32 product of x with the exact dequantized weight, rounded once.

`w4a16_gemv_silu_and_mul` runs a fused gate_up projection (2d output rows: gate, then up) and applies
silu(gate) * up in the epilogue, rounding where the unfused path does (projection, silu, product).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvllm.layers.ops.common import cast_to, gated_silu, interpreting
from kvllm.layers.quantization.ops.int4_layout import PACK, block_words
from kvllm.layers.quantization.ops.w4a16_gemv_mma import launch_mma, mma_refusal
from kvllm.utils.pdl import pdl_enabled, pdl_launch_options, wait_for_previous_kernel

MAX_ROWS = 4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Nibble j of a word is read in place, at bits 4p .. 4p + 3 of the word (p = j for j <= 4) or of the
# word shifted right by 12 (p = j - 3 for j >= 5): as a float32 those bits are the subnormal
# q * 2^(4p - 149). x is scaled by 2^(100 - 4p), so each product is q * x * 2^-49, a normal float for
# any |x| > 2^-77 (smaller ones contribute below 2^-126), and x * 2^100 stays finite for |x| < 2^27.
# FMAs take subnormal inputs at full rate; Triton compiles them without flush-to-zero.
UNSCALE: tl.constexpr = tl.constexpr(2.0**49)
RESCALE: tl.constexpr = tl.constexpr(2.0**-49)


@triton.jit
def _load(ptrs, mask):
    """tl.load, masked with zeros where `mask` is given (None: every address is in bounds)."""
    if mask is None:
        value = tl.load(ptrs)
    else:
        value = tl.load(ptrs, mask=mask, other=0)
    return value


@triton.jit
def _nibble(src, P: tl.constexpr):
    """The 4 bits at 4P .. 4P + 3 of `src` in place, read as a float32: q * 2^(4P - 149) exactly (a
    subnormal; FMAs take them at full rate and do not flush them)."""
    return (src & (0xF << (4 * P))).to(tl.float32, bitcast=True)


@triton.jit
def _x_scale(J: tl.constexpr):
    """2^(100 - 4p) for nibble J, read at bits 4p: products come out scaled by 2^-49."""
    if J == 0:
        c = 1.2676506002282294e30  # p = 0
    elif J == 1:
        c = 7.922816251426434e28  # p = 1
    elif J == 2 or J == 5:
        c = 4.951760157141521e27  # p = 2
    elif J == 3 or J == 6:
        c = 3.094850098213451e26  # p = 3
    else:
        c = 1.9342813113834067e25  # p = 4
    return c


@triton.jit
def _weights(qw_ptrs, s_ptrs, z_ptrs, w_mask, g_mask, PER_NIBBLE: tl.constexpr, TILE: tl.constexpr,
             FLAT: tl.constexpr):  # fmt: skip
    """A tile's words as TILE [BLOCK_N, blocks, BW / V, V] and, unless groups are smaller than a block,
    each block's scale and zero. FLAT: the words come as [BLOCK_N, blocks x BW], reshaped after the load."""
    words = _load(qw_ptrs, w_mask)
    if FLAT:
        words = tl.reshape(words, TILE)
    if PER_NIBBLE:  # loaded per nibble in _tile_sum
        s = tl.zeros((words.shape[0], words.shape[1], words.shape[2]), dtype=tl.float32)
        z = tl.zeros((words.shape[0], words.shape[1], words.shape[2]), dtype=tl.float32)
    else:
        s = _load(s_ptrs, g_mask).to(tl.float32)
        z = _load(z_ptrs, g_mask).to(tl.float32)
    return words, s, z


@triton.jit
def _prefetch_rows_l2(ptrs, nbytes):
    """Ask the L2 for `nbytes` bytes at each of `ptrs` (sm_90's bulk prefetch: fire and forget, no
    register holds the data, nothing waits for it). `nbytes` and the addresses are multiples of 16."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _split4(t):
    """[..., 4] (held by one thread) -> its four [...] slices (for V < 4: the V slices, repeated)."""
    if t.shape[3] == 4:
        a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2], 2, 2)))
        t0, t2 = tl.split(a)
        t1, t3 = tl.split(b)
    elif t.shape[3] == 2:
        t0, t1 = tl.split(t)
        t2 = tl.zeros_like(t0)
        t3 = tl.zeros_like(t0)
    else:
        t0 = tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2]))
        t1 = tl.zeros_like(t0)
        t2 = tl.zeros_like(t0)
        t3 = tl.zeros_like(t0)
    return t0, t1, t2, t3


@triton.jit
def _fma4(w0, w1, w2, w3, x0, x1, x2, x3, acc, P: tl.constexpr):
    """acc + the four words' nibbles at 4P (as subnormals) times their activations, one FMA chain."""
    acc = tl.fma(_nibble(w0, P), x0, acc)
    acc = tl.fma(_nibble(w1, P), x1, acc)
    acc = tl.fma(_nibble(w2, P), x2, acc)
    acc = tl.fma(_nibble(w3, P), x3, acc)
    return acc


@triton.jit
def _tile_sum(words, hi, x_ptrs, x_mask, s, z, s_ptrs, z_ptrs, g_mask,
              BW: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_NIBBLE: tl.constexpr):  # fmt: skip
    """sum over the tile's values of (q - zero) * scale * x * 2^-49, for one row of x: [BLOCK_N, blocks,
    BW / V], each thread's part (summed over its V words, not across threads: that and the factor 2^49
    come once, at the end).

    x_ptrs [1, blocks, BW / V, V] point at nibble 0's activations of each block; nibble j's are j * BW
    further. The zero is taken out of the sum: sum (q - z) x = sum q x - z sum x. Without PER_NIBBLE a
    block lies in one group: `s` and `z` [BLOCK_N, blocks, BW / V] are its scale and zero. With it (groups smaller than a block) nibble j of a block is in the group
    `(j * BW) // GROUP_SIZE` after the block's first, loaded here from s_ptrs / z_ptrs."""
    out = tl.zeros((words.shape[0], words.shape[1], words.shape[2]), dtype=tl.float32)
    if PER_NIBBLE:
        for j in tl.static_range(8):
            x = _load(x_ptrs + j * BW, x_mask).to(tl.float32)
            if j <= 4:
                q = _nibble(words, j)
            else:
                q = _nibble(hi, j - 3)
            zj = _load(z_ptrs + (j * BW) // GROUP_SIZE, g_mask).to(tl.float32)
            sj = _load(s_ptrs + (j * BW) // GROUP_SIZE, g_mask).to(tl.float32)
            qx = tl.sum(q * (x * _x_scale(j)), axis=3)
            out += (qx - zj * (tl.sum(x, axis=3) * RESCALE)) * sj
    else:
        # The V words of a thread as V tensors of one register each: one FMA chain per column and
        # block carries the sum over the words and nibbles, with no sum over V afterwards.
        w0, w1, w2, w3 = _split4(words)
        h0, h1, h2, h3 = _split4(hi)
        acc = tl.zeros(out.shape, dtype=tl.float32)
        x_sum = tl.zeros((1, words.shape[1], words.shape[2]), dtype=tl.float32)
        for j in tl.static_range(8):
            x0, x1, x2, x3 = _split4(_load(x_ptrs + j * BW, x_mask).to(tl.float32))
            x_sum += (x0 + x1) + (x2 + x3)
            c = _x_scale(j)
            if j <= 4:
                acc = _fma4(w0, w1, w2, w3, x0 * c, x1 * c, x2 * c, x3 * c, acc, j)
            else:
                acc = _fma4(h0, h1, h2, h3, x0 * c, x1 * c, x2 * c, x3 * c, acc, j - 3)
        out = (acc - z * (x_sum * RESCALE)) * s
    return out


@triton.jit
def _store_row(acc, acc_up, bias_ptr, out_ptr, offs_n, cols, N, M, ROW: tl.constexpr,
               HAS_BIAS: tl.constexpr, GATED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * UNSCALE
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        up = tl.sum(tl.sum(acc_up, axis=2), axis=1) * UNSCALE
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + offs_n).to(tl.float32)
        y = gated_silu(y, up, dtype, INTERPRET)
    tl.store(out_ptr + cols, cast_to(y, dtype, INTERPRET), mask=(cols < N) & (cols * 0 + ROW < M))


@triton.jit
def _store_rows(a0, a1, a2, a3, u0, u1, u2, u3, bias_ptr, out_ptr, offs_n, cols, N, M, stride_om,
                BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                INTERPRET: tl.constexpr):  # fmt: skip
    """_store_row for each of the BLOCK_M rows."""
    _store_row(a0, u0, bias_ptr, out_ptr, offs_n, cols, N, M, 0, HAS_BIAS, GATED, INTERPRET)
    if BLOCK_M > 1:
        _store_row(a1, u1, bias_ptr, out_ptr + stride_om, offs_n, cols, N, M, 1, HAS_BIAS, GATED, INTERPRET)
    if BLOCK_M > 2:
        _store_row(
            a2, u2, bias_ptr, out_ptr + 2 * stride_om, offs_n, cols, N, M, 2, HAS_BIAS, GATED, INTERPRET
        )
        _store_row(
            a3, u3, bias_ptr, out_ptr + 3 * stride_om, offs_n, cols, N, M, 3, HAS_BIAS, GATED, INTERPRET
        )


@triton.jit
def _rows_sum(words, x0, x1, x2, x3, x_mask, s, z, s_ptrs, z_ptrs, g_mask, a0, a1, a2, a3,
              BLOCK_M: tl.constexpr, BW: tl.constexpr, GROUP_SIZE: tl.constexpr,
              PER_NIBBLE: tl.constexpr):  # fmt: skip
    """One tile of one weight stream against every row of x: the rows' accumulators, updated."""
    hi = words >> 12
    a0 += _tile_sum(words, hi, x0, x_mask, s, z, s_ptrs, z_ptrs, g_mask, BW, GROUP_SIZE, PER_NIBBLE)
    if BLOCK_M > 1:
        a1 += _tile_sum(words, hi, x1, x_mask, s, z, s_ptrs, z_ptrs, g_mask, BW, GROUP_SIZE, PER_NIBBLE)
    if BLOCK_M > 2:
        a2 += _tile_sum(words, hi, x2, x_mask, s, z, s_ptrs, z_ptrs, g_mask, BW, GROUP_SIZE, PER_NIBBLE)
        a3 += _tile_sum(words, hi, x3, x_mask, s, z, s_ptrs, z_ptrs, g_mask, BW, GROUP_SIZE, PER_NIBBLE)
    return a0, a1, a2, a3


@triton.jit
def _park_row(acc, acc_up, part_ptr, cols, N, ROW: tl.constexpr, TWO_STREAMS: tl.constexpr):
    """Store one row's float32 part sums (the second stream's after N) in this program's workspace slice
    [rows, 2N]."""
    tl.store(part_ptr + ROW * 2 * N + cols, tl.sum(tl.sum(acc, axis=2), axis=1), mask=cols < N)
    if TWO_STREAMS:
        tl.store(part_ptr + ROW * 2 * N + N + cols, tl.sum(tl.sum(acc_up, axis=2), axis=1), mask=cols < N)


@triton.jit
def _finish_row(ws_ptr, split_stride, bias_ptr, out_ptr, offs_n, cols, N, M, ROW: tl.constexpr,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PAIRED: tl.constexpr, SPLIT_K: tl.constexpr,
                INTERPRET: tl.constexpr):  # fmt: skip
    """The last program of a column block: the row's parts summed in split order (the same bits on every
    run), stored as _store_row stores a whole-K program's sums (PAIRED: the second stream's sums to the
    next BLOCK_N columns). The parts bypass L1 (.cg): other SMs wrote them."""
    total = tl.zeros(cols.shape, dtype=tl.float32)
    total_up = tl.zeros(cols.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        row = ws_ptr + split * split_stride + ROW * 2 * N
        total += tl.load(row + offs_n, cache_modifier=".cg")
        if GATED or PAIRED:
            total_up += tl.load(row + N + offs_n, cache_modifier=".cg")
    # As [BLOCK_N, 1, 1] sums: _store_row sums them over the two unit axes.
    if PAIRED:
        BLOCK_N: tl.constexpr = cols.shape[0]
        _store_row(total[:, None, None], total[:, None, None], bias_ptr, out_ptr, offs_n, cols, N, M, ROW,
                   HAS_BIAS, False, INTERPRET)  # fmt: skip
        _store_row(total_up[:, None, None], total_up[:, None, None], bias_ptr + BLOCK_N, out_ptr + BLOCK_N,
                   offs_n, cols, N - BLOCK_N, M, ROW, HAS_BIAS, False, INTERPRET)  # fmt: skip
    else:
        _store_row(total[:, None, None], total_up[:, None, None], bias_ptr, out_ptr, offs_n, cols, N, M, ROW,
                   HAS_BIAS, GATED, INTERPRET)  # fmt: skip


@triton.jit
def _split_k_store(acc0, acc1, acc2, acc3, up0, up1, up2, up3, ws_ptr, ticket_ptr, bias_ptr, out_ptr,
                   offs_n, cols, N, M, stride_om, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                   GATED: tl.constexpr, PAIRED: tl.constexpr, SPLIT_K: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """Split K: every program parks its sums (still scaled by 2^-49) in its slice of a float32 workspace
    [SPLIT_K, BLOCK_M, 2N], then takes a ticket for its column block; the SPLIT_K-th program to arrive
    adds the slices in split order, stores the output (bias, SiLU, rounding as without the split) and
    puts the ticket back to zero, so the tickets serve every call (and CUDA-graph replay) with no memset."""
    split_stride = BLOCK_M * 2 * N
    part_ptr = ws_ptr + tl.program_id(1) * split_stride
    two: tl.constexpr = GATED or PAIRED
    _park_row(acc0, up0, part_ptr, cols, N, 0, two)
    if BLOCK_M > 1:
        _park_row(acc1, up1, part_ptr, cols, N, 1, two)
    if BLOCK_M > 2:
        _park_row(acc2, up2, part_ptr, cols, N, 2, two)
        _park_row(acc3, up3, part_ptr, cols, N, 3, two)
    tl.debug_barrier()  # every thread's parts precede the ticket (released with it)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == SPLIT_K - 1:
        for row in tl.static_range(BLOCK_M):
            _finish_row(ws_ptr, split_stride, bias_ptr, out_ptr + row * stride_om, offs_n, cols, N, M, row,
                        HAS_BIAS, GATED, PAIRED, SPLIT_K, INTERPRET)  # fmt: skip
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit(do_not_specialize=["M", "num_groups"])
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, ticket_ptr,
    M, N, K, stride_wn, num_groups, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_NIBBLE: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    PAIRED: tl.constexpr,
    FLAT_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PREFETCH_GROUPS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # GATED: N is the output width d; the weight has 2d rows (gate, then up), out gets silu(gate) * up.
    # SPLIT_K > 1: program (pid, s) sums the s-th K / SPLIT_K values of its columns (_split_k_store).
    # PAIRED (not GATED, N a multiple of 2 * BLOCK_N): a program owns 2 * BLOCK_N columns and
    # reads them as two weight streams of BLOCK_N, the gated kernel's loop (two tiles per iteration).
    NBT: tl.constexpr = BLOCK_K // (8 * BW)  # blocks per tile
    pid = tl.program_id(0)
    k_len = K // SPLIT_K
    if SPLIT_K > 1:  # a whole number of tiles (the launcher checks): the tile loads keep their 16 bytes
        k_start = tl.multiple_of(tl.program_id(1) * k_len, BLOCK_K)
    else:
        k_start = 0
    cols = pid * (2 * BLOCK_N if PAIRED else BLOCK_N) + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n = cols
    else:
        offs_n = tl.minimum(cols, N - 1)  # columns past N load column N - 1 and are not stored
    blk = tl.arange(0, NBT)
    V: tl.constexpr = 4 if BW >= 4 else BW
    bv = tl.arange(0, BW // V)[:, None] * V + tl.arange(0, V)[None, :]  # word b of a block, [BW / V, V]
    blk_k = blk * (8 * BW)  # each block's first value
    # Tiles are [BLOCK_N, blocks, BW / V, V]: a last dimension of V = 4 words (16 bytes) makes Triton
    # give the weight words and the activations (4 x 16 bits) the same register layout, so the
    # activations broadcast over the columns without a layout conversion.
    TILE: tl.constexpr = (BLOCK_N, NBT, BW // V, V)
    if FLAT_TILE:
        # Loaded as [BLOCK_N, NBT * BW] and reshaped: the pipeline's shared-memory copy is then row-major
        # (Triton orders the 4-D tile's copy [3, 1, 0, 2] or [3, 0, 2, 1], and ncu saw its reads and writes
        # conflict in the banks).
        qw_ptrs = (
            qw_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_start // 8 + tl.arange(0, NBT * BW)[None, :]
        )
    else:
        qw_ptrs = (
            qw_ptr
            + offs_n[:, None, None, None].to(tl.int64) * stride_wn
            + k_start // 8
            + (blk * BW)[None, :, None, None]
            + bv[None, None, :, :]
        )
    # x rows past M read row M - 1 (never stored), so no load needs a row mask.
    x_ptrs = x_ptr + blk_k[None, :, None, None] + bv[None, None, :, :]
    x1 = x_ptrs + tl.minimum(1, M - 1) * stride_xm
    x2 = x_ptrs + tl.minimum(2, M - 1) * stride_xm
    x3 = x_ptrs + tl.minimum(3, M - 1) * stride_xm
    # Scales and zeros as [BLOCK_N, blocks, BW / V] (each thread's block's, repeated across its words'
    # dimension): the shape of the per-thread partial sums, so Triton gives them its layout and the
    # group factors apply without a layout conversion.
    g_ptrs = (offs_n[:, None] * num_groups + blk_k[None, :] // GROUP_SIZE)[:, :, None] + tl.zeros(
        (1, 1, BW // V), dtype=tl.int32
    )
    # The second weight stream: GATED, the up half's rows after the gate half's; PAIRED, the program's
    # second BLOCK_N columns.
    if PAIRED:
        up_words = tl.full((), BLOCK_N, tl.int64) * stride_wn
        up_groups = BLOCK_N * num_groups
    else:
        up_words = N.to(tl.int64) * stride_wn
        up_groups = N * num_groups
    shape: tl.constexpr = (BLOCK_N, NBT, BW // V)
    acc0 = tl.zeros(shape, dtype=tl.float32)
    acc1 = tl.zeros(shape, dtype=tl.float32)
    acc2 = tl.zeros(shape, dtype=tl.float32)
    acc3 = tl.zeros(shape, dtype=tl.float32)
    up0 = tl.zeros(shape, dtype=tl.float32)
    up1 = tl.zeros(shape, dtype=tl.float32)
    up2 = tl.zeros(shape, dtype=tl.float32)
    up3 = tl.zeros(shape, dtype=tl.float32)
    # Masks of a K tile: None for whole tiles; K is a multiple of the block, so the blocks of a
    # partial tile are whole or absent.
    w_mask = None
    x_mask = None
    g_mask = None
    if PREFETCH:
        # Each column's whole packed row into the L2 at once (one instruction per column), before the
        # PDL wait (weights are constant): the loop's copies then find it there, however few programs
        # an SM holds, and with PDL the fetch overlaps the previous kernel.
        rows = qw_ptr + offs_n.to(tl.int64) * stride_wn + k_start // 8
        _prefetch_rows_l2(rows, (offs_n * 0 + k_len // 2).to(tl.int32))
        if GATED or PAIRED:
            _prefetch_rows_l2(rows + up_words, (offs_n * 0 + k_len // 2).to(tl.int32))
        if PREFETCH_GROUPS:  # and the scales and zeros, loaded in the loop without cp.async (16 bits)
            g_bytes = (offs_n * 0 + (num_groups // SPLIT_K) * 2).to(tl.int32)
            g_rows = offs_n.to(tl.int64) * num_groups + k_start // GROUP_SIZE
            _prefetch_rows_l2(s_ptr + g_rows, g_bytes)
            _prefetch_rows_l2(z_ptr + g_rows, g_bytes)
            if GATED or PAIRED:
                _prefetch_rows_l2(s_ptr + up_groups + g_rows, g_bytes)
                _prefetch_rows_l2(z_ptr + up_groups + g_rows, g_bytes)
    wait_for_previous_kernel(USE_PDL)  # nothing above reads an activation or writes
    # Triton's software pipeliner keeps NUM_STAGES - 1 tiles in flight (cp.async into shared memory)
    # while one is decoded. Loaded into registers instead (a prefetch carried by the loop), ptxas
    # sinks the next tile's loads below most of the current tile's arithmetic to save registers, so
    # nothing stays in flight (sm_90 SASS).
    for k0 in tl.range(k_start, k_start + k_len, BLOCK_K, num_stages=NUM_STAGES):
        if not EVEN_K:
            x_mask = ((k0 + blk_k) < K)[None, :, None, None]
            if FLAT_TILE:
                w_mask = ((k0 + (tl.arange(0, NBT * BW) // BW) * (8 * BW)) < K)[None, :]
            else:
                w_mask = x_mask
            g_mask = ((k0 + blk_k) < K)[None, :, None]
        s_ptrs = s_ptr + g_ptrs + k0 // GROUP_SIZE
        z_ptrs = z_ptr + g_ptrs + k0 // GROUP_SIZE
        words, s, z = _weights(qw_ptrs, s_ptrs, z_ptrs, w_mask, g_mask, PER_NIBBLE, TILE, FLAT_TILE)
        acc0, acc1, acc2, acc3 = _rows_sum(
            words, x_ptrs + k0, x1 + k0, x2 + k0, x3 + k0, x_mask, s, z, s_ptrs, z_ptrs, g_mask,
            acc0, acc1, acc2, acc3, BLOCK_M, BW, GROUP_SIZE, PER_NIBBLE,
        )  # fmt: skip
        if GATED or PAIRED:
            wu, su, zu = _weights(qw_ptrs + up_words, s_ptrs + up_groups, z_ptrs + up_groups, w_mask, g_mask,
                                  PER_NIBBLE, TILE, FLAT_TILE)  # fmt: skip
            up0, up1, up2, up3 = _rows_sum(
                wu, x_ptrs + k0, x1 + k0, x2 + k0, x3 + k0, x_mask, su, zu, s_ptrs + up_groups,
                z_ptrs + up_groups, g_mask, up0, up1, up2, up3, BLOCK_M, BW, GROUP_SIZE, PER_NIBBLE,
            )  # fmt: skip
        qw_ptrs += BLOCK_K // 8
    if SPLIT_K > 1:
        _split_k_store(acc0, acc1, acc2, acc3, up0, up1, up2, up3, ws_ptr, ticket_ptr + pid, bias_ptr, out_ptr,
                       offs_n, cols, N, M, stride_om, BLOCK_M, HAS_BIAS, GATED, PAIRED, SPLIT_K,
                       INTERPRET)  # fmt: skip
    elif PAIRED:  # the first BLOCK_N columns, then the next BLOCK_N (N - BLOCK_N masks cols + BLOCK_N < N)
        _store_rows(acc0, acc1, acc2, acc3, acc0, acc1, acc2, acc3, bias_ptr, out_ptr, offs_n, cols, N, M,
                    stride_om, BLOCK_M, HAS_BIAS, False, INTERPRET)  # fmt: skip
        _store_rows(up0, up1, up2, up3, up0, up1, up2, up3, bias_ptr + BLOCK_N, out_ptr + BLOCK_N, offs_n, cols,
                    N - BLOCK_N, M, stride_om, BLOCK_M, HAS_BIAS, False, INTERPRET)  # fmt: skip
    else:
        _store_rows(acc0, acc1, acc2, acc3, up0, up1, up2, up3, bias_ptr, out_ptr, offs_n, cols, N, M, stride_om,
                    BLOCK_M, HAS_BIAS, GATED, INTERPRET)  # fmt: skip


@dataclass(frozen=True)
class W4A16GemvConfig:
    """Columns per program, K values per loop iteration (a power of two, at least one block), warps, and
    pipeline stages (tiles in flight: stages - 1)."""

    block_n: int
    block_k: int
    num_warps: int = 1
    num_stages: int = 1
    # Each program's weight rows into the L2 before its loop (CUDA, K a multiple of 32). Off by default:
    # 10-20% slower on every Llama-3-8B projection on an H100 (fifteenth session's third sweep).
    prefetch: bool = False
    split_k: int = 1  # programs per column block, each over K / split_k values (_split_k_store)
    paired: bool = False  # 2 x block_n columns per program, read as two streams (not gated)
    flat_tile: bool = False  # load each tile's words as [block_n, words] and reshape (see the kernel)
    # The tensor-core kernel (w4a16_gemv_mma.py): block_n columns (a multiple of 16 per warp), tiles of
    # block_k values within one group, split_k; paired, flat_tile and prefetch do not apply to it.
    mma: bool = False


MIN_WARPS = 8 * 132  # eight warps per SM of an H200: fewer leave its four schedulers short of work
# Launched without programmatic dependent launch, though the kernel supports it (USE_PDL): on the H200 a
# Llama-3-8B-shaped AWQ model decoded at batch 1 in 6.53 ms per token with it, 5.04 with PDL off everywhere
# and 5.02 with it off in this kernel only (bf16: 4.43, 4.54, 4.44; eleventh session, quant_bench.py
# --profile, docs/benchmarks.md). Rerun with today's kernel in the twenty-first session (H200, ABBA): 3.91 /
# 3.92 ms with PDL against 3.07 / 3.07 without (bf16 4.43). Why PDL slows this kernel was not measured: under
# PDL the profile's kernel times include their waits.
LAUNCH_WITH_PDL = False


def default_config(m: int, n: int, k: int, gated: bool = False) -> W4A16GemvConfig:
    """For a GPU without an entry in the tuned table (TUNED_CONFIGS). At one row: two weight streams of
    four columns per one-warp program (gated: gate and up; plain: `paired`, when N is a multiple of 8),
    three pipeline stages, K tiles of 1024 values (gated 512), no L2 prefetch: the fastest configs on
    every Llama-3-8B projection on an H100 (fifteenth session, w4a16_gemv_m1.py, us per call against
    one stream of eight columns with the prefetch: qkv 10.5 / 20.1, o 8.2 / 14.1, down 19.8 / 34.5,
    gate_up with SiLU 34.0 / 42.5 for the gated kernel's old default). Fewer columns per stream read the
    pipeline's shared memory with fewer bank conflicts (ncu: 8-way at eight), two streams keep two tiles
    in flight. The plain projections copy their tiles row-major (`flat_tile`): with 16-byte weight
    copies (sixteenth session, H100) that took qkv 13.4 -> 11.2 us, o 10.6 -> 8.4, down 28.0 -> 21.9;
    the gated kernel was the same either way (30.9). Four columns at two rows, two at four (the rows'
    activations and sums take the registers), where narrow outputs split K over up to four warps for at
    least MIN_WARPS warps; no prefetch there either (two and four rows: not measured on a GPU yet)."""
    block_k = PACK * block_words(k)
    limit = 512 if gated and m == 1 else 1024
    while block_k < limit and k % (2 * block_k) == 0:
        block_k *= 2
    if m == 1:
        paired = not gated and n % 8 == 0
        block_n = 4 if gated or paired else 8
        return W4A16GemvConfig(
            block_n=block_n, block_k=block_k, num_warps=1, num_stages=3, paired=paired, flat_tile=not gated
        )
    block_n = 4 if m == 2 else 2
    if gated:  # two weight streams per program
        block_n = max(1, block_n // 2)
    programs = triton.cdiv(n // 2 if gated else n, block_n)
    warps = 1
    while warps < 4 and programs * warps < MIN_WARPS and k % (2 * warps * block_k) == 0:
        warps *= 2
    return W4A16GemvConfig(block_n=block_n, block_k=block_k * warps, num_warps=warps, num_stages=3)


class _SplitKScratch:
    """Per device: the float32 workspace the split-K programs park their sums in, and the column blocks'
    tickets (int32, zero between calls: the last program of a block resets its own). Both only grow,
    and a replaced buffer is kept alive, since CUDA graphs captured earlier still point at it."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.retired: list[torch.Tensor] = []

    def get(
        self, device: torch.device, ws_floats: int, tickets: int, capturing: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(workspace, tickets) with room for the call, or None while a CUDA graph is being captured
        (`capturing`) and the buffers would have to grow (the call then runs without the split)."""
        ws, tk = self.buffers.get(device, (None, None))
        if ws is not None and tk is not None and ws.numel() >= ws_floats and tk.numel() >= tickets:
            return ws, tk
        if capturing:
            return None
        if ws is not None and tk is not None:
            self.retired += [ws, tk]
            ws_floats, tickets = max(ws_floats, ws.numel()), max(tickets, tk.numel())
        self.buffers[device] = (
            torch.empty(ws_floats, dtype=torch.float32, device=device),
            torch.zeros(tickets, dtype=torch.int32, device=device),
        )
        return self.buffers[device]


_SCRATCH = _SplitKScratch()


# Launch configs measured fastest per GPU model and shape (benchmarks/h200/w4a16_gemv_m1.py writes the
# table): {device name: {"rows,n,k,gated": config fields}}. KVLLM_W4A16_GEMV_CONFIGS names another file.
TUNED_CONFIGS = Path(__file__).with_name("w4a16_gemv_configs.json")
TUNED_CONFIGS_ENV = "KVLLM_W4A16_GEMV_CONFIGS"


def tuned_key(m: int, n: int, k: int, gated: bool) -> str:
    """The table's key: compiled rows (block_m_for), the weight's output rows, K, gating."""
    return f"{block_m_for(m)},{n},{k},{int(gated)}"


@functools.cache
def _tuned_configs(device_index: int) -> dict[str, W4A16GemvConfig]:
    named = os.environ.get(TUNED_CONFIGS_ENV)
    path = Path(named) if named else TUNED_CONFIGS
    if not path.exists():
        if named:
            raise ValueError(
                f"{TUNED_CONFIGS_ENV}={named}: no such file (a table from w4a16_gemv_m1.py --table-out)"
            )
        return {}
    table = json.loads(path.read_text()).get(torch.cuda.get_device_name(device_index), {})
    configs = {}
    for key, fields in table.items():
        try:
            configs[key] = W4A16GemvConfig(**fields)
        except TypeError as e:
            raise ValueError(f"{path}: entry {key!r} is not a W4A16GemvConfig ({e})") from None
    return configs


def tuned_config(device: torch.device, m: int, n: int, k: int, gated: bool) -> W4A16GemvConfig | None:
    """The table's config for this GPU model and shape, or None (no entry, or not a CUDA device)."""
    if device.type != "cuda" or interpreting():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tuned_configs(index).get(tuned_key(m, n, k, gated))


def block_m_for(m: int) -> int:
    """The compiled row count for m rows: 1, 2 or 4."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def check_gemv_operands(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None, rows: int,
) -> None:  # fmt: skip
    """ValueError unless x [M <= MAX_ROWS, K] (contiguous rows), qweight [rows, K/8] int32, scales and
    zeros [rows, K/G] (floating point), bias [rows] (rows: the weight's output rows)."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"the W4A16 GEMV needs x [M <= {MAX_ROWS}, K] of {SUPPORTED_DTYPES} with contiguous rows, got "
            f"{tuple(x.shape)} {x.dtype} strides {tuple(x.stride())}"
        )
    k = x.shape[1]
    if (
        qweight.shape != (rows, k // PACK)
        or qweight.dtype != torch.int32
        or k % PACK
        or not qweight.is_contiguous()
    ):
        raise ValueError(
            f"the W4A16 GEMV needs a contiguous int32 qweight [{rows}, {k // PACK}], got "
            f"{tuple(qweight.shape)} {qweight.dtype}"
        )
    if group_size != k and (group_size < 16 or group_size & (group_size - 1) or k % group_size):
        raise ValueError(f"group size {group_size} must be a power of two >= 16 dividing K = {k}, or K")
    expected = (rows, k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != expected or not t.dtype.is_floating_point or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous floating-point [N, K/G] = {expected}, got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    if bias is not None and (bias.shape != (rows,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [{rows}], got {tuple(bias.shape)}")


def w4a16_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None, config: W4A16GemvConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype for 0 <= M <= MAX_ROWS, W in the kvllm int4
    layout (int4_layout.py); `config` overrides `default_config`."""
    check_gemv_operands(x, qweight, scales, zeros, group_size, bias, qweight.shape[0])
    return _launch(x, qweight, scales, zeros, group_size, bias, qweight.shape[0], config, False)


def w4a16_gemv_silu_and_mul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None = None, config: W4A16GemvConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """silu(gate) * up of the fused projection x @ W^T (+ bias), W's 2d rows the gate rows then the up
    rows -> [M, d], for 0 <= M <= MAX_ROWS."""
    rows = qweight.shape[0]
    if rows % 2:
        raise ValueError(f"a gate_up weight has an even number of rows (gate, then up), got {rows}")
    check_gemv_operands(x, qweight, scales, zeros, group_size, bias, rows)
    return _launch(x, qweight, scales, zeros, group_size, bias, rows // 2, config, True)


def _launch(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None, n: int, config: W4A16GemvConfig | None, gated: bool,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    bw = block_words(k)
    use_pdl = LAUNCH_WITH_PDL and pdl_enabled(x)
    if config is None:
        config = tuned_config(x.device, m, qweight.shape[0], k, gated)
        # The table is keyed by shape, not dtype or group size: a tensor-core entry this call cannot use
        # gives way to the default.
        if (
            config is not None
            and config.mma
            and mma_refusal(x, k, group_size, config.block_n, config.block_k, config.num_warps)
        ):
            config = None
        config = config or default_config(m, qweight.shape[0], k, gated)
    bk, bn, split = config.block_k, config.block_n, config.split_k
    if bk & (bk - 1) or bk % (PACK * bw) or bn < 1 or bn & (bn - 1):
        raise ValueError(
            f"block_k must be a power of two and a multiple of the layout's block ({PACK * bw} values for "
            f"K = {k}), block_n a power of two; got {config}"
        )
    if split < 1 or (split > 1 and k % (split * bk)):
        raise ValueError(
            f"split_k {split} must be >= 1 and cut K = {k} into whole tiles of {bk} values; got {config}"
        )
    if config.mma:
        if config.paired or config.flat_tile or config.prefetch:
            raise ValueError(f"mma=True takes no paired, flat_tile or prefetch; got {config}")
        refusal = mma_refusal(x, k, group_size, bn, bk, config.num_warps)
        if refusal:
            raise ValueError(refusal)
    paired = config.paired and not gated
    if paired and n % (2 * bn):
        raise ValueError(f"paired needs N = {n} a multiple of 2 x block_n; got {config}")
    grid_n = triton.cdiv(n, 2 * bn if paired else bn)
    workspace, tickets = scales, scales  # unused without a split
    if split > 1:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        scratch = _SCRATCH.get(x.device, split * block_m_for(m) * 2 * n, grid_n, capturing)
        if scratch is None:
            split = 1
        else:
            workspace, tickets = scratch
    if config.mma:
        launch_mma(x, qweight, scales, zeros, group_size, bias, out, gated, block_m_for(m), bn, bk,
                   config.num_warps, config.num_stages, split, workspace, tickets, interpreting())  # fmt: skip
        return out
    prefetch = (
        config.prefetch
        and x.is_cuda
        and not interpreting()
        and (k // split) % 32 == 0
        and qweight.data_ptr() % 16 == 0
    )
    _w4a16_gemv_kernel[(grid_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, workspace, tickets,
        m, n, k, qweight.stride(0), scales.shape[1],
        x.stride(0) if m > 1 else k,  # a lone row's stride is arbitrary; keep it off the specializations
        out.stride(0),
        GROUP_SIZE=group_size,
        BW=bw,
        BLOCK_M=block_m_for(m),
        BLOCK_N=bn,
        BLOCK_K=bk,
        PER_NIBBLE=group_size % (PACK * bw) != 0,
        EVEN_N=n % bn == 0,
        EVEN_K=k % bk == 0,
        USE_PDL=use_pdl,
        PREFETCH=prefetch,
        PREFETCH_GROUPS=prefetch
        and scales.element_size() == 2
        and scales.shape[1] % split == 0
        and (scales.shape[1] // split * 2) % 16 == 0
        and scales.data_ptr() % 16 == 0
        and zeros.data_ptr() % 16 == 0
        and zeros.dtype == scales.dtype,
        HAS_BIAS=bias is not None,
        GATED=gated,
        PAIRED=paired,
        FLAT_TILE=config.flat_tile,
        INTERPRET=interpreting(),
        num_warps=config.num_warps,
        NUM_STAGES=config.num_stages,
        SPLIT_K=split,
        num_stages=config.num_stages,
        **pdl_launch_options(use_pdl),
    )  # fmt: skip
    return out
