"""FLEX_ATTENTION block masks: the step's batch as masks need it, and the BlockMask / page lists
built from the block tables. Used by `flex_attention_impl`; torch-only, no kernel calls.

Mask. `mask_mod(q, kv)` maps the query row to its request and absolute position, and the
physical slot kv to (physical page, offset) -> logical page via an inverse block table -> logical
position; the slot is visible iff the request's own table holds that page at that logical index,
the position is below the request's seq_len, and the causal / sliding-window rules hold.

Sparsity. The BlockMask is built directly from the block tables with BlockMask.from_kv_blocks:
one KV tile per page, 16 query tokens per query tile, and for each query tile the distinct
pages its requests may read (causal upper bound, sliding-window lower bound). The work is
proportional to (query tiles x pages they read), never to query tokens x cache slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

Q_TILE = 16  # query tokens per BlockMask row tile (the smallest tile the GPU kernel runs)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# ---- metadata ------------------------------------------------------------------------------------


@dataclass
class FlexAttentionMetadata:
    """One step's batch as FlexAttention masks need it; block masks are built lazily and shared.

    Tensors are on the device unless named *_cpu. Request index `pad_req` is a padding row of
    `block_table` / `seq_lens` (seq_len 0): padded query rows point at it and see nothing.
    """

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    causal: bool
    pad_req: int
    query_start_loc_cpu: torch.Tensor  # int64 [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # int64 [num_reqs]
    context_lens_cpu: torch.Tensor  # int64 [num_reqs]
    q_req_cpu: torch.Tensor  # int64 [num_actual_tokens]: request of each query token
    q_req: torch.Tensor  # int32 [num_actual_tokens]
    q_pos: torch.Tensor  # int32 [num_actual_tokens]: absolute position of each query token
    block_table: torch.Tensor  # int32 [pad_req + 1, max_blocks_per_req]; fixed shape across steps
    seq_lens: torch.Tensor  # int32 [pad_req + 1]; 0 past num_reqs
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]: each query token's cache slot, -1 = not written
    # Split steps (decodes first, then only fresh prefills, or decodes only): the decodes run on the
    # builder's persistent decode masks (flex_attention_decode), the fresh prefills over the step's
    # own K/V (flex_attention_prefill). None = the general path for the whole step.
    decode_masks: Any = field(default=None, repr=False)
    num_decodes: int = 0
    fresh_prefill_from: int | None = None  # first fresh-prefill request, when the step has some
    # Per layer configuration: StepMask (general path), BlockMask (decodes), FreshPrefill.
    masks: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    # A decode CUDA graph's metadata (the builder's prepare_for_capture), used by every replay: its
    # tensors are the builder's fixed buffers, refilled before each replay, and the layer (impl) that first
    # updated a decode mask (mask_owners) updates it again on every forward, so the graph holds the update.
    for_graph: bool = False
    mask_owners: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)


@dataclass
class StepMask:
    """A layer configuration's BlockMask for one step, and the pages an eager run gathers."""

    block_mask: BlockMask
    pages: torch.Tensor | None  # eager paged path: physical pages copied into a compact KV


# ---- block-mask construction -------------------------------------------------------------------


