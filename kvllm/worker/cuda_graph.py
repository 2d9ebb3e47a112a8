"""CUDA graphs for uniform-decode steps: one graph per batch-size bucket, captured largest first.

A decode step of a small model is hundreds of short kernels; launched one by one from Python the
host, not the GPU, sets the step time. A captured graph replays them with one launch. What a graph
reads must sit at fixed addresses, so the forward pass reads its token ids and positions from
buffers the input batch fills in place, and the attention builder copies its metadata into buffers
of its own (`prepare_for_capture` / `prepare_for_replay`); every launch decision inside the graph
depends on the padded batch size only.

Padding convention (the input batch writes it): a batch of R requests replayed in the graph of
size B >= R has requests R..B-1 with query length 0 and sequence length 0, and tokens R..B-1 with
slot -1, so padded rows write no KV and attend to nothing; their hidden states are ignored.

With speculative decoding a second runner captures `query_len` = k + 1 tokens per request (vLLM's
uniform_decode_query_len): B requests, B * (k + 1) token rows. A verification step replays it when
every request has at most k + 1 query tokens: a request with fewer drafts (or none) simply has a
shorter query, its tokens packed after the previous request's; the token rows after the last real
token are padding (slot -1). So mixed draft counts hit the same graph and stay exact.

`graph_factory` is `torch.cuda.CUDAGraph` on a GPU; tests pass `EagerGraph`, which replays by
calling the forward again on the same buffers, so the runner's logic runs without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvllm.attention.impl import AttentionMetadataBuilder
from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.forward_context import set_forward_context

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> list[int]:
    """vLLM's bucket ladder: 1, 2, 4, then every 8 up to 256, every 16 beyond; capped, ascending.

    The cap is `max_capture_size` if given, else max_num_seqs (a decode batch is at most that many
    requests) and never above 512.
    """
    cap = max_capture_size if max_capture_size is not None else min(max_num_seqs, 512)
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    sizes = [s for s in ladder if s <= cap]
    if cap not in sizes and cap >= 1:
        sizes.append(cap)  # the largest batch must have a graph of its own
    return sorted(sizes)


class EagerGraph:
    """Stands in for torch.cuda.CUDAGraph where there is none: replay re-runs the captured callable."""

    def __init__(self) -> None:
        self._replay: Callable[[], None] | None = None

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = run()

        def replay() -> None:
            out.copy_(run())

        self._replay = replay
        return out

    def replay(self) -> None:
        if self._replay is None:
            raise RuntimeError("replay() before capture()")
        self._replay()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph or EagerGraph
    hidden: torch.Tensor  # [size, hidden_size], the graph's output buffer
    attn_metadata: Any  # what prepare_for_capture returned; its buffers are refilled before replays


@dataclass(frozen=True)
class CaptureStats:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # GPU memory the graph pool holds after capture (0 without a GPU)


class CudaGraphRunner:
    """Captures `forward(input_ids[:B * q], positions[:B * q])` for each bucket size B and replays it
    (q = `query_len` tokens per request: 1, or k + 1 to verify k drafts).

    `input_ids` / `positions` are the model's input buffers (at least max(capture_sizes) * q long);
    `make_capture_metadata(B)` returns a padded uniform-decode CommonAttentionMetadata of B
    requests of q tokens over buffers that stay valid (the input batch's), used once per capture.
    `pool` shares another runner's graph memory pool.
    """

    def __init__(
        self,
        forward: Forward,
        builder: AttentionMetadataBuilder,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        capture_sizes: list[int],
        make_capture_metadata: Callable[[int], CommonAttentionMetadata],
        graph_factory: Callable[[], Any] | None = None,
        query_len: int = 1,
        pool: Any = None,
    ) -> None:
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        if not capture_sizes:
            raise ValueError("capture_sizes is empty: pass at least one batch size, or run eagerly")
        if sorted(set(capture_sizes)) != sorted(capture_sizes) or min(capture_sizes) < 1:
            raise ValueError(f"capture_sizes must be distinct positive sizes, got {capture_sizes}")
        if max(capture_sizes) * query_len > min(input_ids.shape[0], positions.shape[0]):
            raise ValueError(
                f"the largest capture size {max(capture_sizes)} x {query_len} tokens exceeds the input "
                f"buffers ({input_ids.shape[0]} tokens)"
            )
        self.forward = forward
        self.builder = builder
        self.input_ids = input_ids
        self.positions = positions
        self.capture_sizes = sorted(capture_sizes)
        self.make_capture_metadata = make_capture_metadata
        self.device = input_ids.device
        self.graph_factory = graph_factory or (
            torch.cuda.CUDAGraph if self.device.type == "cuda" else EagerGraph
        )
        self.query_len = query_len
        self.graphs: dict[int, _Graph] = {}
        if pool is None and self.device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
        self.pool = pool
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.capture_sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds `num_reqs` requests, or None when none does."""
        for size in self.capture_sizes:
            if size >= num_reqs:
                return size
        return None

    def capture(self) -> CaptureStats:
        """Capture every size, largest first, into one memory pool (smaller graphs reuse its blocks)."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else 0
        for size in reversed(self.capture_sizes):
            self.graphs[size] = self._capture_one(size)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0] if self.device.type == "cuda" else 0
        return CaptureStats(
            list(self.capture_sizes), time.perf_counter() - start, max(0, free_before - free_after)
        )

    def _capture_one(self, size: int) -> _Graph:
        common = self.make_capture_metadata(size)
        if not self._fits(common) or common.num_reqs != size:
            raise ValueError(
                f"capture metadata for size {size} is not a uniform decode batch of {size} x {self.query_len}"
            )
        attn_metadata = self.builder.prepare_for_capture(common)
        num_tokens = size * self.query_len
        ids, pos = self.input_ids[:num_tokens], self.positions[:num_tokens]

        def run() -> torch.Tensor:
            with set_forward_context(attn_metadata):
                return self.forward(ids, pos)

        # Warm-up outside the graph: Triton compiles and libraries plan on first use, neither of
        # which may happen while a stream is being captured.
        run()
        graph = self.graph_factory()
        if isinstance(graph, EagerGraph):
            hidden = graph.capture(run)
        else:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = run()
        return _Graph(graph=graph, hidden=hidden, attn_metadata=attn_metadata)

    def _fits(self, common: CommonAttentionMetadata) -> bool:
        q = self.query_len
        return (
            common.max_query_len <= q
            and common.num_actual_tokens == common.num_reqs * q
            and (q == 1 or (common.decode_query_len == q and common.num_decodes == common.num_reqs))
        )

    def can_replay(self, common: CommonAttentionMetadata) -> bool:
        """A padded uniform-decode batch (at most query_len tokens per request) whose size has a graph."""
        return common.num_reqs in self.graphs and self._fits(common)

    def replay(self, common: CommonAttentionMetadata, num_real_tokens: int) -> torch.Tensor:
        """Run the graph of `common.num_reqs` (already padded, inputs already in the buffers).

        Returns the hidden states of the first `num_real_tokens` tokens.
        """
        entry = self.graphs.get(common.num_reqs)
        if entry is None or not self.can_replay(common):
            raise ValueError(
                f"no graph for a batch of {common.num_reqs} requests / {common.num_actual_tokens} tokens "
                f"(max query length {common.max_query_len}); captured: {self.capture_sizes} "
                f"x {self.query_len} tokens"
            )
        self.builder.prepare_for_replay(common)
        entry.graph.replay()
        self.num_replays += 1
        return entry.hidden[:num_real_tokens]
