"""StructuredOutputRequest: one sequence's grammar (compiling, then a matcher fed its accepted tokens)."""

from __future__ import annotations

import logging
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from kvllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """The grammar state of one sequence (vLLM's name).

    Invariant: the matcher has accepted exactly the sequence's output tokens, in order. Tokens reach
    it only through `accept_token`, which the output processor calls for every token it appends, so a
    token sampled for a step that a stop made void (overlapped scheduling) never reaches it.

    Whether the matcher has terminated is kept here: it changes only when the matcher accepts one of
    its stop tokens (xgrammar's default, terminate_without_stop_token=False), so the matcher is asked
    only then, not twice a row every step (each ask crosses into xgrammar's C++).
    """

    def __init__(self, params: StructuredOutputsParams, compiled: Future[Any]) -> None:
        self.params = params
        self._compiled = compiled
        self._matcher: Any = None
        self.error: str | None = None  # why compiling failed, once it did
        self.rejected = False  # a token the grammar rejected was appended: no longer constrained
        self._terminated = False  # the matcher accepted a stop token that ended its grammar
        self._stop_token_ids: frozenset[int] = frozenset()

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed to compile: `error` then says why)."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            self.error = str(exc)
            return True
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(self._compiled.result())
        self._stop_token_ids = frozenset(self._matcher.stop_token_ids)
        return True

    def wait(self, timeout: float) -> None:
        """Block until the grammar is compiled, at most `timeout` seconds."""
        futures.wait([self._compiled], timeout=timeout)

    @property
    def matcher(self) -> Any:
        """The xgrammar GrammarMatcher (only once `is_ready()` returned True without an error)."""
        assert self._matcher is not None, "the grammar is not compiled yet"
        return self._matcher

    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained: compiled, not terminated (a stop token accepted), and
        not given up after a rejected token."""
        return self._matcher is not None and not self.rejected and not self._terminated

    def accept_token(self, token_id: int) -> bool:
        """Advance the matcher by one output token; False (logged) for a token the grammar rejects,
        which the mask prevents unless something else forced the token (e.g. min_tokens against a
        grammar that can only stop)."""
        matcher = self._matcher  # `constrains` inlined: this runs for every row of every step
        if matcher is None or self.rejected or self._terminated:
            return False
        if matcher.accept_token(token_id):
            if token_id in self._stop_token_ids:
                self._terminated = matcher.is_terminated()
            return True
        logger.warning(
            "Structured output: the grammar rejected token %d; the rest of the output is unconstrained",
            token_id,
        )
        self.rejected = True
        return False
