"""One Triton kernel for paged attention over a mixed batch of decode tokens and prefill chunks.

Design (all sizes in tokens unless noted):
- Cache layout, K and V each: [num_blocks, block_size, num_kv_heads, head_size], head dim contiguous.
- One program = one KV head x one block of BLOCK_Q query tokens of one request. Its BLOCK_M rows are
  (token, query head) pairs, row r = token r // G, head kv_head * G + r % G with G query heads per
  KV head (GQA packing): every K/V tile is read once for all query heads that share it.
- KV tiles of TILE_N tokens gather their rows page by page through the block table, so TILE_N is
  independent of the block size. Tiles fully inside the causal/window band skip all masking.
- Softmax runs in base 2: scores are multiplied by scale * log2(e) (and by k_scale for fp8 caches),
  so exp2 replaces exp. Padded head dims are masked loads (zeros), never written.
- Two launches per step in eager mode: decodes (DECODE_ONLY: program -> request directly, optionally
  split over KV segments with a reduce kernel) and prefills (program -> request by binary search
  over query_start_loc, so the grid is an upper bound computed without a device sync).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvllm.attention.ops.triton_prefill_attention import prefill_attention
from kvllm.attention.ops.triton_prefill_config import (
    PrefillConfig,
    prefill_kernel_config,
    routes_to_prefill_kernel,
)
from kvllm.utils.dtypes import FP8_DTYPES
from kvllm.utils.pdl import pdl_enabled, pdl_launch_options, wait_for_previous_kernel

LOG2E = 1.4426950408889634
# The most KV segments a decode launch may split into. The reduce kernel is compiled for this many
# (masked) segments whatever the step uses, so a new split count never compiles a variant mid-serving.
MAX_SEGMENTS = 64

# How an fp8-cache launch feeds its dots (KVLLM_FP8_ATTENTION_DOT). "bf16" casts every K/V value to
# bf16 (fp8 -> fp16 -> bf16 on Hopper: two conversions and register moves per value). "fp16" casts to
# fp16 (one exact conversion per pair of values; q is cast to fp16 once per program), but Triton moves
# the cast after the tile's shared-memory layout change, which then reads it a byte at a time.
# "fp16_registers" casts in registers first (behind an opaque move, so the cast stays there) and the
# fp16 tile takes the 16-bit path through shared memory (vector stores, ldmatrix). fp8 dots would skip
# the casts, but with 16-row decode tiles Triton lowers them to fp16 mma anyway.
FP8_DOT_BF16 = tl.constexpr(0)
FP8_DOT_FP16 = tl.constexpr(1)
FP8_DOT_FP16_REGISTERS = tl.constexpr(2)
FP8_DOT_MODES = {"bf16": 0, "fp16": 1, "fp16_registers": 2}


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of one attention launch."""

    block_m: int  # rows per program: (query tokens) x (query heads of one KV head), power of two
    tile_n: int  # KV tokens per inner-loop tile, power of two >= 16
    num_warps: int
    num_stages: int


def fp8_dot_mode() -> int:
    """The FP8_DOT of an fp8-cache launch: KVLLM_FP8_ATTENTION_DOT, fp16 unless set. The interpreter
    runs no inline assembly, so there fp16_registers is fp16 (the same arithmetic)."""
    name = os.environ.get("KVLLM_FP8_ATTENTION_DOT", "fp16")
    if name not in FP8_DOT_MODES:
        raise ValueError(f"KVLLM_FP8_ATTENTION_DOT={name!r}: expected one of {sorted(FP8_DOT_MODES)}")
    mode = FP8_DOT_MODES[name]
    return FP8_DOT_MODES["fp16"] if mode == FP8_DOT_FP16_REGISTERS and is_interpreter() else mode


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def decode_config(
    head_size: int, queries_per_kv: int, dtype: torch.dtype, query_len: int = 1
) -> KernelConfig:
    """Decode is bandwidth-bound: one request per program, rows = its query tokens (one, or k + 1
    when speculative decoding verifies k drafts) x its query heads, wide KV tiles.

    16-bit, head size <= 128: 2 warps and 2 stages, the fastest of 27 tile configs on an H200 at
    batch 256 x 1k (4.11 TB/s of KV, 1.18x the 4-warp, 3-stage config), batch 64 x 1k (1.41x) and
    batch 16 x 2k (2.2x) (`kvllm.benchmarks.attention --sweep`, docs/benchmarks.md)."""
    head_pad = triton.next_power_of_2(head_size)
    block_m = max(16, triton.next_power_of_2(query_len * queries_per_kv))
    if dtype == torch.float32 or head_pad > 128:
        return KernelConfig(block_m=block_m, tile_n=32, num_warps=4, num_stages=2)
    return KernelConfig(block_m=block_m, tile_n=64, num_warps=2, num_stages=2)


