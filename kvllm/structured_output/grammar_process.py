"""GrammarProcess: the grammar matchers in a process of their own (`--grammar-process`).

xgrammar's calls hold the GIL (benchmarks/xgrammar_gil.py), so on the engine's thread a constrained
step's accepts and mask fill are host time added to a step that is often host-bound already. Here a
child process compiles the grammars, advances each sequence's matcher by its accepted tokens and fills
a step's masks into shared memory, while the engine's thread does the previous step's output work
(LLMEngine._grammar_bitmask_fn). The engine holds one `GrammarProcessRequest` (a handle) per sequence.

Wire: tuples over one pipe, pickled with plain `pickle` (multiprocessing's own pickler costs tens of
microseconds a message to set up).
  engine -> child: ("compile", handle, params) | ("step", accepts, rows, slot) | ("free", accepts, handles)
                   | ("replay", handle, params, tokens) | ("stop",)
  child -> engine: ("ready",) | ("failed", why) | ("compiled", handle, error or None)
                   | ("filled", constrained, rejected)
`accepts` is a flat [handle, token, handle, token, ...] list the child applies, in order, before anything
else in the message; `rows` holds a handle per mask row (-1: unconstrained); `rejected` lists the
(handle, token) pairs a grammar refused. The child also stops when the pipe closes, so an engine that
dies leaves no child behind.

A child that dies (killed, out of memory, a crash in xgrammar) is started again: the engine keeps each
live sequence's accepted tokens, and `replay` compiles its grammar and accepts them before the child
reads on, so the step in flight is asked for again and no sequence notices. After MAX_RESTARTS restarts
with no step completed in between (a crash that replaying brings back), the step raises
GrammarProcessError.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from kvllm.logger import init_logger
from kvllm.sampling_params import StructuredOutputsParams
from kvllm.structured_output.backend_xgrammar import BitmaskFiller, XgrammarBackend

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

STOP_TIMEOUT_S = 10.0
MAX_RESTARTS = 3


class GrammarProcessError(RuntimeError):
    """The structured-outputs process died or could not start; the message says how."""


class GrammarProcessRequest:
    """One sequence's grammar, its matcher in the grammar process (the interface of
    StructuredOutputRequest that the scheduler and output processor use)."""

    def __init__(self, params: StructuredOutputsParams, handle: int, process: GrammarProcess) -> None:
        self.params = params
        self.handle = handle
        self._process = process
        self.compiled = False
        self.error: str | None = None  # why compiling failed, once it did
        self.tokens: list[int] = []  # accepted so far: replayed into a restarted child

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed to compile: `error` then says why)."""
        if not (self.compiled or self.error is not None):
            self._process.poll()
        return self.compiled or self.error is not None

    def wait(self, timeout: float) -> None:
        """Block until the process answers (a compile, most likely), at most `timeout` seconds."""
        self._process.wait(timeout)

    def accept_token(self, token_id: int) -> None:
        """Advance the matcher by one output token: sent with the process's next message. A token the
        grammar rejects is logged when the process reports it; the rest of that output is unconstrained."""
        if self.compiled:
            self.tokens.append(token_id)
            self._process.accepts += (self.handle, token_id)


