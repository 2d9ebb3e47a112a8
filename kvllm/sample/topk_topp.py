"""Distribution truncation after temperature: top-k, top-p (nucleus) and min-p, vectorised over rows.

Masked tokens get -inf logits; every function keeps at least the most likely token of each row.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    all_top_k: bool,
) -> torch.Tensor:
    """Return logits with tokens outside each row's top-k and nucleus masked.

    `top_k` is [n] int64 with values in [1, V] (V = disabled); `top_p` is [n] float32 in (0, 1]
    (1 = disabled). `max_top_k` is the largest active k and `all_top_k` says whether every row has
    one; both are known on the host, so no device value is read here. Top-k keeps tokens whose logit is >= the k-th largest (ties may keep more).
    Top-p keeps the smallest set of most likely tokens whose probability mass reaches p,
    computed on the distribution that top-k left.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        is_active = (top_k < vocab_size).unsqueeze(1)
        top_values = logits.topk(max_top_k, dim=-1).values  # no full sort for disabled rows
        kth = top_values.gather(1, (top_k - 1).clamp(max=max_top_k - 1).unsqueeze(1))
        return logits.masked_fill(is_active & (logits < kth), float("-inf"))
    if top_k is not None and all_top_k:
        return _top_p_within_top_k(logits, top_k, top_p, max_top_k)
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token is dropped when the mass at or below it is <= 1 - p, i.e. the tokens above it reach p.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_within_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int
) -> torch.Tensor:
    """Top-k then top-p when every row has a top-k: sorts only the max_k candidates, not the vocab."""
    candidates = logits.topk(max_k, dim=-1).values  # descending
    positions = torch.arange(max_k, device=logits.device)
    kth = candidates.gather(1, (top_k - 1).unsqueeze(1))
    # Ties with the k-th value stay in, as in the top-k-only path.
    candidates = candidates.masked_fill((positions >= top_k.unsqueeze(1)) & (candidates < kth), float("-inf"))
    probs = candidates.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    keep = mass_above < top_p.unsqueeze(1)
    keep[:, 0] = True
    # The smallest kept logit; everything below it is outside the nucleus (or the top-k).
    cutoff = candidates.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
