"""N-gram prompt lookup (vLLM's `ngram` method): drafts copied from where the sequence's suffix occurred.

For n from `max_n` down to `min_n`, the last n tokens are looked for earlier in the sequence; at the
latest earlier occurrence of the longest suffix found that k tokens follow (else the earliest), the
tokens that followed it are the draft. Vectorized with numpy: each n compares every window at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to k draft tokens per sequence from its own tokens (no weights, on the host)."""

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """The draft for `token_ids` (prompt + output): [] when no suffix of min_n..max_n tokens recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        head = tokens[:-1]  # occurrences end before the sequence does: never the suffix itself
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(head, n)
            ends = np.flatnonzero((windows == tokens[num - n :]).all(axis=1)) + n
            if len(ends):
                # The latest occurrence that k tokens follow (the most recent context), else the earliest.
                full = ends[ends <= num - k]
                start = int(full[-1] if len(full) else ends[0])
                return tokens[start : start + k].tolist()
        return []