def tile_pages(
    meta: FlexAttentionMetadata, causal: bool, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (query tile, request, logical page) such that some token of the request in that
    tile may read some slot of the page. CPU int64 tensors of equal length; work is linear in
    their length, i.e. in the pages the step actually reads.
    """
    bs = meta.block_size
    starts, ends = meta.query_start_loc_cpu[:-1], meta.query_start_loc_cpu[1:]
    first_tile, last_tile = starts // Q_TILE, (ends - 1) // Q_TILE
    tiles_per_req = (last_tile - first_tile + 1).clamp(min=0)
    req = torch.repeat_interleave(torch.arange(meta.num_reqs), tiles_per_req)
    tile = first_tile[req] + _ranks(tiles_per_req)
    # First and last query token of the request inside the tile, as absolute positions.
    tok0 = torch.maximum(starts[req], tile * Q_TILE)
    tok1 = torch.minimum(ends[req], (tile + 1) * Q_TILE) - 1
    pos0 = meta.context_lens_cpu[req] + tok0 - starts[req]
    pos1 = meta.context_lens_cpu[req] + tok1 - starts[req]
    hi = pos1 // bs if causal else (meta.seq_lens_cpu[req] - 1) // bs
    lo = (pos0 - sliding_window + 1).clamp(min=0) // bs if sliding_window else torch.zeros_like(hi)
    pages_per_seg = (hi - lo + 1).clamp(min=0)
    seg = torch.repeat_interleave(torch.arange(len(req)), pages_per_seg)
    return tile[seg], req[seg], lo[seg] + _ranks(pages_per_seg)


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """[0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    total = int(counts.sum())
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(total) - torch.repeat_interleave(offsets, counts)


def paged_kv_blocks(
    meta: FlexAttentionMetadata,
    causal: bool,
    sliding_window: int | None,
    num_q_tiles: int,
    num_blocks: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_num_blocks [num_q_tiles] and kv_indices [num_q_tiles, width] (int32, device): for each
    query tile the distinct physical pages it reads, ascending. Pages shared by several requests
    of a tile (prefix caching) are listed once: a page listed twice would be attended twice.
    Fixed-size device ops only (a sort, not torch.unique), so building it never waits for the device.
    """
    device = meta.block_table.device
    tile, req, logical = (t.to(device, non_blocking=True) for t in tile_pages(meta, causal, sliding_window))
    keys = torch.sort(tile * num_blocks + meta.block_table[req, logical].long()).values  # by tile, then page
    distinct = torch.ones_like(keys, dtype=torch.bool)
    distinct[1:] = keys[1:] != keys[:-1]
    key_tile, key_page = keys // num_blocks, keys % num_blocks
    counts = torch.zeros(num_q_tiles, dtype=torch.long, device=device).scatter_add_(
        0, key_tile, distinct.long()
    )
    column = torch.cumsum(distinct.long(), 0) - 1 - (torch.cumsum(counts, 0) - counts)[key_tile]
    column = torch.where(distinct, column, width)  # repeats go to a spare column, dropped below
    kv_indices = torch.zeros(num_q_tiles, width + 1, dtype=torch.int32, device=device)
    kv_indices[key_tile, column] = key_page.to(torch.int32)
    return counts.to(torch.int32), kv_indices[:, :width].contiguous()


def physical_to_logical(meta: FlexAttentionMetadata, num_blocks: int) -> torch.Tensor:
    """int32 [num_blocks]: the logical page index of each physical page in this step, or -1."""
    return logical_pages(
        meta.block_table[: meta.num_reqs], meta.seq_lens[: meta.num_reqs], meta.block_size, num_blocks
    )


def logical_pages(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:
    """int32 [num_blocks]: the logical page index of each physical page the rows use, or -1.

    Invariant relied on: a page shared by several requests sits at the same logical index in
    each (prefix caching shares whole prefixes). A page repeated within one table keeps its
    latest logical index, the one whose contents it holds. Device ops only (no host sync).
    """
    bt = block_table.long()
    num_valid = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(bt.shape[1], device=bt.device).expand_as(bt)
    target = torch.where(cols < num_valid[:, None], bt, num_blocks)  # invalid entries -> a spare bucket
    inverse = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=bt.device)
    inverse.scatter_reduce_(0, target.flatten(), cols.flatten(), reduce="amax")
    return inverse[:num_blocks].to(torch.int32)


def paged_mask_mod(
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_logical: torch.Tensor,  # [pages in the KV layout]: logical page index, -1 = unused
    kv_physical: torch.Tensor,  # [pages in the KV layout]: physical page id
    block_size: int,
    causal: bool,
    sliding_window: int | None,
) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        req = q_req[q_idx]
        page = kv_idx // block_size
        logical = kv_logical[page]
        kv_pos = logical * block_size + kv_idx % block_size
        owned = (logical >= 0) & (block_table[req, logical.clamp(min=0)] == kv_physical[page])
        visible = owned & (kv_pos < seq_lens[req])
        if causal:
            visible = visible & (kv_pos <= q_pos[q_idx])
        if sliding_window is not None:
            visible = visible & (kv_pos > q_pos[q_idx] - sliding_window)
        return visible

    return mask_mod


def encoder_mask_mod(
    q_req: torch.Tensor, q_pos: torch.Tensor, pad_req: int, sliding_window: int | None
) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        req = q_req[q_idx]
        visible = (req == q_req[kv_idx]) & (req != pad_req)
        if sliding_window is not None:
            visible = visible & (q_pos[kv_idx] > q_pos[q_idx] - sliding_window)
        return visible

    return mask_mod


def encoder_kv_blocks(meta: FlexAttentionMetadata, num_q_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV tiles (of Q_TILE tokens) for bidirectional attention within the step's own tokens:
    the requests of a query tile are contiguous, so their tokens span one contiguous tile range.
    """
    num_tokens = meta.num_actual_tokens
    num_real = -(-num_tokens // Q_TILE)
    tiles = torch.arange(num_real)
    first_req = meta.q_req_cpu[tiles * Q_TILE]
    last_req = meta.q_req_cpu[torch.clamp((tiles + 1) * Q_TILE, max=num_tokens) - 1]
    lo = meta.query_start_loc_cpu[first_req] // Q_TILE
    hi = (meta.query_start_loc_cpu[last_req + 1] - 1) // Q_TILE
    counts = torch.zeros(num_q_tiles, dtype=torch.int64)
    counts[:num_real] = hi - lo + 1
    kv_indices = torch.zeros(num_q_tiles, num_q_tiles, dtype=torch.int64)
    kv_indices[:num_real] = (lo[:, None] + torch.arange(num_q_tiles)).clamp(max=num_q_tiles - 1)
    device = meta.block_table.device
    return (
        counts.to(device, torch.int32, non_blocking=True),
        kv_indices.to(device, torch.int32, non_blocking=True),
    )


def _pad(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    out = torch.full((length,), value, dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def _block_mask(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    tiles: tuple[int, int],
    mask_mod: MaskMod,
    seq_lengths: tuple[int, int],
) -> BlockMask:
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        BLOCK_SIZE=tiles,
        mask_mod=mask_mod,
        seq_lengths=seq_lengths,
        compute_q_blocks=False,  # inference only: the transposed (backward) index is never read
    )


def build_step_mask(
    meta: FlexAttentionMetadata,
    *,
    encoder: bool,
    causal: bool,
    sliding_window: int | None,
    q_len: int,
    num_blocks: int,
    compiled: bool,
) -> StepMask:
    """The BlockMask for one layer configuration of one step (q_len a multiple of Q_TILE).

    compiled: KV is the physical cache, with the sparse page structure from the block tables.
    Eager (paged): KV is a compact copy of the pages the step reads, listed densely, because
    eager flex_attention evaluates the mask over every (query, key) pair anyway.
    """
    num_q_tiles = q_len // Q_TILE
    q_req = _pad(meta.q_req, q_len, meta.pad_req)
    q_pos = _pad(meta.q_pos, q_len, -1)
    if encoder:
        kv_num_blocks, kv_indices = encoder_kv_blocks(meta, num_q_tiles)
        mask_mod = encoder_mask_mod(q_req, q_pos, meta.pad_req, sliding_window)
        return StepMask(
            _block_mask(kv_num_blocks, kv_indices, (Q_TILE, Q_TILE), mask_mod, (q_len, q_len)), None
        )

    bs = meta.block_size
    device = meta.block_table.device
    inverse = physical_to_logical(meta, num_blocks)
    if compiled:
        # The CPU kernel requires kv_indices as wide as the KV sequence has tiles; the GPU
        # kernel only needs room for what one query tile can read.
        width = num_blocks if device.type == "cpu" else min(num_blocks, Q_TILE * meta.block_table.shape[1])
        kv_num_blocks, kv_indices = paged_kv_blocks(
            meta, causal, sliding_window, num_q_tiles, num_blocks, width
        )
        kv_physical = torch.arange(num_blocks, dtype=torch.int32, device=device)
        mask_mod = paged_mask_mod(
            q_req, q_pos, meta.block_table, meta.seq_lens, inverse, kv_physical, bs, causal, sliding_window
        )
        return StepMask(
            _block_mask(kv_num_blocks, kv_indices, (Q_TILE, bs), mask_mod, (q_len, num_blocks * bs)), None
        )

    tile, req, logical = tile_pages(meta, causal, sliding_window)
    pages = torch.unique(meta.block_table[req.to(device), logical.to(device)].long())
    num_pages = pages.shape[0]
    kv_num_blocks = torch.full((num_q_tiles,), num_pages, dtype=torch.int32, device=device)
    kv_indices = torch.arange(num_pages, dtype=torch.int32, device=device).expand(num_q_tiles, -1)
    mask_mod = paged_mask_mod(
        q_req,
        q_pos,
        meta.block_table,
        meta.seq_lens,
        inverse[pages],
        pages.to(torch.int32),
        bs,
        causal,
        sliding_window,
    )
    return StepMask(
        _block_mask(kv_num_blocks, kv_indices, (Q_TILE, bs), mask_mod, (q_len, num_pages * bs)), pages
    )
