"""RayExecutor: one Ray actor per tensor-parallel rank, placed by Ray (several machines allowed); the
engine and scheduler stay in the driver.

Each actor holds a WorkerProc (kvllm/worker/worker_proc.py), the same rank body the mp executor's
processes run, and answers its calls in order (one thread). A step's encoded SchedulerOutput is put in
Ray's object store once and handed to every actor. Structured outputs' masks take a second, concurrent
method group: rank 0 hands over the rows that sample while its step waits, and every rank takes the
driver's masks. The process group's address is rank 0's node. Needs the `ray` package (`pip install
kvllm[ray]`); without a running Ray cluster, `ray.init()` starts a local one.
"""

from __future__ import annotations

import os
import queue
from typing import Any

import torch

from kvllm.attention.metadata import KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.core.sched_output import SchedulerOutput
from kvllm.core.sched_wire import SchedulerOutputEncoder
from kvllm.core.step_result import GrammarBitmaskFn, PendingStep, StepResult
from kvllm.distributed.parallel_state import NVLINK_MULTICAST_OFF, disable_nvlink_multicast
from kvllm.executor.executor import Executor
from kvllm.executor.multiproc_executor import free_port
from kvllm.logger import init_logger
from kvllm.models.model_config import ModelConfig
from kvllm.structured_output.manager import mask_by_value
from kvllm.worker.sleep_mode import SleepState
from kvllm.worker.worker_proc import WorkerInfo, WorkerProc, WorkerStartup

logger = init_logger(__name__)
SHUTDOWN_TIMEOUT_S = 10.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend='ray' needs the ray package: pip install 'kvllm[ray]' "
            "(or use distributed_executor_backend='mp' on one machine)"
        ) from exc
    return ray


class RayWorkerActor:
    """The body of one rank's actor (wrapped by ray.remote in RayExecutor)."""

    def __init__(self) -> None:
        self.proc: WorkerProc | None = None
        self._rows: queue.Queue[list[int]] = queue.Queue()
        self._masks: queue.Queue[torch.Tensor | None] = queue.Queue()

    def address(self) -> tuple[str, int, int]:
        """(node IP, a free port on it, pid): where rank 0 hosts the process group's store."""
        import ray

        return ray.util.get_node_ip_address(), free_port(""), os.getpid()

    def start(self, startup: WorkerStartup) -> WorkerInfo:
        if startup.device_type == "cuda":  # Ray shows each actor its own GPU only
            startup = WorkerStartup(**{**startup.__dict__, "device_index": 0})
        self.proc = WorkerProc(startup)
        return self.proc.info

    def call(self, method: str, payload: Any) -> Any:
        assert self.proc is not None
        grammar = self._grammar if method == "execute_model" and payload[1] else None
        return self.proc.call(method, payload, grammar)

    def _grammar(self, rows: list[int]) -> torch.Tensor | None:
        assert self.proc is not None
        if self.proc.rank == 0:
            self._rows.put(rows)
        return self._masks.get()

    def grammar_rows(self) -> list[int]:
        return self._rows.get()

    def grammar_masks(self, masks: torch.Tensor | None) -> None:
        self._masks.put(masks)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()


class _PendingRayStep:
    def __init__(self, ray: Any, refs: list[Any]) -> None:
        self.ray, self.refs = ray, refs
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self.ray.get(self.refs)[0]  # every rank's: errors of any rank are raised
        return self._result


class RayExecutor(Executor):
    """Starts `tensor_parallel_size` Ray actors (a GPU each on CUDA) and drives them."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, device: torch.device, max_num_batched_tokens: int
    ) -> None:
        ray = self._ray = _import_ray()
        disable_nvlink_multicast()
        env_vars = dict(NVLINK_MULTICAST_OFF)
        if "PYTHONPATH" in os.environ:
            env_vars["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if not ray.is_initialized():
            ray.init(runtime_env={"env_vars": env_vars})
        world_size = args.tensor_parallel_size
        on_cuda = device.type == "cuda"
        actor_cls = ray.remote(concurrency_groups={"grammar": 2})(RayWorkerActor).options(
            num_gpus=1 if on_cuda else 0,
            num_cpus=0,  # placed by GPU; CPU workers (tests) reserve nothing
            runtime_env={"env_vars": env_vars},
        )
        self._actors = [actor_cls.remote() for _ in range(world_size)]
        self._stopped = False
        try:
            host, port, _ = ray.get(self._actors[0].address.remote())
            init_method = f"tcp://{host}:{port}"
            backend = "nccl" if on_cuda else "gloo"
            startups = [
                WorkerStartup(
                    rank,
                    world_size,
                    init_method,
                    backend,
                    device.type,
                    0,
                    args,
                    model_config,
                    max_num_batched_tokens,
                )
                for rank in range(world_size)
            ]
            infos = ray.get([actor.start.remote(s) for actor, s in zip(self._actors, startups, strict=True)])
        except BaseException:
            self.shutdown()
            raise
        self._info: WorkerInfo = infos[0]
        self._encoder = SchedulerOutputEncoder()
        self._sleep_state: SleepState | None = None
        logger.info("Started %d tensor-parallel Ray actors (%s, %s)", world_size, backend, init_method)

    @property
    def worker_pids(self) -> list[int]:
        return [pid for _, _, pid in self._ray.get([a.address.remote() for a in self._actors])]

    def _call_all(self, method: str, payload: Any = None) -> list[Any]:
        return self._ray.get([actor.call.remote(method, payload) for actor in self._actors])

    def shutdown(self) -> None:
        """Stop every actor (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        try:
            ray.wait(
                [a.close.remote() for a in self._actors],
                num_returns=len(self._actors),
                timeout=SHUTDOWN_TIMEOUT_S,
            )
        finally:
            for actor in self._actors:
                ray.kill(actor)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown: Ray may be gone already
            pass

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
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        self._call_all("initialize_kv_cache", (num_blocks, max_num_reqs))

    @property
    def sleep_state(self) -> SleepState | None:
        return self._sleep_state

    def sleep(self, level: int) -> None:
        self._call_all("sleep", level)
        self._sleep_state = SleepState(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self._sleep_state = self._call_all("wake_up", tags)[0]

    def execute_model(self, plan: SchedulerOutput) -> StepResult:
        return self.execute_model_async(plan).result()

    def execute_model_async(
        self, plan: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> PendingStep:
        ray = self._ray
        payload = ray.put((self._encoder.encode(plan), grammar_bitmask is not None))
        refs = [actor.call.remote("execute_model", payload) for actor in self._actors]
        if grammar_bitmask is not None:
            rows = ray.get(self._actors[0].grammar_rows.options(concurrency_group="grammar").remote())
            masks = ray.put(mask_by_value(grammar_bitmask(rows)))
            ray.get(
                [a.grammar_masks.options(concurrency_group="grammar").remote(masks) for a in self._actors]
            )
        return _PendingRayStep(ray, refs)
