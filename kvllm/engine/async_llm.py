"""AsyncLLM: the synchronous LLMEngine driven by one background thread, with per-request asyncio streams.

Threading model: the engine is touched by exactly one thread, the engine thread. Callers on the event
loop send commands (add, abort, call, stop) through a thread-safe queue; the engine thread applies them
between steps, so a step never races an add or an abort. Outputs go back to the event loop with
`loop.call_soon_threadsafe`, one call per step, and land in each request's asyncio.Queue.

A crash of the engine thread fails every in-flight request with EngineDeadError and leaves the
AsyncLLM permanently `errored` (the server then answers /health with 503 and exits; `wait_dead`).
A fault that belongs to one request (the engine refusing it, its caller leaving while it is being
added) fails that request only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvllm.config.engine import EngineArgs
from kvllm.engine.llm_engine import EngineStats, LLMEngine, PromptType
from kvllm.logger import init_logger
from kvllm.outputs import CompletionOutput, RequestOutput
from kvllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread crashed; no request can be served any more."""


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down (or not started) and takes no new requests."""


class StatRecorder(Protocol):
    """Receives, on the event loop thread, every output delivered to a request and the engine stats.

    Each request ends with exactly one finished output; a request that is aborted (its consumer left,
    or shutdown) ends with one whose unfinished sequences have finish_reason "abort".
    """

    def record(self, outputs: Sequence[RequestOutput], stats: EngineStats, now: float) -> None: ...


@dataclasses.dataclass
class _RequestState:
    queue: asyncio.Queue[RequestOutput | BaseException]
    prompt: str | None
    prompt_token_ids: list[int] | None
    n: int
    arrival_time: float
    # DELTA outputs carry only what is new, so a consumer that fell behind must see each of them.
    is_delta: bool = False
    last_output: RequestOutput | None = None
    num_tokens_sent: int = 0  # output tokens in the last output queued (for stream_interval)
    finished: bool = False
    finished_indexes: set[int] = dataclasses.field(default_factory=set)  # kept for DELTA only


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    done: concurrent.futures.Future[None]
    priority: int = 0


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result or error goes to `done`."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


class AsyncLLM:
    """An asyncio front-end to LLMEngine: `generate()` streams RequestOutputs of one request.

    Call `start()` on the event loop that will consume outputs before the first `generate()`,
    `drain()` to stop taking requests and finish or abort the in-flight ones, and `shutdown()` to
    stop the engine thread.
    """

    def __init__(self, engine: LLMEngine, stat_recorders: Sequence[StatRecorder] = ()) -> None:
        self.engine = engine
        self.stat_recorders = list(stat_recorders)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._states: dict[str, _RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._idle = asyncio.Event()
        self._dead = asyncio.Event()
        self.dead_error: BaseException | None = None
        self.latest_stats: EngineStats = engine.stats()  # updated after every step, on the event loop
        # Cumulative outputs are queued every `stream_interval` new tokens (the first and last always).
        self.stream_interval = engine.args.stream_interval

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_recorders: Sequence[StatRecorder] = ()) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args), stat_recorders)

    # ---- properties ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_accepting(self) -> bool:
        return self._accepting and not self.errored

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            return
        driver = self.engine.async_driver
        if driver is not None and driver is not self and driver._engine_thread_alive():
            raise RuntimeError(
                "This LLMEngine is already driven by another running AsyncLLM: two engine threads would step "
                "it at once. Shut that AsyncLLM down first (shutdown() or stop()), or give this one its own "
                "engine (AsyncLLM.from_engine_args)."
            )
        self.engine.async_driver = self
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run_engine_loop, name="kvllm-engine", daemon=True)
        self._accepting = True
        self._thread.start()

    def _engine_thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def drain(self, timeout: float) -> int:
        """Take no new requests; wait up to `timeout` s for in-flight ones, then abort the rest.

        Aborted requests end with finish_reason "abort" in their stream. Returns how many were aborted.
        """
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except TimeoutError:
            pending = [rid for rid, s in self._states.items() if not s.finished]
            logger.info(
                "Aborting %d request(s) still running after the %.1f s grace period", len(pending), timeout
            )
            self.abort(pending)
            return len(pending)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s until no request is in flight; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_dead(self) -> BaseException:
        """Wait until the engine thread has crashed; return the error that ended it."""
        await self._dead.wait()
        assert self.dead_error is not None
        return self.dead_error

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (waiting up to `timeout` s for a running step) and fail what is left."""
        self._accepting = False
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_Stop())
            await asyncio.to_thread(thread.join, timeout)
            if thread.is_alive():
                logger.warning("The engine thread did not stop within %.1f s; leaving it (daemon)", timeout)
            else:
                self._fail_pending_commands(EngineNotAcceptingError("The server is shutting down"))
        self._fail_all(EngineNotAcceptingError("The server is shutting down"))

    def stop(self, timeout: float = 5.0) -> None:
        """`shutdown()` for callers that cannot await it (any thread): blocks until the engine thread
        has stopped (at most `timeout` s); requests left end with EngineNotAcceptingError."""
        self._accepting = False
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_Stop())
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("The engine thread did not stop within %.1f s; leaving it (daemon)", timeout)
                return
        error = EngineNotAcceptingError("The engine is shut down")
        self._fail_pending_commands(error)
        if self._loop is not None and not self._loop.is_closed():
            self._post(self._fail_all, error)

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop outputs are delivered to (the one `start()` ran on), or None before `start()`."""
        return self._loop

    # ---- requests -----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Add a request and return the stream of its outputs; the caller must `close()` the stream.

        Raises ValueError for input the engine rejects, EngineNotAcceptingError while shutting down and
        EngineDeadError after a crash.
        """
        if self.errored:
            raise EngineDeadError(f"The engine has stopped after an error: {self.dead_error!r}")
        if not self.is_accepting or self._loop is None:
            raise EngineNotAcceptingError("The server is shutting down and takes no new requests")
        if request_id in self._states:
            raise ValueError(f"Request id {request_id!r} is already in use")
        prompt_text, prompt_ids = _prompt_parts(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        is_delta = params.output_kind is RequestOutputKind.DELTA
        state = _RequestState(asyncio.Queue(), prompt_text, prompt_ids, params.n, arrival, is_delta)
        self._states[request_id] = state
        self._idle.clear()
        stream = RequestStream(self, request_id, state)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, arrival, done, priority))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller left; the engine thread may have added the request already. Closing aborts
            # it (an abort of an id the engine never took is ignored).
            stream.close()
            raise
        except BaseException:
            state.finished = True  # refused by the engine: nothing to abort
            stream.close()
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its (cumulative) outputs until it finishes.

        Raises like `add_request`. Leaving the iteration early (a disconnect, a cancellation) aborts
        the request, which frees its KV blocks.
        """
        stream = await self.add_request(request_id, prompt, params, arrival_time, priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (thread-safe); their streams end with finish_reason "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._commands.put(_Abort(ids))

    async def call_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between two steps (the engine's one thread), awaited.

        Raises EngineDeadError after a crash, EngineNotAcceptingError once stopped, and what `fn` raises.
        """
        if self.errored:
            raise EngineDeadError(f"The engine has stopped after an error: {self.dead_error!r}")
        thread = self._thread
        if thread is None or not thread.is_alive():
            raise EngineNotAcceptingError("The engine is not running")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (LLMEngine.reset_prefix_cache on the engine thread); False while
        requests hold KV blocks."""
        return await self.call_engine(lambda engine: engine.reset_prefix_cache())

    def _close_request(self, request_id: str, state: _RequestState) -> None:
        if not state.finished and not self.errored:
            # The consumer left early: record the request as aborted now, since its stream is gone.
            state.finished = True
            self._record([_aborted_output(request_id, state)], self.latest_stats)
            self.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        if not self._states:
            self._idle.set()

    # ---- engine thread ------------------------------------------------------------------------

    def _run_engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._apply_commands(block=not engine.has_unfinished_requests()):
                    return
                if not engine.has_unfinished_requests():
                    self._post(self._on_step, [], engine.stats())
                    continue
                outputs = engine.step()
                self._post(self._on_step, outputs, engine.stats())
        except BaseException as exc:  # any crash must fail the requests, not hang them
            logger.exception("The engine loop crashed; failing all in-flight requests")
            self._post(self._on_engine_dead, exc)
            self._fail_pending_commands(exc)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False once a stop command came."""
        aborted: list[str] = []
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self.engine.abort_request(command.request_ids)
                aborted.extend(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        if aborted:
            self._post(self._on_aborted, aborted, self.engine.stats())
        return True

    def _add(self, command: _Add) -> None:
        # Once running, the future cannot be cancelled, so setting its result cannot fail; a future
        # cancelled before (its caller left while the add was queued) means there is nothing to add.
        if not command.done.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params, command.arrival_time, command.priority
            )
        except Exception as exc:  # ValueError and anything else fail this request only
            command.done.set_exception(exc)
        else:
            command.done.set_result(None)

    def _call(self, command: _Call) -> None:
        if not command.done.set_running_or_notify_cancel():
            return
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            command.done.set_exception(exc)
        else:
            command.done.set_result(result)

    def _fail_pending_commands(self, exc: BaseException) -> None:
        """Fail queued adds (safe from either thread once the engine thread has stopped)."""
        error = exc
        if not isinstance(exc, EngineNotAcceptingError | EngineDeadError):
            error = EngineDeadError(f"The engine has stopped after an error: {exc!r}")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add | _Call) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to receive the outputs

    # ---- event loop side ----------------------------------------------------------------------

    def _on_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        delivered = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None or state.finished:
                continue  # closed by its consumer; already recorded as aborted
            state.last_output = output
            state.finished = output.finished
            if state.is_delta:
                state.finished_indexes.update(c.index for c in output.outputs if c.finish_reason is not None)
            delivered.append(output)  # the metrics see every step's tokens, queued or not
            if self.stream_interval > 1 and not state.is_delta and not output.finished:
                num_tokens = output.num_output_tokens
                if state.num_tokens_sent and num_tokens - state.num_tokens_sent < self.stream_interval:
                    continue
                state.num_tokens_sent = num_tokens
            state.queue.put_nowait(output)
        self._record(delivered, stats)

    def _record(self, outputs: Sequence[RequestOutput], stats: EngineStats) -> None:
        self.latest_stats = stats
        now = time.monotonic()
        for recorder in self.stat_recorders:
            try:
                recorder.record(outputs, stats, now)
            except Exception:  # metrics must never break serving
                logger.exception("A stat recorder failed")

    def _on_aborted(self, request_ids: list[str], stats: EngineStats) -> None:
        finals = []
        for rid in request_ids:
            state = self._states.get(rid)
            if state is None or state.finished:
                continue
            final = _aborted_output(rid, state)
            state.finished = True
            state.queue.put_nowait(final)
            finals.append(final)
        self._record(finals, stats)

    def _on_engine_dead(self, exc: BaseException) -> None:
        self.dead_error = exc
        self._accepting = False
        self._dead.set()
        # Adds queued after the engine thread's last look at the queue would otherwise wait forever.
        self._fail_pending_commands(exc)
        self._fail_all(EngineDeadError(f"The engine has stopped after an error: {exc!r}"))

    def _fail_all(self, exc: BaseException) -> None:
        for state in self._states.values():
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(exc)


