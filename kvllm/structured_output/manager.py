"""StructuredOutputManager: compiles grammars off the step path and fills a step's token bitmask, on
the engine's thread or, with `grammar_process`, in a process of its own (grammar_process.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvllm.sampling_params import StructuredOutputsParams
from kvllm.structured_output import backend_xgrammar
from kvllm.structured_output.grammar_process import GrammarProcess, GrammarProcessRequest
from kvllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch

# Either kind of a sequence's grammar: its matcher here, or in the grammar process.
Grammar = StructuredOutputRequest | GrammarProcessRequest


def mask_by_value(mask: torch.Tensor | Callable[[], torch.Tensor | None] | None) -> torch.Tensor | None:
    """A step's mask to send to another process: its own compact copy (the manager's buffer is reused
    two calls later, and pickling a view would carry the whole, possibly larger, buffer). A PendingMask
    (the grammar process's) is waited for here: workers in other processes sample when it arrives."""
    if callable(mask):
        mask = mask()
    return None if mask is None else mask.clone()


@dataclass(frozen=True)
class GrammarProcessSettings:
    """Run the matchers in a process of their own: where it loads the tokenizer, and the most rows a
    step's mask has (the engine's max_num_seqs)."""

    tokenizer_path: str
    max_rows: int


class StructuredOutputManager:
    """Owns the grammar backend (built on first use, off the step path) and its compile pool, or the
    grammar process that holds both.

    `validate` runs when a request arrives (a tokenizer-free parse, so bad constraints fail there);
    `make_request` starts the compile; the scheduler admits a request once its grammar is ready; a
    step's masks are asked for with `start_bitmask` and taken with `finish_bitmask` (`grammar_bitmask`
    does both): in-process the work is done in the first, with the grammar process the engine's thread
    is free in between; `release` drops finished sequences' grammars.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        pin_memory: bool = False,
        process: GrammarProcessSettings | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Masks bound for a GPU go in page-locked memory: a copy from pageable memory this large (1.2 MB
        # at batch 64 for a 152k vocabulary) makes the driver wait for the stream, so the host would
        # stall on the forward pass it is meant to overlap.
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.process_settings = process
        self._backend: backend_xgrammar.XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvllm-grammar")
        self._filler = backend_xgrammar.BitmaskFiller(threads)
        # Two reused mask buffers, taken in turn (see `grammar_bitmask`), grown when a batch outgrows
        # them: no allocation (pinned or not) and no full-size initialisation on the step path.
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next_buffer = 0
        self._started: torch.Tensor | None = None  # start_bitmask's in-process result
        self.num_buffer_allocations = 0  # buffers allocated so far (tests count them)
        # Started now: its seconds of start-up overlap the engine's.
        self._process = (
            GrammarProcess(
                process.tokenizer_path,
                vocab_size,
                self.stop_token_ids,
                process.max_rows,
                page_lock=pin_memory,
                fill_threads=self._filler.fill_threads,
            )
            if process is not None
            else None
        )

    @property
    def num_threaded_fills(self) -> int:
        """In-process fills that went through xgrammar's thread pool (tests count them)."""
        return self._filler.num_threaded_fills

    @property
    def matchers_in_process(self) -> bool:
        """Whether the matchers run in the grammar process, so the engine's thread is free between
        `start_bitmask` and `finish_bitmask`."""
        return self.process_settings is not None

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise ValueError (StructuredOutputError) naming what is wrong with the constraint."""
        backend_xgrammar.validate(params)

    def make_request(self, params: StructuredOutputsParams) -> Grammar:
        """A sequence's grammar, compiling from now on (xgrammar caches repeats)."""
        if self.process_settings is not None:
            return self.grammar_process.compile(params)
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

    @property
    def grammar_process(self) -> GrammarProcess:
        assert self._process is not None, "the matchers run on the engine's thread"
        return self._process

    def release(self, grammars: Sequence[Grammar]) -> None:
        """Finished sequences' grammars: the grammar process drops their matchers."""
        remote = [g for g in grammars if isinstance(g, GrammarProcessRequest)]
        if remote and self._process is not None:
            self._process.free(remote)

    def grammar_bitmask(self, grammars: Sequence[Grammar | None]) -> torch.Tensor | None:
        """int32 [len(grammars), ceil(vocab / 32)] on the host: bit j of word w is set when token
        32 w + j may be sampled (little-endian within a word, as xgrammar packs it). Rows whose grammar
        no longer constrains them keep every bit set; None when no row is constrained. The caller
        passes None for a finished sequence: its token is one the engine drops.

        The result is a view of one of two reused buffers (page-locked with `pin_memory`), so it stays
        valid until the next-but-one call: a step's mask may still be on its way to the device while
        the next step's is filled (the engine takes each step's tokens, which the device produces after
        the copy, before it fills the step after next). Callers that keep a mask longer copy it."""
        self.start_bitmask(grammars)
        return self.finish_bitmask()

    def start_bitmask(self, grammars: Sequence[Grammar | None]) -> None:
        """Begin `grammar_bitmask(grammars)`: the grammar process starts on it (with the accepts made
        since its last message); in-process the masks are filled here."""
        if self.process_settings is not None:
            self.grammar_process.start_fill(list(grammars))  # type: ignore[arg-type]
            return
        matchers = [None if g is None or not g.constrains else g.matcher for g in grammars]  # type: ignore[union-attr]
        if not any(m is not None for m in matchers):
            self._started = None
            return
        bitmask = self._take_buffer(len(grammars))
        self._filler.fill(bitmask, matchers)
        self._started = bitmask

    def finish_bitmask(self) -> torch.Tensor | None:
        """The masks begun by `start_bitmask` (see `grammar_bitmask`)."""
        if self.process_settings is not None:
            return self.grammar_process.finish_fill()
        bitmask, self._started = self._started, None
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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.close()
