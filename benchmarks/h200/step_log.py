"""Where a throughput run's wall time goes, step by step: a host-clock log of every engine step.

    with StepLog(llm) as log:
        llm.generate(...)
    summary = log.summary()

Each `LLMEngine.step` call is recorded with its host wall time and the plan it launched (requests,
tokens, decode-only or mixed). With async scheduling a step's wall time includes waiting for the
previous step's tokens, so the steps' times add up to the run's wall time. Triton compilations during
the run are counted through Triton's JIT hooks (where the installed Triton has them), each with the
kernel's name and the time it took, since a compile inside a timed run stalls the GPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


class StepLog:
    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.steps: list[dict[str, Any]] = []
        self.compiles: list[dict[str, Any]] = []
        self._compile_started: float | None = None
        self._restore: list[tuple[Any, str, Any]] = []
        self._hooks: dict[str, Any] = {}

    def __enter__(self) -> StepLog:
        engine = self.engine
        scheduler = engine.scheduler
        original_schedule, original_step = scheduler.schedule, engine.step
        last_plan: list[Any] = [None]

        def schedule(*args: Any, **kwargs: Any) -> Any:
            last_plan[0] = plan = original_schedule(*args, **kwargs)
            return plan

        def step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            outputs = original_step(*args, **kwargs)
            end = time.perf_counter()
            plan = last_plan[0]
            lens = [s.num_new_tokens for s in plan.scheduled] if plan is not None else []
            self.steps.append(
                {
                    "start": start,
                    "ms": (end - start) * 1e3,
                    "reqs": len(lens),
                    "tokens": sum(lens),
                    "decode_only": bool(lens) and max(lens) == 1,
                    "context": sum(s.request.num_computed_tokens for s in plan.scheduled) if plan else 0,
                }
            )
            return outputs

        scheduler.schedule, engine.step = schedule, step
        self._restore += [(scheduler, "schedule", original_schedule), (engine, "step", original_step)]
        self._install_compile_hooks()
        return self

    def _install_compile_hooks(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return

        def before(*args: Any, **kwargs: Any) -> bool:
            self._compile_started = time.perf_counter()
            return False  # compile as usual

        def after(*args: Any, **kwargs: Any) -> None:
            fn = kwargs.get("fn")
            started = self._compile_started or time.perf_counter()
            self.compiles.append(
                {
                    "at": started,
                    "kernel": getattr(fn, "name", str(fn)),
                    "ms": (time.perf_counter() - started) * 1e3,
                    "repr": str(kwargs.get("repr", "")),
                }
            )

        self._hooks = {
            "jit_cache_hook": runtime.jit_cache_hook,
            "jit_post_compile_hook": runtime.jit_post_compile_hook,
        }
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        if self._hooks:
            from triton import knobs

            for name, hook in self._hooks.items():
                setattr(knobs.runtime, name, hook)

    def summary(self, slowest: int = 12) -> dict[str, Any]:
        steps = self.steps
        groups: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "ms": 0.0, "tokens": 0})
        for s in steps:
            kind = "decode" if s["decode_only"] else ("mixed" if s["reqs"] else "empty")
            groups[kind]["steps"] += 1
            groups[kind]["ms"] += s["ms"]
            groups[kind]["tokens"] += s["tokens"]
        decode = [s for s in steps if s["decode_only"]]
        by_batch: dict[str, list[float]] = defaultdict(list)
        for s in decode:
            bucket = 256 if s["reqs"] > 128 else 128 if s["reqs"] > 64 else 64 if s["reqs"] > 16 else 16
            by_batch[f"<={bucket}"].append(s["ms"])
        t0 = steps[0]["start"] if steps else 0.0
        return {
            "num_steps": len(steps),
            "total_ms": sum(s["ms"] for s in steps),
            "by_kind": dict(groups),
            "decode_ms_per_step_by_batch": {k: sum(v) / len(v) for k, v in sorted(by_batch.items())},
            "slowest_steps": [
                {**{k: v for k, v in s.items() if k != "start"}, "at_s": s["start"] - t0}
                for s in sorted(steps, key=lambda s: -s["ms"])[:slowest]
            ],
            "triton_compiles": len(self.compiles),
            "triton_compile_ms": sum(c["ms"] for c in self.compiles),
            "compiles": [{**c, "at": c["at"] - t0} for c in self.compiles[:40]],
        }
