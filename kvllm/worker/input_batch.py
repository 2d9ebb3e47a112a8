"""Turns a scheduler step into the flat tensors one forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.core.sched_output import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_metadata: CommonAttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]: last token of each request that samples this step
    sampling_request_indices: list[int]  # positions in `scheduled` of those N requests


def prepare_inputs(step: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """Flatten the scheduled requests (already ordered decodes first) into model inputs.

    Token-level arrays are built with numpy from per-request slices; the only Python loop is
    over requests.
    """
    scheduled = step.scheduled
    num_reqs = len(scheduled)
    query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    seq_lens = starts + query_lens
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    num_tokens = int(cu[-1])

    input_ids = np.concatenate(
        [
            np.asarray(s.request.all_token_ids[st : st + n], dtype=np.int64)
            for s, st, n in zip(scheduled, starts, query_lens)
        ]
    )
    # Absolute position of every token: its request's start plus its offset in the chunk.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = starts[req_of_token] + (np.arange(num_tokens) - cu[:-1][req_of_token])

    max_blocks = max(len(s.block_ids) for s in scheduled)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    for i, s in enumerate(scheduled):
        block_table[i, : len(s.block_ids)] = s.block_ids
    slot_mapping = block_table[req_of_token, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size

    num_decodes = 0
    while num_decodes < num_reqs and query_lens[num_decodes] == 1:
        num_decodes += 1

    # Only requests whose chunk reaches their last known token produce a next token.
    samples = [i for i, s in enumerate(scheduled) if seq_lens[i] == s.request.num_tokens]
    logits_indices = cu[1:][samples] - 1

    def to_dev(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    qsl_cpu = torch.from_numpy(cu.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    metadata = CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table=to_dev(block_table),
        slot_mapping=to_dev(slot_mapping),
    )
    return ModelInputs(
        input_ids=to_dev(input_ids),
        positions=to_dev(positions),
        attn_metadata=metadata,
        logits_indices=to_dev(np.asarray(logits_indices, dtype=np.int64)),
        sampling_request_indices=samples,
    )
