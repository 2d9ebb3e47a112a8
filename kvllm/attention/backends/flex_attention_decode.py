"""FLEX_ATTENTION's decode path: decode-only steps through FlexAttention's decoding kernel.

A step whose requests all have one query token runs as a batch of requests (padded to a power
of two), q_len 1, over the physical cache as one KV sequence shared by the batch (KV batch 1).
The BlockMask lists, per request, its own pages straight from the block table: the pages
before the last (after the window's first, with a sliding window) as *full* blocks, which the
kernel reads without evaluating the mask, and the last (and window-first) page as partial blocks,
where the mask cuts at seq_len (and at the window's edge).

torch's decoding kernel (torch/_inductor/kernel/flex/templates/flex_decode.py.jinja) assumes the
partial and the full index tensors have one shape: it offsets FULL_KV_IDX by a batch row computed
with KV_IDX's strides, and wraps each split's first index at KV_IDX's width. So `kv_indices` is as
wide as `full_kv_indices` (its two partial pages first, zeros after), though at most two are live;
with a narrower `kv_indices` every request but the first read another row's full pages (H200: bf16
logprob errors of 10-25 once decodes had a full page). Eager flex evaluates the mask everywhere and
cannot show this; tests/kernels/test_flex_attention_split.py checks the layout that kernel reads.

Everything is computed on the device from the device block table and seq_lens (no host sync),
into buffers this object owns: one set per padded batch size and window, rewritten in place each
step, with one BlockMask object over them. So every layer of a step and every later step reuse
the same BlockMask and tensors, and the compiled decoding kernel keeps hitting its guards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvllm.attention.backends.flex_attention_mask import MaskMod, logical_pages

# The BlockMask's query block: one block holds the single query row (torch's decoding default).
DECODE_Q_BLOCK = 128


@dataclass
class _DecodeBuffers:
    kv_num_blocks: torch.Tensor  # int32 [B, 1, 1]: partial blocks per request (last, window-first)
    kv_indices: torch.Tensor  # int32 [B, 1, 1, width]: those two, then zeros (see the module docstring)
    full_kv_num_blocks: torch.Tensor  # int32 [B, 1, 1]
    full_kv_indices: torch.Tensor  # int32 [B, 1, 1, width]
    block_table: torch.Tensor  # int32 [B, max_blocks]: the step's rows, zero past num_reqs
    seq_lens: torch.Tensor  # int32 [B]; 0 past num_reqs
    kv_logical: torch.Tensor  # int32 [num_blocks]: logical index of each physical page, -1 = unused
    block_mask: BlockMask


def decode_bucket(num_reqs: int) -> int:
    """Padded batch of a decode step: the next power of two."""
    return 1 << (max(num_reqs, 1) - 1).bit_length()


class FlexDecodeMasks:
    """The decode BlockMasks of one metadata builder, kept across steps (see the module docstring)."""

    def __init__(self, block_size: int, max_blocks: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        # Both index tensors' last dimension (torch's decoding kernel needs them to match).
        self.index_width = max(2, max_blocks)
        self.device = device
        self._buffers: dict[tuple[int, int, int | None], _DecodeBuffers] = {}

    def block_mask(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_reqs: int,
        num_blocks: int,
        sliding_window: int | None,
    ) -> BlockMask:
        """The step's mask for `num_reqs` decodes (rows of the device `block_table` / `seq_lens`)."""
        batch = decode_bucket(num_reqs)
        key = (batch, num_blocks, sliding_window)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = self._allocate(batch, num_blocks, sliding_window)
        self._update(buffers, block_table, seq_lens, num_reqs, sliding_window)
        return buffers.block_mask

    def _allocate(self, batch: int, num_blocks: int, sliding_window: int | None) -> _DecodeBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=self.device)

        parts = {
            "kv_num_blocks": zeros(batch, 1, 1),
            "kv_indices": zeros(batch, 1, 1, self.index_width),
            "full_kv_num_blocks": zeros(batch, 1, 1),
            "full_kv_indices": zeros(batch, 1, 1, self.index_width),
            "block_table": zeros(batch, self.max_blocks),
            "seq_lens": zeros(batch),
            "kv_logical": torch.full((num_blocks,), -1, dtype=torch.int32, device=self.device),
        }
        mask_mod = decode_mask_mod(parts["block_table"], parts["seq_lens"], parts["kv_logical"],
                                   self.block_size, sliding_window)  # fmt: skip
        block_mask = BlockMask.from_kv_blocks(
            parts["kv_num_blocks"],
            parts["kv_indices"],
            parts["full_kv_num_blocks"],
            parts["full_kv_indices"],
            BLOCK_SIZE=(DECODE_Q_BLOCK, self.block_size),
            mask_mod=mask_mod,
            seq_lengths=(1, num_blocks * self.block_size),
            compute_q_blocks=False,
        )
        return _DecodeBuffers(**parts, block_mask=block_mask)

    def _update(
        self,
        buf: _DecodeBuffers,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_reqs: int,
        sliding_window: int | None,
    ) -> None:
        bs, width = self.block_size, self.max_blocks
        buf.block_table.zero_()
        buf.block_table[:num_reqs] = block_table[:num_reqs, :width]
        buf.seq_lens.zero_()
        buf.seq_lens[:num_reqs] = seq_lens[:num_reqs]
        seq = buf.seq_lens.long()
        pages = (seq + bs - 1) // bs  # the request's pages; 0 for padding rows
        last = (pages - 1).clamp(min=0)
        first = ((seq - sliding_window).clamp(min=0) // bs) if sliding_window else torch.zeros_like(seq)
        two_partial = (first < last) if sliding_window else torch.zeros_like(seq, dtype=torch.bool)
        live = pages > 0
        rows = buf.block_table.long()
        buf.kv_indices[:, 0, 0, 0] = rows.gather(1, last[:, None])[:, 0].to(torch.int32)
        buf.kv_indices[:, 0, 0, 1] = rows.gather(1, first[:, None])[:, 0].to(torch.int32)
        buf.kv_num_blocks[:, 0, 0] = (live.int() + two_partial.int()).to(torch.int32)
        # Full pages: [first + 1, last) with a window (first is partial), [0, last) without.
        start = first + 1 if sliding_window else first
        full = torch.where(live, (last - start).clamp(min=0), torch.zeros_like(last))
        cols = (start[:, None] + torch.arange(self.index_width, device=self.device)).clamp(max=width - 1)
        buf.full_kv_indices[:, 0, 0] = rows.gather(1, cols).to(torch.int32)
        buf.full_kv_num_blocks[:, 0, 0] = full.to(torch.int32)
        buf.kv_logical.copy_(logical_pages(buf.block_table, buf.seq_lens, bs, buf.kv_logical.shape[0]))


def decode_mask_mod(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_logical: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> MaskMod:
    """Request b's one query (at position seq_len - 1) sees physical slot kv iff the slot's page is
    in b's table at the page's logical index and the position is below seq_len (and in the window).
    Complete on its own (eager flex evaluates it everywhere); the compiled kernel only where partial."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        page = kv_idx // block_size
        logical = kv_logical[page]
        kv_pos = logical * block_size + kv_idx % block_size
        owned = (logical >= 0) & (block_table[b, logical.clamp(min=0)] == page)
        visible = owned & (kv_pos < seq_lens[b])
        if sliding_window is not None:
            visible = visible & (kv_pos >= seq_lens[b] - sliding_window)
        return visible

    return mask_mod