class GrammarProcess:
    """The engine's side: starts the child, sends it work and reads its answers (one thread only)."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_rows: int,
        page_lock: bool,
        fill_threads: int,
    ) -> None:
        import torch
        import torch.multiprocessing  # noqa: F401 (its import lets pickling share tensors' memory)
        import xgrammar as xgr

        self.max_rows = max_rows
        # Two mask slots taken in turn, as the in-process manager's buffers (a step's mask may still be
        # on its way to the device while the next is filled), in memory the child writes directly.
        self.masks = torch.empty((2, *xgr.get_bitmask_shape(max_rows, vocab_size)), dtype=torch.int32)
        self.masks.share_memory_()
        self._page_locked = page_lock and _page_lock(self.masks)
        if page_lock and not self._page_locked:
            logger.warning("Could not page-lock the grammar masks' shared memory; each mask is copied once")
        self._pinned_copies = (
            [torch.empty(self.masks.shape[1:], dtype=torch.int32, pin_memory=True) for _ in range(2)]
            if page_lock and not self._page_locked
            else None
        )
        if self._page_locked:
            weakref.finalize(self, _page_unlock, self.masks)
        self._child_args = (tokenizer_path, vocab_size, stop_token_ids, self.masks, fill_threads)
        self._failed: str | None = None
        self._compiling: dict[int, GrammarProcessRequest] = {}
        self._live: dict[int, GrammarProcessRequest] = {}  # compiling or compiled, until freed
        self._next_handle = 0
        self._slot = 0
        self._num_rows = 0
        self._step: tuple[Any, ...] | None = None  # the step asked for and not yet answered
        self._filled: tuple[bool, list[tuple[int, int]]] | None = None
        self.accepts: list[int] = []  # [handle, token, ...] for the next message
        self.num_steps = 0  # masks filled by the child (tests count them)
        self.num_freed = 0  # grammars whose matchers the child was told to drop
        self.num_restarts = 0
        self._restarts_without_a_step = 0
        self._start_child()

    def _start_child(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc: BaseProcess = context.Process(
            target=serve, args=(child, *self._child_args), name="kvllm-grammar", daemon=True
        )
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._proc)
        self._ready = False
        self._outbox: list[tuple[Any, ...]] = []  # held until the child is ready

    # ---- requests ----------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> GrammarProcessRequest:
        handle = self._next_handle
        self._next_handle += 1
        request = GrammarProcessRequest(params, handle, self)
        if self._failed is not None:
            request.error = self._failed
            return request
        self._compiling[handle] = self._live[handle] = request
        self._send(("compile", handle, params))
        return request

    def free(self, requests: list[GrammarProcessRequest]) -> None:
        """Drop finished sequences' matchers (their pending accepts go first)."""
        for request in requests:
            self._compiling.pop(request.handle, None)
            self._live.pop(request.handle, None)
        if requests and self._failed is None:
            self._send(("free", self._take_accepts(), [r.handle for r in requests]))
            self.num_freed += len(requests)

    # ---- one step's masks --------------------------------------------------------------------

    def start_fill(self, grammars: list[GrammarProcessRequest | None]) -> None:
        """Ask for the masks of a step's rows (row i from grammars[i]; None: unconstrained)."""
        if len(grammars) > self.max_rows:
            raise ValueError(
                f"{len(grammars)} mask rows asked for; the grammar process holds {self.max_rows}"
            )
        if self._failed is not None:
            raise GrammarProcessError(self._failed)
        rows = [-1 if g is None or not g.compiled else g.handle for g in grammars]
        self._num_rows = len(rows)
        self._step = ("step", self._take_accepts(), rows, self._slot)
        self._send(self._step)

    def finish_fill(self) -> torch.Tensor | None:
        """The masks asked for by `start_fill`, once the child wrote them: a view of one of two slots,
        valid until the next-but-one step (as StructuredOutputManager.grammar_bitmask's); None when no
        row was constrained."""
        while self._filled is None:
            self._handle(self._receive())
        (constrained, rejected), self._filled, self._step = self._filled, None, None
        for handle, token in rejected:
            logger.warning(
                "Structured output: the grammar rejected token %d (grammar %d); the rest of the output is "
                "unconstrained",
                token,
                handle,
            )
        slot, self._slot = self._slot, self._slot ^ 1
        self.num_steps += 1
        self._restarts_without_a_step = 0
        if not constrained:
            return None
        mask = self.masks[slot, : self._num_rows]
        if self._pinned_copies is None:
            return mask
        pinned = self._pinned_copies[slot][: self._num_rows]
        pinned.copy_(mask)
        return pinned

    # ---- the pipe ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Take every answer already there (compiles), without waiting. A child found dead here is
        started again; once restarts run out, the compiling grammars fail with the reason (the engine
        serves on) and the next step that needs the process raises."""
        try:
            while self._failed is None and self._conn.poll(0):
                self._handle(self._receive())
        except GrammarProcessError:
            pass

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for an answer, then take all that are there."""
        if self._failed is None and self._conn.poll(timeout):
            self.poll()

    def _take_accepts(self) -> list[int]:
        accepts, self.accepts = self.accepts, []
        return accepts

    def _send(self, message: tuple[Any, ...]) -> None:
        if not self._ready:  # messages wait for the child, not this thread (the pipe holds only 64 KiB)
            self._outbox.append(message)
            self.poll()
            return
        try:
            self._conn.send_bytes(pickle.dumps(message))
        except (OSError, ValueError):
            self._restart()  # what the message asked for is in the state the restart sends again

    def _receive(self) -> tuple[Any, ...]:
        # Blocking: the child's end of the pipe closes when it exits, however it exits.
        while self._failed is None:
            try:
                return pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._restart()
        raise GrammarProcessError(self._failed)

    def _restart(self) -> None:
        """The child is gone: start another and send it everything the live sequences need (their
        grammars and accepted tokens, the compiles in flight, the step asked for), or give up."""
        self._proc.join(STOP_TIMEOUT_S)
        self._finalizer()
        why = f"the structured-outputs process exited (exit code {self._proc.exitcode})"
        if self._restarts_without_a_step >= MAX_RESTARTS:
            self._die(f"{why}, after {self._restarts_without_a_step} restarts without a step completing")
            return
        self.num_restarts += 1
        self._restarts_without_a_step += 1
        logger.warning(
            "Structured outputs: %s; starting it again (%d of %d before a step completes) with %d grammars",
            why,
            self._restarts_without_a_step,
            MAX_RESTARTS,
            len(self._live),
        )
        self._start_child()
        self.accepts = []  # each sequence's tokens are replayed whole
        for handle, request in self._live.items():
            if request.compiled:
                self._outbox.append(("replay", handle, request.params, request.tokens))
            else:
                self._outbox.append(("compile", handle, request.params))
        if self._step is not None:
            self._outbox.append(("step", [], *self._step[2:]))

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "compiled":
            request = self._compiling.pop(message[1], None)
            if request is not None:
                request.compiled, request.error = message[2] is None, message[2]
        elif kind == "filled":
            self._filled = (message[1], message[2])
        elif kind == "ready":
            self._ready = True
            outbox, self._outbox = self._outbox, []
            for queued in outbox:
                if not self._ready:  # it died meanwhile: the restart queued all of it again, from the state
                    break
                self._send(queued)
        elif kind == "failed":
            self._die(message[1])
        else:
            raise AssertionError(f"unknown message from the grammar process: {message!r}")

    def _die(self, why: str) -> None:
        """Fail every compiling grammar with `why`; later compiles fail at once."""
        self._failed = why
        for request in self._compiling.values():
            request.error = why
        self._compiling.clear()
        self._live.clear()
        self._outbox.clear()
        logger.error("Structured outputs: %s", why)

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def close(self) -> None:
        self._failed = self._failed or "the structured-outputs process was stopped (the engine shut down)"
        self._finalizer()