class RequestStream:
    """The outputs of one request, newest first-come: iterate it, then `close()` it (always).

    Closing a stream whose request has not finished aborts the request.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self._llm = llm
        self._state = state
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        q = self._state.queue
        item = await q.get()
        # Cumulative outputs: a consumer that fell behind only needs the newest one.
        while not self._state.is_delta and not q.empty() and not isinstance(item, BaseException):
            item = q.get_nowait()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._llm._close_request(self.request_id, self._state)


def _prompt_parts(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), None if ids is None else list(ids)
    return None, list(prompt)


def _aborted_output(request_id: str, state: _RequestState) -> RequestOutput:
    """The final output of an aborted request: what it had generated, unfinished sequences marked "abort"."""
    last = state.last_output
    if last is None or state.is_delta:
        # Nothing new since the last delta: the sequences that had not finished end with "abort".
        completions = [
            CompletionOutput(i, "", [], None, None, "abort")
            for i in range(state.n)
            if i not in state.finished_indexes
        ]
        prompt_ids = state.prompt_token_ids or ([] if last is None else last.prompt_token_ids)
        # Without a report from the engine only the arrival is known (the latencies still count it).
        metrics = {"arrival_time": state.arrival_time} if last is None else dict(last.metrics)
        return RequestOutput(request_id, state.prompt, prompt_ids, completions, True, metrics)
    completions = [
        c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
        for c in last.outputs
    ]
    return RequestOutput(
        request_id, last.prompt, last.prompt_token_ids, completions, True, dict(last.metrics)
    )
