"""The draft-model proposer (vLLM's `draft_model` method): a smaller model with its own KV cache.

The draft model shares the target's paged layout: the same block ids and block table, its own cache
tensors (so a block holds the target's and the draft's K/V of the same tokens, and preemption,
prefix caching and freeing apply to both at once). Each step it runs on the step's own tokens (so
its cache follows the target's, drafts included; rejected positions are overwritten later, as the
target's), then, for every request that sampled, k greedy decode steps from the token the step
emitted give the next drafts. Greedy drafts are deterministic, so the rejection sampler verifies
them with q one-hot: the output stays exactly the target's distribution. The scheduler allocates
k lookahead slots per request for these steps when the cache has room; a request without them
drafts fewer tokens. With CUDA graphs on, both passes replay graphs (kvllm/worker/draft_graph.py,
handed in by the model runner as `graphs`).

A step of decodes only (every request verifies its drafts, or has none, and samples) skips the
pass over its tokens: the first proposal step runs two tokens per request instead, the token before
the emitted one and the emitted one, so the draft model makes k passes per step, not k + 1. Invariant
behind it: after each step the draft cache holds every position up to the emitted token p. The
accepted drafts d_1..d_a sit at n..n+a-1 (n: the tokens known before the step); d_j was the draft
model's own input at proposal step j of the step before (its greedy output of step j - 1), so d_1 ..
d_{a-1} are cached already, d_a (never an input when a = k) and p are the two tokens of the first
step. Rejected positions hold stale K/V past p, overwritten before any step reads that far.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.config.speculative import SpeculativeConfig
from kvllm.forward_context import set_forward_context
from kvllm.models.loader import load_model
from kvllm.models.model_config import ModelConfig
from kvllm.spec_decode.draft_cache import DraftKVCache, pair_layout
from kvllm.utils.dtypes import kv_cache_torch_dtype
from kvllm.utils.host_copy import upload_from_host

logger = logging.getLogger(__name__)


class DraftGraphs(Protocol):
    """The draft model's CUDA graphs (kvllm/worker/draft_graph.py: DraftModelGraphs); each call
    returns False / None when no graph holds the batch, and the proposer runs it eagerly."""

    def run_step_tokens(self, common: CommonAttentionMetadata) -> bool: ...

    def decode(
        self,
        token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> torch.Tensor | None: ...

    def decode_pairs(
        self,
        pair_token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> torch.Tensor | None: ...

    def replay_counts(self) -> dict[str, dict[int, int]]: ...


def needs_step_tokens(step_requests: int, sampling_requests: int, decode_only: bool) -> bool:
    """Whether the draft model runs over the step's own tokens: yes, unless every one of the step's
    requests is a decode (its query is its last token and its drafts) that samples."""
    return not (decode_only and sampling_requests == step_requests)


class DraftModelProposer:
    """Loads the draft model and proposes k tokens per request from it (worker side)."""

    def __init__(
        self,
        args: EngineArgs,
        config: SpeculativeConfig,
        target: ModelConfig,
        device: torch.device,
        attn_backend: type[AttentionBackend],
        block_size: int,
    ) -> None:
        self.k = config.num_speculative_tokens
        self.device = device
        self.attn_backend = attn_backend
        draft_args = args.with_changes(
            model=config.model,
            tokenizer=None,
            revision=config.revision,
            max_model_len=target.max_model_len,
            speculative_config=None,
            hf_overrides=None,
        )
        try:
            self.model_config = ModelConfig.from_engine_args(draft_args, device)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model={config.model!r}: {exc}") from exc
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model={config.model!r} has a vocabulary of {self.model_config.vocab_size} "
                f"tokens, the target {target.vocab_size}; a draft model must share the target's tokenizer"
            )
        torch.manual_seed(args.seed)  # dummy weights: the target's own when the draft is the target
        self.model = load_model(self.model_config, args.load_format, device)
        spec = KVCacheSpec(
            block_size=block_size,
            num_kv_heads=self.model_config.num_kv_heads,
            head_size=self.model_config.head_size,
            dtype=kv_cache_torch_dtype(args.kv_cache_dtype, self.model_config.dtype),
            kv_cache_dtype=args.kv_cache_dtype,
        )
        self.cache = DraftKVCache(
            self.model,
            attn_backend,
            spec,
            lambda layer: layer.bind_backend(attn_backend, args.kv_cache_dtype),
            device,
        )
        self.graphs: DraftGraphs | None = None  # set by the model runner once captured
        logger.info(
            "Draft model %s (%d layers) proposes %d tokens per step",
            self.model_config.model,
            self.model_config.num_hidden_layers,
            self.k,
        )

    def bytes_per_block(self) -> int:
        return self.cache.bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int, max_num_tokens: int) -> None:
        self.graphs = None
        self.cache.initialize(num_blocks, max_num_reqs, max_num_tokens, self.model_config.max_model_len)

    def graph_replay_counts(self) -> dict[str, dict[int, int]]:
        return self.graphs.replay_counts() if self.graphs is not None else {}

    def run_step_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        common: CommonAttentionMetadata,
        graphed: bool = False,
    ) -> None:
        """The step's own tokens through the draft model: its KV cache follows the target's. `graphed`:
        the target replayed a full graph of this padded batch, so the draft model replays its own."""
        if graphed and self.graphs is not None:
            if self.graphs.run_step_tokens(common):
                return
        with set_forward_context(self.cache.build(common)):
            self.model(input_ids, positions)

    def propose(
        self,
        last_token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
        pair_token_ids: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """Up to k greedy drafts per request: request r's token `last_token_ids[r]` sits at position
        `positions[r]` of its row; its slots end before position `limits[r]` (allocated blocks and
        max_model_len), so it drafts at most limits[r] - positions[r] tokens.

        `pair_token_ids` (int [num, 2] on the device: each request's tokens at positions[r] - 1 and
        positions[r]) is given when the step's own tokens did not run through the draft model: the
        first step then runs both (see the module docstring)."""
        num = len(rows)
        out = torch.full((num, self.k), -1, dtype=torch.int64, device=self.device)
        counts = np.zeros(num, dtype=np.int64)
        active = np.arange(num)
        ids = last_token_ids.long()
        first = 0
        if pair_token_ids is not None:
            hidden = self._pair_step(pair_token_ids, positions, rows, limits, block_table, block_table_gpu)
            keep = np.flatnonzero(positions < limits)
            if len(keep) < num:
                hidden = hidden[self._upload(keep)]
            active = active[keep]
            if len(active):
                ids = self.model.compute_logits(hidden).argmax(dim=-1)
                out[self._upload(active), 0] = ids
                counts[active] += 1
            first = 1
        for j in range(first, self.k):
            keep = positions[active] + j < limits[active]
            if not keep.all():
                ids = ids[self._upload(np.flatnonzero(keep))]
                active = active[keep]
            if not len(active):
                break
            n = len(active)
            pos = positions[active] + j
            hidden = None
            if self.graphs is not None:
                hidden = self.graphs.decode(ids, pos, rows[active], block_table, block_table_gpu)
            if hidden is None:
                common = self.cache.decode_metadata(pos, rows[active], block_table, block_table_gpu)
                with set_forward_context(self.cache.build(common)):
                    hidden = self.model(ids, torch.from_numpy(pos.astype(np.int32)).to(self.device))
            ids = self.model.compute_logits(hidden[:n]).argmax(dim=-1)
            out[self._upload(active), j] = ids
            counts[active] += 1
        host = out.tolist()
        return [row[:c] for row, c in zip(host, counts.tolist())]

    def _upload(self, index: np.ndarray) -> torch.Tensor:
        # Through pinned memory: a synchronous copy would wait for the queued proposal steps.
        return upload_from_host(torch.from_numpy(index), self.device)

    def _pair_step(
        self,
        pair_token_ids: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [num, H] at each request's emitted token, after running it and the token
        before it (in a graph when one holds the batch)."""
        if self.graphs is not None:
            hidden = self.graphs.decode_pairs(
                pair_token_ids, positions, rows, limits, block_table, block_table_gpu
            )
            if hidden is not None:
                return hidden
        common, last_rows = self.cache.pair_metadata(positions, rows, limits, block_table, block_table_gpu)
        flat, token_pos = pair_layout(positions, limits)
        ids = pair_token_ids.reshape(-1)[torch.from_numpy(flat).to(self.device)]
        with set_forward_context(self.cache.build(common)):
            hidden = self.model(ids, torch.from_numpy(token_pos).to(self.device))
        return hidden[torch.from_numpy(last_rows).to(self.device)]
