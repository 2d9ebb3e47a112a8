"""Where a decode step goes: kernels per step and per decoder layer, GPU time, and host time by phase.

    PYTHONPATH=. python3 benchmarks/h200/step_profile.py --out DIR [--enforce-eager] [--backend NAME]
        [--output-kinds cumulative,final_only]

Qwen3-0.6B shapes, dummy bf16 weights. For each batch size, the batch is prefilled (in 128 tokens
each), then `--steps` pure decode steps are timed: wall time, and the host time of each engine phase
(schedule, prepare inputs, forward launch or graph replay, logits + sampling launch, wait for the
sampled ids, output processing), measured by wrapping those functions with a host clock. The same
steps are then profiled with torch.profiler (CUDA activity): kernels per step and per layer, and the
GPU-busy time per step (the sum of kernel durations). One JSON line per batch size goes to
DIR/step_profile-<label>.jsonl, plus a short table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvllm import LLM, SamplingParams  # noqa: E402
from kvllm.benchmarks.model_shapes import write_shape_only_model  # noqa: E402

NUM_LAYERS = 28


class PhaseTimer:
    """Wraps methods so each call adds its host time to a named phase (wall time by default; a CPU
    benchmark on a shared machine passes time.thread_time)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)
        clock = self.clock

        def timed(*args, **kwargs):
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += clock() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def reset(self) -> None:
        self.totals.clear()

    def unwrap(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(engine, num_steps: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    _sync()
    return time.perf_counter() - start


def profile_one(
    llm: LLM, batch_size: int, steps: int, input_len: int, output_kind: str = "cumulative"
) -> dict:
    """`output_kind`: cumulative (the engine's default: every step builds every request's output),
    final_only (what LLM.generate asks for: an output only when a request finishes) or delta."""
    import random

    from kvllm.sample import sampler as sampler_module
    from kvllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    rng = random.Random(0)
    bound = min(10000, engine.model_config.vocab_size)
    prompts = [[rng.randrange(bound) for _ in range(input_len)] for _ in range(batch_size)]
    params = SamplingParams(
        temperature=0.6,
        max_tokens=3 * steps + 8,
        ignore_eos=True,
        output_kind=RequestOutputKind[output_kind.upper()],
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"p{batch_size}-{i}", {"prompt_token_ids": p}, params)
    # Prefill (and any chunking) until every request decodes.
    while (
        any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()  # warm

    timer = PhaseTimer()
    runner = engine.executor.worker.model_runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner.input_batch, "prepare", "prepare")
    if runner.graph_runner is not None:
        timer.wrap(runner.graph_runner, "replay", "forward")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner.sampler, "sample", "sample")
    timer.wrap(sampler_module.HostCopy, "wait", "wait for the device")
    timer.wrap(engine, "step", "step")
    wall = decode_steps(engine, steps)
    phases = {k: v / steps * 1e3 for k, v in timer.totals.items()}
    timer.unwrap()
    outside = phases.get("step", 0.0) - sum(v for k, v in phases.items() if k != "step")
    phases["engine (scheduler bookkeeping, outputs, stop checks)"] = outside

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_steps(engine, steps)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_count = len(kernels) / steps
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    by_name: dict[str, int] = defaultdict(int)
    time_by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e.name] += 1
        time_by_name[e.name] += e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    top_time = sorted(time_by_name.items(), key=lambda kv: -kv[1])[:12]
    for rid in list(engine.output_processor.parents):
        engine.abort_request(rid)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_kind": output_kind,
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "host_ms_per_step_by_phase": phases,
        "cuda_kernels_per_step": kernel_count,
        "cuda_kernels_per_layer": kernel_count / NUM_LAYERS,
        "gpu_busy_ms_per_step": busy_ms,
        "gpu_busy_fraction": busy_ms / (wall / steps * 1e3) if wall else None,
        "kernels_by_name_per_step": {name: n / steps for name, n in top},
        "gpu_us_by_kernel_per_step": {name[:120]: us / steps for name, us in top_time},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="TRITON_ATTN")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--output-kinds",
        default="cumulative",
        help="comma-separated: cumulative (the engine's default), final_only (LLM.generate's), delta",
    )
    parser.add_argument("--label", default=None)
    parser.add_argument(
        "--model", default=None, help="A model folder instead of Qwen3-0.6B's shapes (CPU checks)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or write_shape_only_model("Qwen3-0.6B", "/tmp/qwen3-0.6b-shape")
    llm = LLM(
        str(model),
        load_format="dummy",
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=4096 if args.model is None else 1024,
        attention_backend=args.backend,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
    )
    label = args.label or f"{args.backend}-{'eager' if args.enforce_eager else 'graphs'}"
    rows = []
    with open(out / f"step_profile-{label}.jsonl", "w") as f:
        for kind in args.output_kinds.split(","):
            for bs in [int(x) for x in args.batch_sizes.split(",")]:
                row = {"label": label, **profile_one(llm, bs, args.steps, args.input_len, kind)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
    print(f"\n{label}: per decode step")
    print(
        f"{'kind':>10} {'bs':>4} {'wall ms':>8} {'GPU busy ms':>11} {'busy':>5} {'kernels':>8} {'/layer':>7}  host ms by phase"
    )
    for r in rows:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step_by_phase"].items() if k != "step")
        print(
            f"{r['output_kind']:>10} {r['batch_size']:>4} {r['wall_ms_per_step']:>8.3f} {r['gpu_busy_ms_per_step']:>11.3f} "
            f"{r['gpu_busy_fraction']:>5.0%} {r['cuda_kernels_per_step']:>8.0f} {r['cuda_kernels_per_layer']:>7.1f}  {phases}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
