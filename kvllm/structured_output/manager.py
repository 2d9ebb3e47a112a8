"""StructuredOutputManager: compiles grammars in a thread pool and fills a step's token bitmask."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvllm.sampling_params import StructuredOutputsParams
from kvllm.structured_output import backend_xgrammar
from kvllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch


# Batches with fewer constrained rows fill their masks on the calling thread (vLLM's threshold for its
# parallel fill is the same order: 128 rows).
THREADED_FILL_MIN_ROWS = 128


def mask_by_value(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A step's mask to send to another process: its own compact copy (the manager's buffer is reused
    two calls later, and pickling a view would carry the whole, possibly larger, buffer)."""
    return None if mask is None else mask.clone()


class StructuredOutputManager:
    """Owns the grammar backend (built on first use, off the step path) and its compile pool.

    `validate` runs when a request arrives (a tokenizer-free parse, so bad constraints fail there);
    `make_request` starts the compile in the pool; the scheduler admits a request once its grammar is
    ready; `grammar_bitmask` fills the masks of a step's rows with xgrammar's batched (multi-threaded)
    fill.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], pin_memory: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        # Masks bound for a GPU go in page-locked memory: a copy from pageable memory this large (1.2 MB
        # at batch 64 for a 152k vocabulary) makes the driver wait for the stream, so the host would
        # stall on the forward pass it is meant to overlap.
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._backend: backend_xgrammar.XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvllm-grammar")
        self._fill_threads = threads
        self._batch_matcher: Any = None
        # Two reused mask buffers, taken in turn (see `grammar_bitmask`), grown when a batch outgrows
        # them: no allocation (pinned or not) and no full-size initialisation on the step path.
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next_buffer = 0
        self.num_buffer_allocations = 0  # buffers allocated so far (tests count them)
        self.num_threaded_fills = 0  # fills that went through xgrammar's thread pool (tests count them)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise ValueError (StructuredOutputError) naming what is wrong with the constraint."""
        backend_xgrammar.validate(params)

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A request's grammar, compiling in the pool from now on (xgrammar caches repeats)."""
        return StructuredOutputRequest(params, self._pool.submit(self._compile, params))

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend.compile(params)

    @property
    def backend(self) -> backend_xgrammar.XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = backend_xgrammar.XgrammarBackend(
                    self.tokenizer, self.vocab_size, self.stop_token_ids
                )
            return self._backend

    def grammar_bitmask(self, grammars: Sequence[StructuredOutputRequest | None]) -> torch.Tensor | None:
        """int32 [len(grammars), ceil(vocab / 32)] on the host: bit j of word w is set when token
        32 w + j may be sampled (little-endian within a word, as xgrammar packs it). Rows whose grammar
        no longer constrains them keep every bit set; None when no row is constrained. The caller
        passes None for a finished sequence: its token is one the engine drops.

        The result is a view of one of two reused buffers (page-locked with `pin_memory`), so it stays
        valid until the next-but-one call: a step's mask may still be on its way to the device while
        the next step's is filled (the engine takes each step's tokens, which the device produces after
        the copy, before it fills the step after next). Callers that keep a mask longer copy it."""
        rows, matchers = [], []
        for i, so in enumerate(grammars):
            if so is not None and so.constrains:
                rows.append(i)
                matchers.append(so.matcher)
        if not rows:
            return None
        bitmask = self._take_buffer(len(grammars))
        if len(rows) < len(grammars):
            # Every bit set on the rows left unconstrained (xgrammar writes the others), row by row: a
            # row is under torch's parallel grain, so no intra-op thread pool wakes up on the step path.
            constrained = set(rows)
            for i in range(len(grammars)):
                if i not in constrained:
                    bitmask[i].fill_(-1)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif len(matchers) < THREADED_FILL_MIN_ROWS or self._fill_threads == 1:
            # A row costs microseconds (about 6 us at batch 64 with Qwen3's vocabulary on this
            # project's CPU): handing rows to a thread pool costs more than it saves, and a pool
            # thread that is not scheduled at once stalls the whole step.
            for row, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
        else:
            self.num_threaded_fills += 1
            self._batch_matcher_for_threads().batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return bitmask

    def _take_buffer(self, num_rows: int) -> torch.Tensor:
        """The next of the two mask buffers, as [num_rows, words] (reallocated only to grow)."""
        import torch
        import xgrammar as xgr

        slot = self._next_buffer
        self._next_buffer ^= 1
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape[0] < num_rows:
            shape = xgr.get_bitmask_shape(num_rows, self.vocab_size)
            buffer = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
            self._buffers[slot] = buffer
            self.num_buffer_allocations += 1
        return buffer[:num_rows]

    def _batch_matcher_for_threads(self) -> Any:
        import xgrammar as xgr

        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
        return self._batch_matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