def prefill_config(head_size: int, queries_per_kv: int, dtype: torch.dtype) -> KernelConfig:
    """Prefill is compute-bound: 128-row tiles on Hopper tensor cores (64 when registers are short)."""
    head_pad = triton.next_power_of_2(head_size)
    if dtype == torch.float32 or head_pad > 128:
        block_m, tile_n, warps, stages = 64, 32, 4, 2
    else:  # 4 warps: 1.23x / 1.28x the 8-warp config at 8 x 2k and 16 x 512 over 512 on an H200
        block_m, tile_n, warps, stages = 128, 64, 4, 3
    return KernelConfig(max(block_m, triton.next_power_of_2(queries_per_kv)), tile_n, warps, stages)


@triton.jit
def _in_registers(x):
    """fp16 x through an opaque register move: the compiler cannot move the cast that made x past it."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    tile_lo,
    tile_hi,
    block_table_row,
    k_base,
    v_base,
    q_pos,
    seq_len,
    qk_scale,
    cap_scale,
    window,
    offs_d,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAST_IN_REGISTERS: tl.constexpr,
):
    """Online-softmax over KV tiles [tile_lo, tile_hi); MASKED=False only for tiles every row sees whole.

    The dots run in q's dtype: the K/V tiles and P are cast to it."""
    dim_ok = offs_d < HEAD_SIZE
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        if MASKED:
            key_ok = offs_n < seq_len
            block = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        else:
            block = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_ptrs = k_base + block[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + block[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            if HEAD_SIZE == HEAD_SIZE_PAD:
                k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        else:
            if HEAD_SIZE == HEAD_SIZE_PAD:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)

        if CAST_IN_REGISTERS:  # fp8 tiles, fp16 dots
            k = _in_registers(k.to(tl.float16))
            v = _in_registers(v.to(tl.float16))
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if USE_SOFT_CAP:
            # cap * tanh(x / cap), in log2 units: tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = s * cap_scale
            s = (1.0 - 2.0 / (tl.exp2(y * (2.0 * 1.4426950408889634)) + 1.0)) * qk_scale
        else:
            s = s * qk_scale
        if MASKED:
            ok = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                ok = ok & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may have seen no key yet (window edge, empty split segment): keep exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Arguments that change from step to step (how many requests, where the decodes end, the block
# table's width, the split count) are not specialized on: Triton would otherwise compile a variant
# for every "== 1" / "multiple of 16" combination of them, seconds each, in the middle of serving.
@triton.jit(do_not_specialize=["seq_lo", "seq_hi", "num_segments", "window", "stride_bt"])
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    decode_order_ptr,  # ORDERED only: int [decode requests], the order their programs start in
    part_out_ptr,  # SPLIT only: float32 [tokens, num_heads, num_segments, HEAD_SIZE_PAD]
    part_m_ptr,  # SPLIT only: float32 [tokens, num_heads, num_segments], running max (log2 units)
    part_l_ptr,  # SPLIT only: float32 [tokens, num_heads, num_segments], running sum
    seq_lo,
    seq_hi,
    num_heads,
    num_segments,
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,  # DECODE_ONLY: grid (KV heads, decode requests, segments), requests by decode_order
    USE_SINKS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_DOT: tl.constexpr,  # fp8 caches: FP8_DOT_BF16 / FP8_DOT_FP16 / FP8_DOT_FP16_REGISTERS
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    segment = tl.program_id(2)
    if ORDERED:
        # The GPU starts programs in grid order: heads fastest, so every head of the first request in
        # decode_order starts before any of the next one's.
        kv_head = tl.program_id(0)
        pid = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)

    if DECODE_ONLY:
        if ORDERED:
            seq = seq_lo + tl.load(decode_order_ptr + pid).to(tl.int32)
        else:
            seq = seq_lo + pid
        q_block = 0
    else:
        # Request r owns q-blocks [start(r), start(r) + cdiv(qlen_r, BLOCK_Q)) with
        # start(r) = (qsl[r] - qsl[seq_lo]) // BLOCK_Q + (r - seq_lo): disjoint, and the grid
        # bound num_tokens // BLOCK_Q + num_reqs covers them all. Find the last r with start(r) <= pid.
        t0 = tl.load(query_start_loc_ptr + seq_lo)
        # pid * 0 + ...: int args equal to 1 are specialized to constexprs, which cannot be loop-carried.
        lo = pid * 0 + seq_lo
        hi = pid * 0 + seq_hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = (tl.load(query_start_loc_ptr + mid) - t0) // BLOCK_Q + (mid - seq_lo)
            lo = tl.where(start <= pid, mid, lo)
            hi = tl.where(start <= pid, hi, mid - 1)
        seq = lo
        q_block = pid - ((tl.load(query_start_loc_ptr + seq) - t0) // BLOCK_Q + (seq - seq_lo))
    if seq >= seq_hi:
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    tok = q_block * BLOCK_Q + offs_m // QUERIES_PER_KV  # token index within the request
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (offs_m // QUERIES_PER_KV < BLOCK_Q) & (tok < q_len)
    q_pos = ctx_len + tok
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE)
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    # Keys needed by this q-block: [kv_lo, kv_hi); keys every valid row sees: [full_lo, full_hi).
    first_pos = ctx_len + q_block * BLOCK_Q
    last_pos = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = last_pos + 1
    full_hi = first_pos + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
    else:
        kv_lo = 0
        full_lo = 0
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    if SPLIT:
        per_segment = tl.cdiv(tile_hi - tile_lo, num_segments)
        seg_lo = tl.minimum(tile_lo + segment * per_segment, tile_hi)
        seg_hi = tl.minimum(seg_lo + per_segment, tile_hi)
    else:
        seg_lo = tile_lo
        seg_hi = tile_hi
    unmasked_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, TILE_N), seg_lo), seg_hi)
    unmasked_hi = tl.maximum(tl.minimum(full_hi // TILE_N, seg_hi), unmasked_lo)

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if FP8_DOT != FP8_DOT_BF16 and q.dtype.is_bf16():
            # The dots take q's dtype; fp16 holds every |q| below 65504 more finely than bf16.
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if USE_SOFT_CAP:
        cap_scale = scale * k_scale / soft_cap
        qk_scale = soft_cap * 1.4426950408889634
    else:
        cap_scale = 1.0
        qk_scale = scale * k_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        if segment == 0:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.where(row_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], tl.float32)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        seg_lo,
        unmasked_lo,
        block_table_row,
        k_base,
        v_base,
        q_pos,
        seq_len,
        qk_scale,
        cap_scale,
        window,
        offs_d,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        HEAD_SIZE,
        HEAD_SIZE_PAD,
        BLOCK_SIZE,
        TILE_N,
        True,
        USE_SOFT_CAP,
        USE_WINDOW,
        DOT_PRECISION,
        IS_FP8 and FP8_DOT == FP8_DOT_FP16_REGISTERS,
    )
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        unmasked_lo,
        unmasked_hi,
        block_table_row,
        k_base,
        v_base,
        q_pos,
        seq_len,
        qk_scale,
        cap_scale,
        window,
        offs_d,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        HEAD_SIZE,
        HEAD_SIZE_PAD,
        BLOCK_SIZE,
        TILE_N,
        False,
        USE_SOFT_CAP,
        USE_WINDOW,
        DOT_PRECISION,
        IS_FP8 and FP8_DOT == FP8_DOT_FP16_REGISTERS,
    )
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        unmasked_hi,
        seg_hi,
        block_table_row,
        k_base,
        v_base,
        q_pos,
        seq_len,
        qk_scale,
        cap_scale,
        window,
        offs_d,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        HEAD_SIZE,
        HEAD_SIZE_PAD,
        BLOCK_SIZE,
        TILE_N,
        True,
        USE_SOFT_CAP,
        USE_WINDOW,
        DOT_PRECISION,
        IS_FP8 and FP8_DOT == FP8_DOT_FP16_REGISTERS,
    )
    acc = acc * v_scale

    if SPLIT:
        part = (token * num_heads + head) * num_segments + segment
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