def _page_lock(masks: torch.Tensor) -> bool:
    """Register the shared masks with CUDA as page-locked, so their copies to the device do not wait."""
    import torch

    try:
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(masks.data_ptr(), masks.numel() * masks.element_size(), 0)
    except (RuntimeError, AttributeError, AssertionError):
        return False
    return status == cudart.cudaError.success and masks.is_pinned()


def _page_unlock(masks: torch.Tensor) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(masks.data_ptr())
    except RuntimeError:  # at interpreter exit the CUDA context may be gone already, and the mapping with it
        pass


def _stop(conn: Connection, proc: BaseProcess) -> None:
    try:
        conn.send_bytes(pickle.dumps(("stop",)))
    except (OSError, ValueError):
        pass
    proc.join(STOP_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()


# ---- the child ---------------------------------------------------------------------------------


class _Matchers:
    """The child's matchers by handle; compiles land from a thread, so the table has a lock.

    A matcher that rejected a token or terminated (it accepts a stop token; see StructuredOutputRequest)
    constrains nothing more: its handle is in `_done`, so a step asks no matcher whether it terminated."""

    def __init__(self, backend: XgrammarBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._matchers: dict[int, Any] = {}
        self._compiling: set[int] = set()
        self._done: set[int] = set()
        self._stop_token_ids = frozenset(backend.tokenizer_info.stop_token_ids)

    def expect(self, handle: int) -> None:
        """`handle`'s compile is on its way (a `free` before it lands drops it)."""
        with self._lock:
            self._compiling.add(handle)

    def compile(self, handle: int, params: StructuredOutputsParams) -> str | None:
        """Compile and keep a matcher for `handle` (unless freed meanwhile); the error, or None."""
        try:
            matcher = self.backend.matcher(self.backend.compile(params))
        except Exception as exc:  # noqa: BLE001 (any compile failure is the request's, told to the engine)
            with self._lock:
                self._compiling.discard(handle)
            return str(exc)
        with self._lock:
            if handle in self._compiling:
                self._compiling.discard(handle)
                self._matchers[handle] = matcher
        return None

    def replay(self, handle: int, params: StructuredOutputsParams, tokens: list[int]) -> None:
        """A restarted child: compile `handle`'s grammar here and now and accept its tokens."""
        self.expect(handle)
        error = self.compile(handle, params)
        if error is None:
            self.accept([value for token in tokens for value in (handle, token)])
        else:  # it compiled before: nothing should get here, and the sequence is unconstrained from now on
            logger.error(
                "Structured outputs: grammar %d no longer compiles after a restart: %s", handle, error
            )

    def accept(self, accepts: list[int]) -> list[tuple[int, int]]:
        """Advance matchers by (handle, token) pairs; the pairs rejected."""
        rejected = []
        for handle, token in zip(accepts[::2], accepts[1::2], strict=True):
            matcher = self._matchers.get(handle)
            if matcher is None or handle in self._done:
                continue
            if not matcher.accept_token(token):
                self._done.add(handle)
                rejected.append((handle, token))
            elif token in self._stop_token_ids and matcher.is_terminated():
                self._done.add(handle)
        return rejected

    def constraining(self, handle: int) -> Any:
        """The matcher that constrains `handle`'s next token, or None."""
        matcher = self._matchers.get(handle)
        if matcher is None or handle in self._done:
            return None
        return matcher

    def free(self, handles: list[int]) -> None:
        with self._lock:
            for handle in handles:
                self._compiling.discard(handle)
                self._matchers.pop(handle, None)
                self._done.discard(handle)


def serve(
    conn: Connection,
    tokenizer_path: str,
    vocab_size: int,
    stop_token_ids: tuple[int, ...],
    masks: torch.Tensor,
    fill_threads: int,
) -> None:
    """The child's loop: answer the engine's messages until it says stop or its pipe closes."""
    import signal

    import torch

    # A terminal's Ctrl-C reaches the whole process group: the engine decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from kvllm.models.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    try:
        backend = XgrammarBackend(load_tokenizer(tokenizer_path), vocab_size, tuple(stop_token_ids))
    except Exception as exc:  # noqa: BLE001 (reported to the engine, which fails the grammars with it)
        conn.send_bytes(pickle.dumps(("failed", f"the structured-outputs process could not start: {exc}")))
        return
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message)
        with send_lock:  # the compile thread answers too
            conn.send_bytes(data)

    def compile_one(handle: int, params: StructuredOutputsParams) -> None:
        send(("compiled", handle, matchers.compile(handle, params)))

    matchers = _Matchers(backend)
    filler = BitmaskFiller(fill_threads)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvllm-grammar-compile")
    send(("ready",))
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the engine is gone
            kind = message[0]
            if kind == "step":
                _, accepts, rows, slot = message
                rejected = matchers.accept(accepts)
                constrained = filler.fill(masks[slot, : len(rows)], [matchers.constraining(h) for h in rows])
                send(("filled", constrained, rejected))
            elif kind == "compile":
                matchers.expect(message[1])
                pool.submit(compile_one, message[1], message[2])
            elif kind == "replay":
                matchers.replay(*message[1:])
            elif kind == "free":
                matchers.accept(message[1])
                matchers.free(message[2])
            elif kind == "stop":
                return
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
