"""TRITON_ATTN's prefill kernel: long query chunks over the paged KV cache, tiled for tensor cores.

The unified kernel (`triton_unified_attention`) packs the query heads of one KV head into its rows,
which suits decodes and short chunks. Long chunks are compute-bound; this kernel is the
FlashAttention-2 loop shaped for that case:
- One program = BLOCK_Q query tokens of one request x ROW_HEADS query heads (1: one head per
  program, rows are tokens; G: the KV group packed, row r = token r // G, head r % G). Programs
  start q-block by q-block (all heads of one before the next), a request's latest q-block (most
  keys) first, so the long programs start early and the short ones fill the tail.
- KV tiles of TILE_N keys come from the cache in one of three ways (`kv_load`):
  "gather" (row by row through the block table, any page size), "page" (the tile lies inside one
  page: one table lookup per tile, page size a multiple of TILE_N) and "tma" (as "page", loaded
  by a Hopper TMA descriptor over the cache seen as [blocks * block_size, kv_heads * head_size]).
- With `new_kv`, the step's own keys and values come from the step's key/value inputs (contiguous
  rows: tiles need no table lookup and take TMA loads where allowed), only the cached prefix from
  the cache; the KV write has stored them in the cache as well, for later steps.
- Only the tiles on the causal diagonal (and the window's lower edge, the sequence end) are masked;
  the tiles every row sees whole take the unmasked loop, where the softmax scale folds into one FMA
  before exp2.
- Configs, the table and the load-mode rules: `triton_prefill_config`.
- Softmax in base 2 with scale * log2(e) (times k_scale for fp8 caches), soft-cap, sinks, sliding
  window and fp8 caches as in the unified kernel; padded head dims are masked loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvllm.attention.ops.triton_prefill_config import (
    KV_LOADS,
    PrefillConfig,
    TensorDescriptor,
    resolve_kv_load,
    resolve_new_kv_load,
)
from kvllm.utils.dtypes import FP8_DTYPES


@triton.jit
def _split_tiles(first_pos, last_pos, end, window, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """KV tiles of rows at positions [first_pos, last_pos] over keys below `end`: [lo, hi), of which
    [a, b) every row sees whole (no mask); [lo, a) and [b, hi) are masked. Always a partition."""
    hi = tl.cdiv(tl.minimum(last_pos + 1, end), TILE_N)
    if USE_WINDOW:
        lo = tl.minimum(tl.maximum(first_pos - window + 1, 0) // TILE_N, hi)
        a = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), TILE_N), lo), hi)
    else:
        lo = hi * 0
        a = hi * 0
    b = tl.maximum(tl.minimum(tl.minimum(first_pos + 1, end) // TILE_N, hi), a)
    return lo, a, b, hi


@triton.jit
def _prefill_tiles(
    acc,
    m_i,
    l_i,
    q,
    tile_lo,
    tile_hi,
    block_table_row,
    k_base,
    v_base,
    k_desc,
    v_desc,
    kv_col,
    row_base,
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
    KV_LOAD: tl.constexpr,  # 0 gather, 1 page, 2 tma (the paged cache); 3 rows, 4 rows-tma (the step's K/V)
    WARP_SPECIALIZE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over KV tiles [tile_lo, tile_hi); MASKED=False only for tiles every row sees whole.

    Keys are at positions tile * TILE_N + [0, TILE_N), compared with `q_pos`; masked tiles also drop
    keys at or past `seq_len` (the end of what this loop reads)."""
    dim_ok = offs_d < HEAD_SIZE
    offs_t = tl.arange(0, TILE_N)
    for tile in tl.range(tile_lo, tile_hi, warp_specialize=WARP_SPECIALIZE):
        offs_n = tile * TILE_N + offs_t
        key_ok = offs_n < seq_len
        if KV_LOAD == 0:
            if MASKED:
                page = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            else:
                page = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
            in_page = offs_n % BLOCK_SIZE
            k_ptrs = k_base + (page * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :]
            v_ptrs = v_base + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :]
        elif KV_LOAD == 1 or KV_LOAD == 2:
            page = tl.load(block_table_row + (tile * TILE_N) // BLOCK_SIZE)
            row = (
                page * BLOCK_SIZE + (tile * TILE_N) % BLOCK_SIZE
            )  # TMA row of the [blocks * block_size, ...] view
            page64 = page.to(tl.int64)
            in_page = (tile * TILE_N) % BLOCK_SIZE + offs_t
            k_ptrs = k_base + page64 * stride_kb + in_page[:, None] * stride_ks + offs_d[None, :]
            v_ptrs = v_base + page64 * stride_vb + in_page[:, None] * stride_vs + offs_d[None, :]
        else:  # rows of the step's key/value inputs; k_base / v_base / row_base at the request's first token
            row = row_base + tile * TILE_N
            k_ptrs = k_base + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
            v_ptrs = v_base + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
        if KV_LOAD == 2 or KV_LOAD == 4:
            k = k_desc.load([row, kv_col]).to(q.dtype)
            v = v_desc.load([row, kv_col]).to(q.dtype)
            if MASKED:  # rows past the sequence end hold stale data; P is 0 there, V must not be NaN
                v = tl.where(key_ok[:, None], v, 0.0).to(q.dtype)
        elif MASKED:
            k = tl.load(k_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(q.dtype)
        elif HEAD_SIZE == HEAD_SIZE_PAD:
            k = tl.load(k_ptrs).to(q.dtype)
            v = tl.load(v_ptrs).to(q.dtype)
        else:
            k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
        if USE_SOFT_CAP:
            # cap * tanh(x / cap), in log2 units: tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = s * cap_scale
            s = (1.0 - 2.0 / (tl.exp2(y * (2.0 * 1.4426950408889634)) + 1.0)) * qk_scale
        if MASKED:
            if not USE_SOFT_CAP:
                s = s * qk_scale
            ok = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                ok = ok & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may have seen no key yet (window edge, rows past the chunk): keep exp2 finite.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        elif USE_SOFT_CAP:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new
            p = tl.exp2(s - m_safe[:, None])
        else:  # qk_scale > 0, so max(s) * scale = max(s * scale); s * scale - m is one FMA
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Step-varying ints are not specialized on (see the unified kernel): no mid-serving recompiles.
@triton.jit(do_not_specialize=["seq_lo", "seq_hi", "window", "stride_bt"])
def _prefill_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,  # TMA descriptors (KV_LOAD == 2), else the cache tensors again (unused)
    v_desc,
    new_k_ptr,  # the step's key/value inputs [T, num_kv_heads, head_size] (NEW_KV_LOAD > 0)
    new_v_ptr,
    new_k_desc,  # their TMA descriptors (NEW_KV_LOAD == 4), else the tensors again
    new_v_desc,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_lo,
    seq_hi,
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
    stride_nkt,
    stride_nvt,
    QUERIES_PER_KV: tl.constexpr,
    ROW_HEADS: tl.constexpr,  # query heads per program: 1, or QUERIES_PER_KV when packed
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // ROW_HEADS
    TILE_N: tl.constexpr,
    KV_LOAD: tl.constexpr,
    NEW_KV_LOAD: tl.constexpr,  # 0: every key from the cache; 3 / 4: the step's keys as rows (pointers / TMA)
    WARP_SPECIALIZE: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Heads vary fastest in launch order, so programs start q-block by q-block, heaviest first per
    # request: the last programs to start are the lightest (a short tail), and the programs running
    # together share one request's K/V in L2.
    head_group = tl.program_id(0)
    pid = tl.program_id(1)
    # Request r owns q-block slots [start(r), start(r) + cdiv(qlen_r, BLOCK_Q)) with
    # start(r) = (qsl[r] - qsl[seq_lo]) // BLOCK_Q + (r - seq_lo): disjoint, and the grid bound
    # num_tokens // BLOCK_Q + num_reqs covers them all. Find the last r with start(r) <= pid.
    t0 = tl.load(query_start_loc_ptr + seq_lo)
    lo = pid * 0 + seq_lo  # pid * 0: an int arg equal to 1 would be a constexpr, not loop-carried
    hi = pid * 0 + seq_hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = (tl.load(query_start_loc_ptr + mid) - t0) // BLOCK_Q + (mid - seq_lo)
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
    local = pid - ((q_start - t0) // BLOCK_Q + (seq - seq_lo))
    if local >= num_q_blocks:
        return
    q_block = num_q_blocks - 1 - local  # latest block (most keys) first
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    tok = q_block * BLOCK_Q + offs_m // ROW_HEADS  # token index within the request
    head = head_group * ROW_HEADS + offs_m % ROW_HEADS
    kv_head = (head_group * ROW_HEADS) // QUERIES_PER_KV
    row_ok = (offs_m // ROW_HEADS < BLOCK_Q) & (tok < q_len)  # BLOCK_M may not divide by ROW_HEADS
    q_pos = ctx_len + tok
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE)
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    first_tok = q_block * BLOCK_Q
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if USE_SOFT_CAP:
        cap_scale = scale * k_scale / soft_cap
        qk_scale = soft_cap * 1.4426950408889634
    else:
        cap_scale = 1.0
        qk_scale = scale * k_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.where(row_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], tl.float32)

    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    kv_col = kv_head * HEAD_SIZE
    # From the cache: every key (NEW_KV_LOAD == 0), else the cached prefix [0, ctx_len) only.
    if NEW_KV_LOAD == 0:
        cache_end = seq_len
    else:
        cache_end = ctx_len
    lo, a, b, hi = _split_tiles(
        ctx_len + first_tok, ctx_len + last_tok, cache_end, window, TILE_N, USE_WINDOW
    )
    if USE_WINDOW:  # tiles crossing the window's lower edge
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, lo, a, block_table_row, k_base, v_base, k_desc, v_desc, kv_col, 0, q_pos,
            cache_end, qk_scale, cap_scale, window, offs_d, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, True, KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
            USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    acc, m_i, l_i = _prefill_tiles(
        acc, m_i, l_i, q, a, b, block_table_row, k_base, v_base, k_desc, v_desc, kv_col, 0, q_pos,
        cache_end, qk_scale, cap_scale, window, offs_d, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, False, KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
        USE_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _prefill_tiles(
        acc, m_i, l_i, q, b, hi, block_table_row, k_base, v_base, k_desc, v_desc, kv_col, 0, q_pos,
        cache_end, qk_scale, cap_scale, window, offs_d, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, True, KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
        USE_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    if NEW_KV_LOAD != 0:  # the chunk's own keys, positions relative to its first token
        nk_base = new_k_ptr + q_start.to(tl.int64) * stride_nkt + kv_head * HEAD_SIZE
        nv_base = new_v_ptr + q_start.to(tl.int64) * stride_nvt + kv_head * HEAD_SIZE
        lo, a, b, hi = _split_tiles(first_tok, last_tok, q_len, window, TILE_N, USE_WINDOW)
        if USE_WINDOW:
            acc, m_i, l_i = _prefill_tiles(
                acc, m_i, l_i, q, lo, a, block_table_row, nk_base, nv_base, new_k_desc, new_v_desc, kv_col,
                q_start, tok, q_len, qk_scale, cap_scale, window, offs_d, 0, stride_nkt, 0, stride_nvt,
                HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, True, NEW_KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
                USE_WINDOW, DOT_PRECISION,
            )  # fmt: skip
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, a, b, block_table_row, nk_base, nv_base, new_k_desc, new_v_desc, kv_col,
            q_start, tok, q_len, qk_scale, cap_scale, window, offs_d, 0, stride_nkt, 0, stride_nvt,
            HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, False, NEW_KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
            USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        acc, m_i, l_i = _prefill_tiles(
            acc, m_i, l_i, q, b, hi, block_table_row, nk_base, nv_base, new_k_desc, new_v_desc, kv_col,
            q_start, tok, q_len, qk_scale, cap_scale, window, offs_d, 0, stride_nkt, 0, stride_nvt,
            HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_SIZE, TILE_N, True, NEW_KV_LOAD, WARP_SPECIALIZE, USE_SOFT_CAP,
            USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_safe)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def prefill_attention(
    out: torch.Tensor,  # [T, num_heads, head_size]; rows of requests [seq_lo, seq_hi) written
    query: torch.Tensor,  # [T, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor,  # int32 [num_reqs], device
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks], device
    *,
    seq_lo: int,
    seq_hi: int,
    num_tokens: int,  # an upper bound of the query tokens of requests [seq_lo, seq_hi)
    scale: float,
    cfg: PrefillConfig,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,  # the step's K/V [T, num_kv_heads, head_size], for cfg.new_kv
    value: torch.Tensor | None = None,
) -> str:
    """Causal attention of requests [seq_lo, seq_hi) over the paged cache; returns the KV loads used
    ("gather" / "page" / "tma" for the cache, "+rows" / "+rows-tma" for the step's own K/V).

    The caller has checked shapes and strides (`unified_attention` does); the grid is an upper
    bound from Python ints, so no device sync.
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    g = num_heads // num_kv_heads
    row_heads = g if cfg.pack_gqa else 1
    block_m = max(cfg.block_m, triton.next_power_of_2(row_heads))
    block_q = block_m // row_heads
    head_pad = triton.next_power_of_2(head_size)
    kv_load = resolve_kv_load(cfg, key_cache, value_cache, head_size)
    if kv_load == "tma":
        rows, width = key_cache.shape[0] * block_size, num_kv_heads * head_size
        k_desc = TensorDescriptor(
            key_cache.view(rows, width), [rows, width], [width, 1], [cfg.tile_n, head_pad]
        )
        v_desc = TensorDescriptor(
            value_cache.view(rows, width), [rows, width], [width, 1], [cfg.tile_n, head_pad]
        )
    else:
        k_desc, v_desc = key_cache, value_cache
    new_load = resolve_new_kv_load(cfg, key, value, key_cache)
    if new_load is None:
        key = value = new_k_desc = new_v_desc = key_cache
    elif new_load == "rows-tma":
        new_k_desc, new_v_desc = (
            TensorDescriptor(
                t, [t.shape[0], num_kv_heads * head_size], [t.stride(0), 1], [cfg.tile_n, head_size]
            )
            for t in (key, value)
        )
    else:
        new_k_desc, new_v_desc = key, value
    is_fp8 = key_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    grid = (num_heads // row_heads, num_tokens // block_q + (seq_hi - seq_lo))
    _prefill_attention_kernel[grid](
        out, query, key_cache, value_cache, k_desc, v_desc, key, value, new_k_desc, new_v_desc,
        sinks if sinks is not None else dummy,
        k_scale if is_fp8 else dummy,
        v_scale if is_fp8 else dummy,
        block_table, seq_lens, query_start_loc,
        seq_lo, seq_hi,
        scale, float(logits_soft_cap or 0.0), int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), key.stride(0), value.stride(0),
        QUERIES_PER_KV=g, ROW_HEADS=row_heads, HEAD_SIZE=head_size, HEAD_SIZE_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
        KV_LOAD=KV_LOADS.index(kv_load), NEW_KV_LOAD={None: 0, "rows": 3, "rows-tma": 4}[new_load],
        WARP_SPECIALIZE=cfg.warp_specialize,
        USE_SINKS=sinks is not None, USE_SOFT_CAP=bool(logits_soft_cap), USE_WINDOW=sliding_window is not None,
        IS_FP8=is_fp8, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return kv_load if new_load is None else f"{kv_load}+{new_load}"