@triton.jit(do_not_specialize=["num_reqs", "num_segments"])
def _reduce_segments_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_heads,
    num_segments,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    SEGMENTS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    # The decode requests' tokens are [0, query_start_loc[num_reqs]); the grid's further tokens
    # (padded requests, requests with fewer than decode_query_len tokens) were never computed.
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    offs_s = tl.arange(0, SEGMENTS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    seg_ok = offs_s < num_segments
    part = (token.to(tl.int64) * num_heads + head) * num_segments + offs_s
    m = tl.load(part_m_ptr + part, mask=seg_ok, other=float("-inf"))
    l_i = tl.load(part_l_ptr + part, mask=seg_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    # Empty segments stored m = -inf and l = 0, so w = 0 drops them; their acc is 0 too.
    w = tl.where(seg_ok & (m > float("-inf")), w, 0.0)
    denom = tl.sum(l_i * w, axis=0)
    acc = tl.load(
        part_out_ptr + part[:, None] * HEAD_SIZE_PAD + offs_d[None, :], mask=seg_ok[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def unified_attention(
    out: torch.Tensor,  # [T, num_heads, head_size], written for real tokens only
    query: torch.Tensor,  # [T, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor,  # int32 [num_reqs], device
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks], device
    *,
    num_reqs: int,
    num_tokens: int,
    num_decode_reqs: int,  # requests [0, num_decode_reqs) have <= decode_query_len tokens each
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    k_scale: torch.Tensor | None = None,  # float32 scalar tensors, fp8 caches only
    v_scale: torch.Tensor | None = None,
    num_splits: int = 1,  # KV segments of the decode launch; 1 = no split
    decode_order: torch.Tensor | None = None,  # permutation of the decode requests: program start order
    decode_query_len: int = 1,  # the most query tokens of a decode request (k + 1 when verifying)
    decode_cfg: KernelConfig | None = None,
    prefill_cfg: KernelConfig | PrefillConfig | None = None,
    key: torch.Tensor | None = None,  # the step's K/V [T, num_kv_heads, head_size]: read by a
    value: torch.Tensor | None = None,  # PrefillConfig with new_kv (already in the cache as well)
) -> torch.Tensor:
    """Causal paged attention for a decodes-first mixed batch; returns `out`.

    All launch sizes come from the Python ints passed in (no device sync): the decode launch has one
    program per decode request (all its query tokens: 1, or up to `decode_query_len`, which a
    uniform speculative-decoding batch of k + 1 tokens per request uses; padding requests have 0),
    the prefill launch an upper bound of q-blocks with early exits.
    The prefill requests go to the prefill kernel (`triton_prefill_attention`) when `prefill_cfg` is a
    PrefillConfig, or when it is None and `routes_to_prefill_kernel` says so (long chunks); else to this
    module's kernel (a KernelConfig, or `prefill_config`'s).
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads/size {num_heads}/{head_size} do not fit the cache "
            f"(num_kv_heads={num_kv_heads}, head_size={cache_head_size})"
        )
    for name, t in (("query", query), ("out", out), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head dimension (stride {t.stride(-1)})")
    if num_splits & (num_splits - 1) or not 1 <= num_splits <= MAX_SEGMENTS:
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SEGMENTS}], got {num_splits}")
    is_fp8 = key_cache.dtype in FP8_DTYPES
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    g = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    dummy = seq_lens  # any device tensor for pointer arguments a specialization never reads
    use_pdl = pdl_enabled(query)
    common = dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_pad,
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=g,
        USE_SINKS=sinks is not None,
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_WINDOW=sliding_window is not None,
        IS_FP8=is_fp8,
        FP8_DOT=fp8_dot_mode() if is_fp8 else FP8_DOT_MODES["bf16"],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl,
    )

    def launch(
        grid, cfg, seq_lo, seq_hi, block_q, decode_only, split, part_out, part_ml, segments, order=None
    ):
        _unified_attention_kernel[grid](
            out, query, key_cache, value_cache,
            sinks if sinks is not None else dummy,
            k_scale if is_fp8 else dummy,
            v_scale if is_fp8 else dummy,
            block_table, seq_lens, query_start_loc,
            order if order is not None else dummy,
            part_out, part_ml[0], part_ml[1],
            seq_lo, seq_hi, num_heads, segments,
            scale, float(logits_soft_cap or 0.0), int(sliding_window or 0),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
            DECODE_ONLY=decode_only, SPLIT=split, ORDERED=order is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **common, **pdl_launch_options(use_pdl),
        )  # fmt: skip

    if num_decode_reqs > 0:
        cfg = decode_cfg or decode_config(head_size, g, query.dtype, decode_query_len)
        if cfg.block_m < decode_query_len * g:
            raise ValueError(
                f"decode block_m={cfg.block_m} is below decode_query_len x queries per KV head "
                f"({decode_query_len} x {g}): one program holds all of a decode request's rows"
            )
        # The decode tokens are at most num_decode_reqs * decode_query_len, packed from token 0.
        num_decode_tokens = num_decode_reqs * decode_query_len
        if decode_order is not None and decode_order.shape[0] < num_decode_reqs:
            raise ValueError(
                f"decode_order has {decode_order.shape[0]} entries for {num_decode_reqs} decode requests"
            )

        def decode_grid(splits: int) -> tuple[int, int, int]:
            if decode_order is None:
                return (num_decode_reqs, num_kv_heads, splits)
            return (num_kv_heads, num_decode_reqs, splits)

        if num_splits > 1:
            # Partial results are indexed by token.
            part_out = torch.empty(
                (num_decode_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
            )
            part_ml = torch.empty(
                (2, num_decode_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
            )
            launch(
                decode_grid(num_splits),
                cfg,
                0,
                num_decode_reqs,
                decode_query_len,
                True,
                True,
                part_out,
                part_ml,
                num_splits,
                decode_order,
            )
            _reduce_segments_kernel[(num_decode_tokens, num_heads)](
                out, part_out, part_ml[0], part_ml[1], query_start_loc, num_decode_reqs, num_heads, num_splits,
                out.stride(0), out.stride(1),
                HEAD_SIZE=head_size, HEAD_SIZE_PAD=head_pad, SEGMENTS_PAD=MAX_SEGMENTS, USE_PDL=use_pdl,
                num_warps=4, **pdl_launch_options(use_pdl),
            )  # fmt: skip
        else:
            launch(decode_grid(1), cfg, 0, num_decode_reqs, decode_query_len, True, False,
                   dummy, (dummy, dummy), 1, decode_order)  # fmt: skip
    if num_reqs > num_decode_reqs:
        # Tokens of the prefill requests are at most num_tokens - the decodes' (>= num_decode_reqs).
        num_prefill_tokens = num_tokens - num_decode_reqs
        num_prefill_reqs = num_reqs - num_decode_reqs
        if prefill_cfg is None and routes_to_prefill_kernel(num_prefill_tokens, num_prefill_reqs):
            prefill_cfg = prefill_kernel_config(head_size, g, query.dtype, block_size)
        if isinstance(prefill_cfg, PrefillConfig):
            prefill_attention(
                out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table,
                seq_lo=num_decode_reqs, seq_hi=num_reqs, num_tokens=num_prefill_tokens, scale=scale,
                cfg=prefill_cfg, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale, key=key, value=value,
            )  # fmt: skip
            return out
        cfg = prefill_cfg or prefill_config(head_size, g, query.dtype)
        block_q = max(1, cfg.block_m // g)
        num_q_blocks = num_prefill_tokens // block_q + num_prefill_reqs
        launch((num_q_blocks, num_kv_heads, 1), cfg, num_decode_reqs, num_reqs, block_q, False, False,
               dummy, (dummy, dummy), 1)  # fmt: skip
    return out
