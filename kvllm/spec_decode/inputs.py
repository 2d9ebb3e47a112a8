"""The verification inputs of one step: which hidden rows score which drafts, and where results go.

A speculating request's query is [t, d_1, ..., d_k] at positions n-1 .. n-1+k (n: its known tokens);
the drafts sit in the device token table at positions n .. n+k-1 (written by the input batch with
the step's prompts), so the input ids are gathered as for any chunk. Hidden row j of the query
(j < k) gives the target's distribution for d_{j+1}; row k, the step's ordinary sample, the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvllm.sample.metadata import SamplingMetadata
from kvllm.spec_decode.rejection_sampler import DraftLayout


@dataclass
class SpecInputs:
    """Device tensors of a step's verification (S speculating requests, D drafts in all)."""

    scheduled_indices: list[int]  # positions in `scheduled` of the S requests, in order
    num_drafts: list[int]  # k per request
    sample_positions: torch.Tensor  # int64 [S]: each request's row in the step's ordinary samples
    query_starts: torch.Tensor  # int64 [S]: each request's first hidden row (its last known token)
    logits_indices: torch.Tensor  # int64 [D]: the hidden rows scoring the drafts, request-major
    draft_token_ids: torch.Tensor  # int64 [D]
    sampling_metadata: SamplingMetadata  # of the D draft rows (each request's row repeated)
    # Where the emitted tokens go in the device token table: flat slot, and flat index into the
    # [S, max_k + 1] output, for j = 0..k of each request (entries past the accepted run are -1,
    # at positions the next step overwrites before reading).
    table_slots: torch.Tensor  # int64 [D + S]
    output_index: torch.Tensor  # int64 [D + S]
    layout: DraftLayout  # the drafts' places in the rejection sampler's [S, max_k + 1] output
    sample_positions_host: np.ndarray  # `sample_positions` as the host built it (no read back)


def spec_layout(
    num_drafts: np.ndarray, query_starts_cu: np.ndarray, samples: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the requests with drafts: their scheduled indices, their sample positions and the flat
    hidden rows of their draft positions (numpy, host)."""
    spec = np.flatnonzero(num_drafts)
    sample_pos = np.searchsorted(samples, spec)
    assert (samples[sample_pos] == spec).all(), "a request with drafts always samples"
    ks = num_drafts[spec]
    first = np.repeat(query_starts_cu[spec], ks)
    within = np.arange(int(ks.sum())) - np.repeat(np.cumsum(ks) - ks, ks)
    return spec, sample_pos, first + within


def output_slots(
    rows: np.ndarray, num_tokens: np.ndarray, ks: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat token-table slots of the k + 1 positions after each request's last known token, and the
    matching flat indices into the [S, max_k + 1] output."""
    counts = ks + 1
    req = np.repeat(np.arange(len(rows)), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    slots = rows[req] * max_model_len + num_tokens[req] + j
    return slots, req * (int(ks.max()) + 1) + j
