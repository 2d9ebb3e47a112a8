"""N-gram prompt lookup (vLLM's `ngram` method): drafts copied from where the sequence's suffix occurred.

For n from `max_n` down to `min_n`, the last n tokens are looked for earlier in the sequence; at the
latest earlier occurrence of the longest suffix found that k tokens follow (else the earliest), the
tokens that followed it are the draft.

The lookup runs after every verification, serialised behind it (speculation schedules without
overlap), so it is kept to one pass over the sequence: the earlier occurrences of the last token
are found with one vectorised compare, and only those candidates are extended backwards, token by
token up to `max_n`, to learn how long a suffix each matches (in place of one compare of every
window per n, max_n + ... + min_n tokens per position). `num_compared` counts the tokens compared.
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
        self.num_compared = 0  # tokens compared by all lookups so far (tests pin the work by it)

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """The draft for `token_ids` (prompt + output): [] when no suffix of min_n..max_n tokens recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Occurrences end before the sequence does (never the suffix itself): an occurrence of length
        # n ending at e (exclusive) covers tokens[e - n : e], with n <= e <= num - 1.
        max_n = min(self.max_n, num - 1)
        ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1]) + 1
        self.num_compared += num - 1
        best = 1 if len(ends) else 0
        for n in range(2, max_n + 1):  # keep the candidates that also match the suffix's n-th last token
            room = ends[ends >= n]
            self.num_compared += len(room)
            longer = room[tokens[room - n] == tokens[num - n]]
            if not len(longer):
                break
            ends, best = longer, n
        if best < self.min_n:
            return []
        # The latest occurrence that k tokens follow (the most recent context), else the earliest.
        full = ends[ends <= num - k]
        start = int(full[-1] if len(full) else ends[0])
        return tokens[start : start + k].tolist()
