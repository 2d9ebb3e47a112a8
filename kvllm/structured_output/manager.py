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
        passes None for a finished sequence: its token is one the engine drops."""
        import torch
        import xgrammar as xgr

        rows, matchers = [], []
        for i, so in enumerate(grammars):
            if so is not None and so.constrains:
                rows.append(i)
                matchers.append(so.matcher)
        if not rows:
            return None
        shape = xgr.get_bitmask_shape(len(grammars), self.vocab_size)
        bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.pin_memory)  # every bit set
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
