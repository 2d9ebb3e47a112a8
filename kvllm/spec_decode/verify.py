"""Verification of a step's drafts in the model runner, and its result on the way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvllm.spec_decode.inputs import SpecInputs
from kvllm.spec_decode.rejection_sampler import RejectionOutput, rejection_sample


@dataclass
class PendingVerification:
    """The emitted tokens of the speculating requests, copied to the host without blocking: one copy,
    as each row's run ends at its first -1 (the accepted count is the run's length less one)."""

    scheduled_indices: list[int]
    num_drafts: list[int]
    token_ids: torch.Tensor  # int64 [S, max_k + 1] (pinned host memory on CUDA)
    event: torch.cuda.Event | None
    device_output: RejectionOutput  # the same, on the device (the draft model continues from it)

    def wait(self) -> dict[int, list[int]]:
        """Scheduled index -> the tokens the request emits this step (its accepted drafts and one more)."""
        if self.event is not None:
            self.event.synchronize()
        runs = {}
        for i, row in zip(self.scheduled_indices, self.token_ids.tolist()):
            runs[i] = row[: row.index(-1)] if row[-1] < 0 else row
        return runs


def verify_drafts(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    spec: SpecInputs,
    sampled_token_ids: torch.Tensor,
    token_table: torch.Tensor,
) -> PendingVerification:
    """Score the drafts with the step's hidden states, rejection-sample them, write the emitted tokens
    into the device token table (over the step's ordinary sample, which sits at the first slot) and
    start their copy to the host."""
    draft_logits = model.compute_logits(hidden.index_select(0, spec.logits_indices), upcast=False)
    bonus = sampled_token_ids.index_select(0, spec.sample_positions)
    out = rejection_sample(
        draft_logits, spec.sampling_metadata, spec.draft_token_ids, spec.num_drafts, bonus, layout=spec.layout
    )
    emitted = out.token_ids.view(-1).index_select(0, spec.output_index)
    token_table.view(-1).index_copy_(0, spec.table_slots, emitted.to(token_table.dtype))
    token_ids, event = out.token_ids, None
    if token_ids.device.type == "cuda":
        token_ids = torch.empty(out.token_ids.shape, dtype=torch.int64, pin_memory=True)
        token_ids.copy_(out.token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return PendingVerification(spec.scheduled_indices, spec.num_drafts, token_ids, event, out)
