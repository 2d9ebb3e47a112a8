"""The decode fast path: a CUDA-graph decode step of the same requests as the step before it, advanced
by one token on the device instead of rebuilt on the host.

Most steps of a generation are exactly that: the same rows, one new token each. The full
`InputBatch.prepare` computes positions, slots, token indices and the sampling metadata with some
sixty numpy and torch calls (0.46 ms a step at batch 1 on the H200 host, a third of the step,
benchmarks/h200/host_profile.py); here one kernel adds one to each request's position and sequence
length, reads its new input id from the device token table, recomputes its slot from the device
block table, and moves the slot its sampled id will be written to. The previous step's sampling
metadata is reused when nothing in it depends on the step (`sampling_is_static`).

Invariants the fast path relies on (checked by `InputBatch` before it takes it):
- the previous step was a uniform decode replayed in a graph of the same size, every request sampled,
  and the rows are the same, in the same order; no row was added since (no prompt to upload);
- the device buffers still hold that step's inputs (nothing else writes them between steps);
- block ids appended this step reach the device block table (`_sync_rows_to_device`) before the
  kernel runs, in stream order.
Padded requests (rows past the real ones in a graph batch) are left as the previous step wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvllm.sample.metadata import SamplingMetadata

BLOCK = 128


@triton.jit
def _advance_decode_kernel(
    positions_ptr,  # int32 [R]: the previous step's positions, advanced in place
    seq_lens_ptr,  # int32 [R]
    slots_ptr,  # int64 [R]
    sample_slots_ptr,  # int64 [R]: flat token-table index each sampled id is written to
    rows_ptr,  # int64 [R]: each request's row in the input batch
    input_ids_ptr,  # int32 [R]
    token_ids_ptr,  # int32 [max_reqs, max_model_len], flat
    block_table_ptr,  # int32 [max_reqs, max_blocks_per_req], flat
    num_reqs,
    max_model_len,
    max_blocks_per_req,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_reqs
    pos = tl.load(positions_ptr + offs, mask=mask, other=0) + 1
    row = tl.load(rows_ptr + offs, mask=mask, other=0)
    block = tl.load(block_table_ptr + row * max_blocks_per_req + pos // BLOCK_SIZE, mask=mask, other=0)
    tl.store(positions_ptr + offs, pos, mask=mask)
    tl.store(seq_lens_ptr + offs, pos + 1, mask=mask)
    tl.store(slots_ptr + offs, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    token = tl.load(token_ids_ptr + row * max_model_len + pos, mask=mask, other=0)
    tl.store(input_ids_ptr + offs, token, mask=mask)
    sample_slot = tl.load(sample_slots_ptr + offs, mask=mask, other=0)
    tl.store(sample_slots_ptr + offs, sample_slot + 1, mask=mask)


def advance_decode(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    sample_slots: torch.Tensor,
    rows: torch.Tensor,
    input_ids: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> None:
    """Advance the first `len(rows)` decode requests' inputs by one token, in place (see the module
    docstring). One Triton launch on a GPU; the same arithmetic in torch on the CPU."""
    num_reqs = rows.shape[0]
    if num_reqs == 0:
        return
    max_model_len = token_ids.shape[1]
    max_blocks = block_table.shape[1]
    if positions.is_cuda:
        _advance_decode_kernel[(triton.cdiv(num_reqs, BLOCK),)](
            positions, seq_lens, slots, sample_slots, rows, input_ids, token_ids, block_table,
            num_reqs, max_model_len, max_blocks,
            BLOCK_SIZE=block_size, BLOCK=BLOCK,
        )  # fmt: skip
        return
    pos = positions[:num_reqs] + 1
    positions[:num_reqs] = pos
    seq_lens[:num_reqs] = pos + 1
    blocks = block_table[rows, (pos // block_size).long()].long()
    slots[:num_reqs] = blocks * block_size + (pos % block_size).long()
    input_ids[:num_reqs] = token_ids.view(-1)[rows * max_model_len + pos.long()]
    sample_slots[:num_reqs] += 1


@dataclass
class DecodeStepMemory:
    """What the fast path needs of the previous graph decode step."""

    rows: np.ndarray  # int64 [num_reqs], the step's rows in order
    pad_to: int
    seq_lens: np.ndarray  # int32 [pad_to], host copy (padding 0)
    query_start_loc: torch.Tensor  # int32 [pad_to + 1], host copy
    sampling_metadata: SamplingMetadata | None  # None when it must be rebuilt each step
    sampling_request_indices: list[int]
