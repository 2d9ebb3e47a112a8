"""Full CUDA graphs of uniform decode steps, one query token per request and, with speculative
decoding, k + 1 (vLLM's `uniform_decode_query_len`): the pair of runners and which one a step takes.

A verification step schedules each request's last token and its drafts: k + 1 tokens, or fewer
when the proposer found fewer (an n-gram without a match proposes none). Such a step replays the
k + 1 graph of its padded size whatever its mix of draft counts (cuda_graph.py: shorter queries are
packed, the rest of the token rows padding), so the graph hit rate does not depend on how many
drafts each request has, and the output is the eager step's exactly. A step without drafts takes
the one-token graph: k + 1 token rows would cost more than it needs. Steps with a longer query (a
prompt chunk) run piecewise or eagerly.

The draft model replays graphs of the same shapes over the same input buffers for the step's
tokens (its cache follows the target's), so one `UniformDecodeGraphs` serves each model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvllm.attention.impl import AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.worker.cuda_graph import CaptureStats, CudaGraphRunner, Forward

logger = logging.getLogger(__name__)


def spec_capture_sizes(capture_sizes: Sequence[int], query_len: int, max_num_tokens: int) -> list[int]:
    """The batch sizes whose k + 1 token graph fits the token buffers (and the step's token budget)."""
    return [s for s in capture_sizes if s * query_len <= max_num_tokens]


class UniformDecodeGraphs:
    """The one-token runner and, when `spec_query_len` > 1, the k + 1 token runner of one model.

    `capture_metadata(num_reqs, query_len)` is the input batch's dummy batch for a capture. The k + 1
    runner exists only for builders with `uniform_batch_graphs` (the others capture q = 1 only).
    """

    def __init__(
        self,
        forward: Forward,
        builder: AttentionMetadataBuilder,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        capture_sizes: list[int],
        capture_metadata: Callable[..., CommonAttentionMetadata],
        spec_query_len: int = 1,
        graph_factory: Callable[[], Any] | None = None,
        pool: Any = None,
    ) -> None:
        self.single = CudaGraphRunner(
            forward,
            builder,
            input_ids,
            positions,
            capture_sizes,
            capture_metadata,
            graph_factory=graph_factory,
            pool=pool,
        )
        self.multi: CudaGraphRunner | None = None
        max_tokens = min(input_ids.shape[0], positions.shape[0], builder.max_num_tokens)
        sizes = spec_capture_sizes(capture_sizes, spec_query_len, max_tokens)
        if spec_query_len > 1 and not type(builder).uniform_batch_graphs:
            logger.info(
                "Verification steps (%d query tokens per request) run piecewise: the %s attention "
                "backend captures one-token decode graphs only",
                spec_query_len,
                builder.backend.name,
            )
        elif spec_query_len > 1 and sizes:
            self.multi = CudaGraphRunner(
                forward,
                builder,
                input_ids,
                positions,
                sizes,
                functools.partial(capture_metadata, query_len=spec_query_len),
                graph_factory=graph_factory,
                query_len=spec_query_len,
                pool=self.single.pool,
            )

    @property
    def runners(self) -> list[CudaGraphRunner]:
        return [self.single] if self.multi is None else [self.single, self.multi]

    @property
    def pool(self) -> Any:
        return self.single.pool

    def capture(self) -> CaptureStats:
        """Capture both runners into one pool (the larger graphs first)."""
        stats = [r.capture() for r in reversed(self.runners)]
        return CaptureStats(
            sorted({s for st in stats for s in st.sizes}),
            sum(st.seconds for st in stats),
            sum(st.memory_bytes for st in stats),
        )

    def select(self, num_reqs: int, max_query_len: int) -> tuple[CudaGraphRunner, int] | None:
        """The runner and padded size for a step of `num_reqs` requests whose longest query has
        `max_query_len` tokens, or None when no graph holds it."""
        for runner in self.runners:
            if max_query_len <= runner.query_len:
                size = runner.padded_size(num_reqs)
                return None if size is None else (runner, size)
        return None

    def runner_for(self, common: CommonAttentionMetadata) -> CudaGraphRunner | None:
        """The runner whose graphs replay this already padded batch (another model's graph shape)."""
        for runner in self.runners:
            if runner.can_replay(common):
                return runner
        return None

    def replay_counts(self) -> dict[int, int]:
        """Replays so far, by query tokens per request (1, k + 1)."""
        return {r.query_len: r.num_replays for r in self.runners}
