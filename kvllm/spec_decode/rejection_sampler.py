"""Rejection sampling of draft tokens: the output keeps the target model's distribution exactly.

A request with k drafts d_1..d_k is verified by one forward pass over [t, d_1, ..., d_k]: row j of its
target probabilities p_j (j < k) is the distribution of the token after d_1..d_j, and the step's
ordinary sample at the last position (`bonus`) is a draw from p_k. Draft j + 1 is accepted with
probability min(1, p_j(d) / q_j(d)), where q_j is the drafter's distribution (one-hot at d for
deterministic drafters: n-gram lookup, greedy draft models); at the first rejection a token is drawn
from the residual max(p_j - q_j, 0) (normalised) and the rest is dropped; when all k are accepted the
bonus token follows. This is the standard speculative-sampling construction (Leviathan et al., Chen
et al. 2023): each emitted token is distributed as the target samples it without speculation. Greedy
rows accept while the draft equals the target's argmax and correct with the argmax.

All device work; the host only supplies the per-request draft counts it already knows, and where
each draft sits in the [S, max_k + 1] output (`DraftLayout`, uploaded with the step's other inputs:
built here from the counts, a tensor made from host data would be a blocking copy on a GPU, which
waits for the forward pass the verification follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvllm.sample.metadata import SamplingMetadata
from kvllm.sample.sampler import draw, random_probs
from kvllm.utils.host_copy import upload_from_host


@dataclass
class RejectionOutput:
    """Per request, on the device: the emitted tokens (-1 past the end) and how many drafts were kept."""

    token_ids: torch.Tensor  # int64 [S, max_k + 1]
    num_accepted: torch.Tensor  # int64 [S]


@dataclass
class DraftLayout:
    """Where the D = sum(num_drafts) flat draft rows go in the [S, max_k + 1] output, on the device."""

    num_drafts: torch.Tensor  # int64 [S]
    draft_index: torch.Tensor  # int64 [D]: request * (max_k + 1) + the draft's position in its run


def draft_layout_host(num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`DraftLayout`'s two arrays on the host (numpy int64)."""
    ks = np.asarray(num_drafts, dtype=np.int64)
    total = int(ks.sum())
    width = int(ks.max()) + 1
    req = np.repeat(np.arange(len(ks), dtype=np.int64), ks)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(ks) - ks, ks)
    return ks, req * width + within


def draft_layout(num_drafts: list[int], device: torch.device) -> DraftLayout:
    """The layout of these draft counts, uploaded without blocking (one copy)."""
    ks, index = draft_layout_host(np.asarray(num_drafts, dtype=np.int64))
    both = upload_from_host(torch.from_numpy(np.concatenate([ks, index])), device)
    return DraftLayout(both[: len(ks)], both[len(ks) :])


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """float32 [D, V]: the distribution the sampler would draw each row's token from (greedy rows
    one-hot at the argmax). The metadata carries no sequence processors (see `can_speculate`)."""
    logits = logits.float()
    if md.all_greedy:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = random_probs(logits, md)
    if md.is_greedy is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(md.is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def rejection_sample(
    draft_logits: torch.Tensor,
    md: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    num_drafts: list[int],
    bonus_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    layout: DraftLayout | None = None,
) -> RejectionOutput:
    """Verify the drafts of S requests.

    draft_logits: [D, V] target logits at the D = sum(num_drafts) draft positions, request-major;
    md: sampling metadata of those D rows (a request's parameters and generator on each of its rows);
    draft_token_ids: int64 [D]; bonus_token_ids: int64 [S], each request's sample at its last position;
    draft_probs: [D, V] the drafter's distributions, or None for deterministic drafts (one-hot);
    layout: `num_drafts`' layout on the device (the input batch uploads it with the step), else built.
    """
    device = draft_logits.device
    num_reqs, total = len(num_drafts), sum(num_drafts)
    if draft_logits.shape[0] != total or draft_token_ids.shape[0] != total:
        raise ValueError(
            f"{total} drafts, but logits {tuple(draft_logits.shape)}, ids {tuple(draft_token_ids.shape)}"
        )
    max_k = max(num_drafts)
    drafts = draft_token_ids.long()
    if md.all_greedy:
        target = draft_logits.argmax(dim=-1)
        accepted = target == drafts
        recovered = target
    else:
        p = target_probs(draft_logits, md)
        p_draft = p.gather(1, drafts.unsqueeze(1)).squeeze(1)
        u = _uniforms(total, md, device)
        if draft_probs is None:
            accepted = u < p_draft  # q(d) = 1
            residual = p.scatter(1, drafts.unsqueeze(1), 0.0)
        else:
            q = draft_probs.float()
            q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
            accepted = u * q_draft < p_draft
            residual = (p - q).clamp_min_(0.0)
        # A zero residual only where p <= q everywhere, i.e. p == q: then nothing is ever rejected.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
        # draw() is scale-invariant: no need to normalise. Greedy rows (one-hot p) accept exactly
        # when the draft is the argmax, and their residual is one-hot at the argmax.
        recovered = draw(residual, md)
    if layout is None:
        layout = draft_layout(num_drafts, device)
    # Scatter the flat draft rows into [S, max_k + 1]; padding (and the last column) counts as rejected.
    width = max_k + 1
    index = layout.draft_index
    acc = torch.zeros(num_reqs * width, dtype=torch.long, device=device).index_copy_(
        0, index, accepted.long()
    )
    num_accepted = acc.view(num_reqs, width).cumprod(dim=1).sum(dim=1)
    flat = torch.full((2, num_reqs * width), -1, dtype=torch.int64, device=device)
    flat.index_copy_(1, index, torch.stack([drafts, recovered.long()]))
    out, rec = flat.view(2, num_reqs, width).unbind(0)
    # The token after the accepted run: the recovered one at the rejection, else the bonus.
    at = num_accepted.unsqueeze(1)
    last = torch.where(num_accepted < layout.num_drafts, rec.gather(1, at).squeeze(1), bonus_token_ids.long())
    positions = torch.arange(width, device=device).unsqueeze(0)
    out = out.masked_fill(positions >= at, -1).scatter_(1, at, last.unsqueeze(1))
    return RejectionOutput(out, num_accepted)


def _uniforms(num_rows: int, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row; seeded rows draw theirs from their own generator."""
    u = torch.rand(num_rows, device=device)
    for i, generator in md.generators.items():
        u[i] = torch.rand(1, device=device, generator=generator)[0]
    return u
