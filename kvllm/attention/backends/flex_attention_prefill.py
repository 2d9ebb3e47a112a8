"""FLEX_ATTENTION's fresh-prefill path: prompts with nothing cached attend over the step's own K/V.

A prefill with no cached context reads only the keys and values it writes in the same step, and
those arrive contiguous. So the step's fresh prefills run as one packed sequence over the step's
own K/V (no page gathering), with a document-causal mask and FlexAttention's large default tiles
(TILE x TILE BlockMask blocks) instead of one page per KV tile. The block structure is computed
on the host from the scheduler's CPU offsets and copied without waiting for the device: per query tile, the KV tiles from
the first document it touches (or the window's edge) to the diagonal; tiles wholly inside one
document, below the diagonal and inside the window are *full* (the kernel skips the mask there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvllm.attention.backends.flex_attention_mask import MaskMod

TILE = 128  # query and KV tile of the BlockMask; FlexAttention's default kernel tiles divide it


@dataclass
class FreshPrefill:
    """The step's fresh prefills: query/key rows [start, start + num_tokens) of the step, packed."""

    start: int  # first token of the prefills (the decode tokens come before)
    num_tokens: int
    block_mask: BlockMask


def padded_length(num_tokens: int) -> int:
    """The packed sequence's length: a power of two, at least one tile (bounds recompilation)."""
    return max(TILE, 1 << (max(num_tokens, 1) - 1).bit_length())


def fresh_prefill(
    query_start_loc_cpu: torch.Tensor,  # int64 [num_reqs + 1]
    first_req: int,
    sliding_window: int | None,
    device: torch.device,
) -> FreshPrefill:
    """The BlockMask of requests first_req.. (all fresh: query tokens = their whole sequence)."""
    qsl = query_start_loc_cpu[first_req:].long()
    start, num_tokens = int(qsl[0]), int(qsl[-1] - qsl[0])
    starts, ends = qsl[:-1] - start, qsl[1:] - start  # packed token ranges of the documents
    length = padded_length(num_tokens)
    num_tiles = length // TILE
    doc = torch.full((length,), -1, dtype=torch.int32)
    doc[:num_tokens] = torch.repeat_interleave(torch.arange(len(starts), dtype=torch.int32), ends - starts)
    tiles = torch.arange(num_tiles)
    first_tok, last_tok = tiles * TILE, torch.clamp((tiles + 1) * TILE, max=num_tokens) - 1
    live = first_tok < num_tokens
    first_doc = doc[first_tok.clamp(max=length - 1)].long().clamp(min=0)
    last_doc = doc[last_tok.clamp(min=0)].long().clamp(min=0)
    lo_tok = starts[first_doc]
    if sliding_window is not None:
        lo_tok = torch.maximum(lo_tok, first_tok - sliding_window + 1)
    lo = lo_tok // TILE
    # Full KV tiles: [full_lo, tile) when the query tile lies inside one document.
    one_doc = live & (first_doc == last_doc) & (last_tok - first_tok == TILE - 1)
    full_lo = -(-starts[first_doc] // TILE)  # first tile wholly inside the document
    if sliding_window is not None:  # every pair within the window: (tile end) - (kv tile start) < window
        full_lo = torch.maximum(full_lo, ((tiles + 1) * TILE - sliding_window) // TILE + 1)
    full_lo = torch.where(one_doc, torch.minimum(torch.maximum(full_lo, lo), tiles), tiles)
    full_count = (tiles - full_lo).clamp(min=0)
    partial_count = torch.where(live, full_lo - lo + 1, torch.zeros_like(lo))
    cols = torch.arange(num_tiles)
    # Partial tiles: [lo, full_lo) and the diagonal; full tiles: [full_lo, tile).
    partial = torch.where(cols[None] < (full_lo - lo)[:, None], lo[:, None] + cols[None], tiles[:, None])
    full = (full_lo[:, None] + cols[None]).clamp(max=num_tiles - 1)
    to_device = lambda t: t.to(device=device, dtype=torch.int32, non_blocking=True)[None, None]  # noqa: E731
    block_mask = BlockMask.from_kv_blocks(
        to_device(partial_count),
        to_device(partial.clamp(max=num_tiles - 1)),
        to_device(full_count),
        to_device(full),
        BLOCK_SIZE=(TILE, TILE),
        mask_mod=document_causal_mask_mod(doc.to(device, non_blocking=True), sliding_window),
        seq_lengths=(length, length),
        compute_q_blocks=False,
    )
    return FreshPrefill(start, num_tokens, block_mask)


def document_causal_mask_mod(doc: torch.Tensor, sliding_window: int | None) -> MaskMod:
    """Within one document (doc id; -1 = padding), causal, and inside the window if any."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        visible = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0) & (kv_idx <= q_idx)
        if sliding_window is not None:
            visible = visible & (q_idx - kv_idx < sliding_window)
        return visible

    return mask_mod
