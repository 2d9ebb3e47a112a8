"""Pooler: a prompt's hidden states become its embedding, chunk by chunk (CLS, LAST or MEAN, normalized).

A pooling request is one prefill that the scheduler may split into chunks (causal models); each step
hands the pooler the hidden rows of the chunks it ran. The pooler keeps, per request, what its type
needs from the chunks so far (the first row for CLS, a float32 running sum for MEAN, nothing for
LAST) and finishes the vector on the chunk that ends the prompt. A chunk starting at position 0
restarts the request (a preemption recomputes from the start); requests that finish, abort or are
preempted drop their state. Prefix caching would skip the cached rows, so the engine allows it only
for LAST pooling of causal models (the last token is always computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvllm.config.pooler import PoolerConfig
from kvllm.core.sched_output import SchedulerOutput


@dataclass
class _Partial:
    first: torch.Tensor | None = None  # CLS: the prompt's first row
    total: torch.Tensor | None = None  # MEAN: float32 sum of the rows so far
    count: int = 0


class Pooler:
    """Pools the hidden states of each pooling request's prompt into one float32 vector."""

    def __init__(self, config: PoolerConfig) -> None:
        assert config.seq_pooling_type is not None and config.use_activation is not None, "resolved config"
        self.config = config
        self.pooling_type = config.seq_pooling_type
        self._partials: dict[str, _Partial] = {}

    def forget(self, request_ids: set[str] | list[str]) -> None:
        for request_id in request_ids:
            self._partials.pop(request_id, None)

    def pool(
        self, step: SchedulerOutput, token_starts: list[int], query_starts: list[int], hidden: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Scheduled index -> embedding (on the device) of each request whose prompt ends in this step.

        `token_starts[i]`: request i's first row in `hidden`; `query_starts[i]`: the prompt position
        of that row."""
        self.forget(step.finished_req_ids)
        self.forget([r.request_id for r in step.preempted])
        pooled: dict[int, torch.Tensor] = {}
        for i, item in enumerate(step.scheduled):
            request = item.request
            start, n = query_starts[i], item.num_new_tokens
            rows = hidden[token_starts[i] : token_starts[i] + n]
            if start == 0 or request.request_id not in self._partials:
                self._partials[request.request_id] = _Partial()
            partial = self._partials[request.request_id]
            if self.pooling_type == "CLS" and start == 0:
                partial.first = rows[0]
            elif self.pooling_type == "MEAN":
                chunk_sum = rows.float().sum(dim=0)
                partial.total = chunk_sum if partial.total is None else partial.total + chunk_sum
                partial.count += n
            if start + n < len(request.prompt_token_ids):
                continue
            del self._partials[request.request_id]
            if self.pooling_type == "CLS":
                vector = partial.first
            elif self.pooling_type == "MEAN":
                vector = partial.total / partial.count
            else:
                vector = rows[-1]
            assert vector is not None, f"{request.request_id}: the prompt's first chunk was not seen"
            pooled[i] = self._finish(vector.float(), request.pooling_params)
        return pooled

    def _finish(self, vector: torch.Tensor, params: object) -> torch.Tensor:
        dimensions = getattr(params, "dimensions", None) or self.config.dimensions
        if dimensions is not None:
            vector = vector[:dimensions]
        use_activation = getattr(params, "use_activation", None)
        if use_activation is None:
            use_activation = self.config.use_activation
        return F.normalize(vector, p=2, dim=-1) if use_activation else vector
