"""MultiprocExecutor: one worker process per tensor-parallel rank, the engine in the driver.

Each step's SchedulerOutput is encoded once (kvllm/core/sched_wire.py), pickled once and written to
every rank's pipe; rank 0's StepResult comes back (every rank samples alike, so any one would do).
`execute_model_async` returns as soon as the step is sent, so the driver schedules the next step
while the ranks compute, as in-process overlap does.

Shutdown: `shutdown()` (also run when the executor is collected and at interpreter exit) asks every
worker to stop, waits, then terminates and finally kills the ones left. A worker also stops by itself
when its pipe closes, so a driver that dies leaves no worker behind.
"""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvllm.attention.metadata import KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.sched_wire import SchedulerOutputEncoder
from kvllm.core.step_result import GrammarBitmaskFn, PendingStep, StepResult
from kvllm.distributed.parallel_state import disable_nvlink_multicast
from kvllm.executor.executor import Executor
from kvllm.logger import init_logger
from kvllm.models.model_config import ModelConfig
from kvllm.structured_output.manager import mask_by_value
from kvllm.worker.sleep_mode import SleepState
from kvllm.worker.worker_proc import WorkerInfo, WorkerStartup, worker_main

logger = init_logger(__name__)
SHUTDOWN_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A worker process failed (its traceback in the message) or died."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (rank 0 binds the process group's store to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _stop_workers(conns: list[Connection], procs: list[BaseProcess]) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", None))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(SHUTDOWN_TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


class _PendingMultiprocStep:
    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self.executor._receive("ok")
        return self._result


class MultiprocExecutor(Executor):
    """Starts `tensor_parallel_size` worker processes (spawned) and drives them over pipes."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, device: torch.device, max_num_batched_tokens: int
    ) -> None:
        world_size = args.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs; this machine has "
                f"{torch.cuda.device_count()}"
            )
        disable_nvlink_multicast()  # inherited by the spawned workers
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        backend = "nccl" if device.type == "cuda" else "gloo"
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            startup = WorkerStartup(
                rank,
                world_size,
                init_method,
                backend,
                device.type,
                rank,
                args,
                model_config,
                max_num_batched_tokens,
            )
            proc = context.Process(
                target=worker_main, args=(child, startup), name=f"kvllm-tp{rank}", daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_workers, self._conns, self._procs)
        self._stash: deque[tuple[str, Any]] = deque()  # rank 0's answers read ahead of their turn
        self._encoder = SchedulerOutputEncoder()
        self._sleep_state: SleepState | None = None
        try:
            infos = self._collect_all()
        except BaseException:
            self.shutdown()
            raise
        self._info: WorkerInfo = infos[0]
        logger.info("Started %d tensor-parallel workers (%s, %s)", world_size, backend, init_method)

    # ---- messaging ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._procs)

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs if proc.pid is not None]

    def _broadcast(self, method: str, payload: Any = None) -> None:
        message = pickle.dumps((method, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(message)

    def _read(self, rank: int) -> tuple[str, Any]:
        try:
            kind, value = self._conns[rank].recv()
        except (EOFError, OSError) as exc:
            proc = self._procs[rank]
            proc.join(1.0)
            raise WorkerError(
                f"worker rank {rank} (pid {proc.pid}) is gone (exit code {proc.exitcode}): {exc!r}"
            ) from exc
        if kind == "error":
            raise WorkerError(value)
        return kind, value

    def _ready(self, ranks: list[int]) -> list[int]:
        """The ranks (of `ranks`, plus any rank that reports an error) with a message; blocks until one.
        A rank whose process died counts as ready: reading it raises."""
        waitables: dict[Any, int] = {}
        for rank in range(self.world_size):
            waitables[self._conns[rank]] = rank
            waitables[self._procs[rank].sentinel] = rank
        return sorted({waitables[w] for w in wait(list(waitables))})

    def _receive(self, kind: str) -> Any:
        """Rank 0's next answer of `kind` (answers of other kinds read meanwhile wait in the stash);
        an error of any rank is raised."""
        for i, (stashed_kind, value) in enumerate(self._stash):
            if stashed_kind == kind:
                del self._stash[i]
                return value
        while True:
            for rank in self._ready(list(range(self.world_size))):
                got, value = self._read(rank)
                if rank > 0:  # ranks > 0 speak out of turn only to report an error (raised above)
                    raise WorkerError(f"worker rank {rank} sent an unexpected {got!r}")
                if got == kind:
                    return value
                self._stash.append((got, value))

    def _collect_all(self) -> list[Any]:
        """Every rank's answer to the call just broadcast (the calls in ALL_RANKS_ANSWER), in rank order."""
        answers: dict[int, Any] = {}
        while len(answers) < self.world_size:
            for rank in self._ready([r for r in range(self.world_size) if r not in answers]):
                if rank in answers:
                    continue
                answers[rank] = self._read(rank)[1]
        return [answers[rank] for rank in range(self.world_size)]

    def shutdown(self) -> None:
        """Stop every worker process (idempotent)."""
        self._finalizer()

    # ---- Executor ----------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._info.block_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._info.kv_cache_spec

    @property
    def attention_backend_name(self) -> str:
        return self._info.attention_backend_name

    def bytes_per_block(self) -> int:
        return self._info.bytes_per_block

    def determine_num_blocks(self) -> int:
        self._broadcast("determine_num_blocks")
        return min(self._collect_all())  # every rank holds every block (of its heads)

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        self._broadcast("initialize_kv_cache", (num_blocks, max_num_reqs))
        self._collect_all()

    @property
    def sleep_state(self) -> SleepState | None:
        return self._sleep_state

    def sleep(self, level: int) -> None:
        self._broadcast("sleep", level)
        self._collect_all()
        self._sleep_state = SleepState(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self._broadcast("wake_up", tags)
        self._sleep_state = self._collect_all()[0]

    def execute_model(self, plan: SchedulerOutput) -> StepResult:
        return self.execute_model_async(plan).result()

    def execute_model_async(
        self, plan: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStep:
        self._broadcast("execute_model", (self._encoder.encode(plan), grammar_bitmask is not None))
        if grammar_bitmask is not None:
            rows = self._receive("grammar_rows")
            masks = mask_by_value(grammar_bitmask(rows))
            self._broadcast("grammar_masks", masks)
        return _PendingMultiprocStep(self)
