"""The body of one tensor-parallel worker process: joins the group, owns a Worker, serves the driver.

The driver (kvllm/executor/multiproc_executor.py) sends `(method, payload)` over a pipe; every rank
runs the same calls in the same order, so their collectives meet. Rank 0 answers every call; the
other ranks answer only the calls whose answer the driver combines (KV-cache sizing) and any error,
so a step costs the driver one message out per rank and one back. The loop ends on "shutdown" or when
the driver's end of the pipe closes (the driver exited or died): no worker outlives its engine.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvllm.attention.metadata import KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_wire import SchedulerOutputDecoder, WireSchedulerOutput
from kvllm.core.step_result import GrammarBitmaskFn
from kvllm.distributed.communication import tensor_model_parallel_all_reduce
from kvllm.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
from kvllm.models.model_config import ModelConfig
from kvllm.worker.sleep_mode import SleepState
from kvllm.worker.worker import Worker

# The calls every rank answers (the driver combines them); the others only rank 0 answers.
ALL_RANKS_ANSWER = frozenset({"determine_num_blocks", "initialize_kv_cache", "sleep", "wake_up"})


@dataclass(frozen=True)
class WorkerInfo:
    """What the driver learns from rank 0 once the model is loaded."""

    block_size: int
    kv_cache_spec: KVCacheSpec
    attention_backend_name: str
    bytes_per_block: int


@dataclass(frozen=True)
class WorkerStartup:
    rank: int
    world_size: int
    init_method: str
    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    device_index: int  # the GPU of this rank, as this process numbers them (mp: the rank; Ray: 0)
    args: EngineArgs
    model_config: ModelConfig
    max_num_batched_tokens: int


class PipeGrammarRows:
    """The structured-output callback of a step in a pipe worker: rank 0 sends the rows that sample to
    the driver, and every rank receives the driver's masks (all ranks sample alike)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank

    def __call__(self, rows: list[int]) -> torch.Tensor | None:
        if self.rank == 0:
            self.conn.send(("grammar_rows", rows))
        kind, masks = self.conn.recv()
        assert kind == "grammar_masks", kind
        return masks


class WorkerProc:
    """One rank: joins the group, owns the Worker, and runs the driver's calls (whatever carries them:
    a pipe here, a Ray actor's methods in kvllm/executor/ray_executor.py)."""

    def __init__(self, startup: WorkerStartup) -> None:
        self.rank = startup.rank
        if startup.device_type == "cuda":
            torch.cuda.set_device(startup.device_index)
            self.device = torch.device("cuda", startup.device_index)
        else:
            self.device = torch.device("cpu")
        init_distributed_environment(startup.world_size, startup.rank, startup.init_method, startup.backend)
        # One collective now: NCCL builds its communicator at the first one, which must not be inside
        # a CUDA-graph capture (with kv_cache_memory_bytes set, nothing runs eagerly before capture).
        tensor_model_parallel_all_reduce(torch.zeros(1, device=self.device))
        self.worker = Worker(startup.args, startup.model_config, self.device, startup.max_num_batched_tokens)
        runner = self.worker.model_runner
        self.info = WorkerInfo(
            runner.block_size, runner.kv_cache_spec, runner.attn_backend.name, self.worker.bytes_per_block()
        )
        self.decoder = SchedulerOutputDecoder(self.device)

    def call(self, method: str, payload: Any, grammar: GrammarBitmaskFn | None = None) -> Any:
        worker = self.worker
        if method == "execute_model":
            wire, _ = payload
            assert isinstance(wire, WireSchedulerOutput)
            return worker.execute_model_async(self.decoder.decode(wire), grammar).result()
        if method == "determine_num_blocks":
            return worker.determine_num_blocks()
        if method == "initialize_kv_cache":
            return worker.initialize_kv_cache(*payload)
        if method == "sleep":
            return worker.sleep(payload)
        if method == "wake_up":
            worker.wake_up(payload)
            state = worker.model_runner.sleep_state  # its host weights stay in this process
            return (
                None
                if state is None
                else SleepState(state.level, {}, state.weights_asleep, state.kv_cache_asleep)
            )
        raise ValueError(f"unknown worker method {method!r}")

    def close(self) -> None:
        destroy_distributed_environment()


def worker_main(conn: Connection, startup: WorkerStartup) -> None:
    """Entry point of a worker process (the multiprocessing target)."""
    rank = startup.rank
    try:
        proc = WorkerProc(startup)
        conn.send(("ok", proc.info))
    except BaseException:  # noqa: BLE001 - every start-up failure goes back to the driver
        conn.send(("error", f"rank {rank} (pid {os.getpid()}) failed to start:\n{traceback.format_exc()}"))
        conn.close()
        return
    try:
        while True:
            try:
                method, payload = conn.recv()
            except (EOFError, OSError):  # the driver is gone
                return
            if method == "shutdown":
                return
            grammar = PipeGrammarRows(conn, rank) if method == "execute_model" and payload[1] else None
            try:
                result = proc.call(method, payload, grammar)
            except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
                conn.send(("error", f"rank {rank}: {method} failed:\n{traceback.format_exc()}"))
                continue
            if rank == 0 or method in ALL_RANKS_ANSWER:
                conn.send(("ok", result))
    finally:
        proc.close()
        conn.close()
