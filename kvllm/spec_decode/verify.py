"""Verification of a step's drafts in the model runner, and its result on the way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvllm.spec_decode.inputs import SpecInputs
from kvllm.spec_decode.rejection_sampler import RejectionOutput, rejection_sample


@dataclass
class PendingVerification:
    """The emitted tokens of the speculating requests, copied to the host without blocking."""

    scheduled_indices: list[int]
    num_drafts: list[int]
    token_ids: torch.Tensor  # int64 [S, max_k + 1] (pinned host memory on CUDA)
    num_accepted: torch.Tensor  # int64 [S]
    event: torch.cuda.Event | None
    device_output: RejectionOutput  # the same, on the device (the draft model continues from it)

    def wait(self) -> dict[int, list[int]]:
        """Scheduled index -> the tokens the request emits this step (its accepted drafts and one more)."""
        if self.event is not None:
            self.event.synchronize()
        tokens, accepted = self.token_ids.tolist(), self.num_accepted.tolist()
        return {i: row[: a + 1] for i, row, a in zip(self.scheduled_indices, tokens, accepted)}


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
    out = rejection_sample(draft_logits, spec.sampling_metadata, spec.draft_token_ids, spec.num_drafts, bonus)
    emitted = out.token_ids.view(-1).index_select(0, spec.output_index)
    token_table.view(-1).index_copy_(0, spec.table_slots, emitted.to(token_table.dtype))
    token_ids, num_accepted, event = out.token_ids, out.num_accepted, None
    if token_ids.device.type == "cuda":
        token_ids = torch.empty(out.token_ids.shape, dtype=torch.int64, pin_memory=True)
        num_accepted = torch.empty(out.num_accepted.shape, dtype=torch.int64, pin_memory=True)
        token_ids.copy_(out.token_ids, non_blocking=True)
        num_accepted.copy_(out.num_accepted, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return PendingVerification(spec.scheduled_indices, spec.num_drafts, token_ids, num_accepted, event, out)
