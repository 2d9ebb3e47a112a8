"""CUDA graphs of the draft model: its pass over each step's tokens, and its k greedy decode steps.

Per verification step the draft model runs 1 + k forward passes: one over the step's tokens (so its
KV cache follows the target's), then k one-token steps that propose the drafts. Eager, each is
hundreds of kernel launches: at batch 1 they, not the GPU, set the step time. So:
- the pass over the step's tokens replays a graph of the target step's own shape (one token per
  request, or k + 1 for a verification: uniform_graph.py), reading the same input buffers the
  target's graph read; steps the target ran piecewise or eagerly (prompt chunks) run eagerly here;
- each proposal step copies its token ids and positions into this module's buffers and replays the
  one-token graph of its padded batch size (requests that run out of slots drop out, so later steps
  may take smaller graphs); the LM head and argmax run after the graph;
- after a decode step the pass over the step's tokens is not needed (draft_model.py): the first
  proposal step runs two tokens per request instead (the last accepted and the emitted one), in a
  graph of two tokens per request over this module's buffers.

The draft model's attention builder holds the graphs' metadata buffers; every replay refills them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.spec_decode.draft_cache import DraftKVCache, pair_layout
from kvllm.worker.buffers import upload_from_host
from kvllm.worker.cuda_graph import CudaGraphRunner
from kvllm.worker.input_batch import InputBatch
from kvllm.worker.uniform_graph import UniformDecodeGraphs


class DraftModelGraphs:
    """The draft model's step-token graphs (shared shapes with the target's) and proposal graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: DraftKVCache,
        input_batch: InputBatch,
        capture_sizes: list[int],
        spec_query_len: int,
        pool: Any = None,
    ) -> None:
        assert cache.builder is not None, "initialize the draft KV cache first"
        self.cache = cache
        self.step = UniformDecodeGraphs(
            model,
            cache.builder,
            input_batch.input_ids,
            input_batch.positions,
            capture_sizes,
            input_batch.capture_metadata,
            spec_query_len,
            pool=pool,
        )
        size = max(capture_sizes)
        device = cache.device
        self.input_ids = torch.zeros(2 * size, dtype=torch.int32, device=device)
        self.positions = torch.zeros(2 * size, dtype=torch.int32, device=device)
        self.propose = CudaGraphRunner(
            model,
            cache.builder,
            self.input_ids,
            self.positions,
            capture_sizes,
            cache.capture_metadata,
            pool=self.step.pool,
        )
        self.pairs: CudaGraphRunner | None = None
        if type(cache.builder).uniform_batch_graphs:
            self.pairs = CudaGraphRunner(
                model,
                cache.builder,
                self.input_ids,
                self.positions,
                capture_sizes,
                cache.pair_capture_metadata,
                query_len=2,
                pool=self.step.pool,
            )

    def capture(self) -> None:
        self.step.capture()
        if self.pairs is not None:
            self.pairs.capture()
        self.propose.capture()

    def run_step_tokens(self, common: CommonAttentionMetadata) -> bool:
        """Replay the step-token graph of this padded batch (its inputs are in the target's buffers);
        False when none has its shape."""
        runner = self.step.runner_for(common)
        if runner is None:
            return False
        runner.replay(common, common.num_actual_tokens)
        return True

    def decode(
        self,
        token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> torch.Tensor | None:
        """One proposal step of n requests in a graph: hidden states [n, H], or None when n exceeds
        the largest graph."""
        n = len(rows)
        size = self.propose.padded_size(n)
        if size is None:
            return None
        self.input_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(
            upload_from_host(torch.from_numpy(positions.astype(np.int32)), self.cache.device)
        )
        common = self.cache.decode_metadata(positions, rows, block_table, block_table_gpu, pad_to=size)
        return self.propose.replay(common, n)

    def decode_pairs(
        self,
        pair_token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> torch.Tensor | None:
        """The two-token first proposal step in a graph (DraftModelProposer.propose): the hidden
        state of each request's last token [n, H], or None when no graph holds the batch."""
        n = len(rows)
        size = None if self.pairs is None else self.pairs.padded_size(n)
        if size is None:
            return None
        common, last_rows = self.cache.pair_metadata(
            positions, rows, limits, block_table, block_table_gpu, pad_to=size
        )
        flat, token_pos = pair_layout(positions, limits)
        device = self.cache.device
        num_tokens = len(flat)
        index = upload_from_host(torch.from_numpy(flat), device)
        self.input_ids[:num_tokens].copy_(pair_token_ids.reshape(-1).index_select(0, index))
        self.positions[:num_tokens].copy_(upload_from_host(torch.from_numpy(token_pos), device))
        hidden = self.pairs.replay(common, num_tokens)
        return hidden.index_select(0, upload_from_host(torch.from_numpy(last_rows), device))

    def replay_counts(self) -> dict[str, dict[int, int]]:
        counts = {1: self.propose.num_replays}
        if self.pairs is not None:
            counts[2] = self.pairs.num_replays
        return {"draft_step": self.step.replay_counts(), "draft_propose": counts}
