"""The fast-path comparison on one GPU: kvllm (per attention backend) or vLLM, same prompts, same sampling.

    PYTHONPATH=. python3 benchmarks/h200/fast_path_bench.py --engine kvllm --backend TRITON_ATTN --out DIR
    PYTHONPATH=.:/tmp/site-vllm python3 benchmarks/h200/fast_path_bench.py --engine vllm --out DIR

One engine per process (Qwen3-0.6B shapes, dummy bf16 weights, max_model_len 4096), then, in order:
  latency   batch 1, 8, 64, 256: 32 random prompt tokens, 128 output tokens, temperature 1.0, EOS
            ignored (vLLM's `bench latency` defaults); 2 warm-up + `--iters` timed runs; ms per output
            token = batch wall time / 128
  latency-long  batch 64 and 256 with 1,024-token prompts (128 out): decode over a long context, where
            attention reads ~1 GB of KV per layer-step at batch 256 (includes the prefill)
  ttft      one 1,024-token prompt, max_tokens 1: time to the first token (mean of 3, fresh prompts)
  nano      nano-vllm's bench.py workload (256 prompts, 133,966 output tokens, temperature 0.6), after
            one short warm-up request; output tokens per second = output tokens / wall time
  bs256     256 x 128 in / 128 out (kvllm's random set, seed 0), temperature 1.0; output tokens per second
  --profile-nano  the nano workload again under torch.profiler: its kernel timeline (kernel_timeline.py)
Prompts come from kvllm.benchmarks.datasets for both engines, and each latency run has fresh prompts,
so prefix caching never shortens a prefill. NVML's busy fraction is sampled during nano and bs256.
One JSON line per measurement goes to DIR/<engine>-<backend>.jsonl and to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.host_probe import host_cpu_probe_ms  # noqa: E402
from benchmarks.h200.step_log import StepLog  # noqa: E402
from kvllm.benchmarks.datasets import BenchRequest, nano_vllm_requests, random_requests  # noqa: E402
from kvllm.benchmarks.gpu_util import GpuUtilSampler  # noqa: E402
from kvllm.benchmarks.model_shapes import write_shape_only_model  # noqa: E402

VOCAB = 151936
LATENCY_BATCHES = (1, 8, 64, 256)
LONG_CONTEXT_BATCHES = (64, 256)


def generate(llm: Any, sampling_params: type, requests: list[BenchRequest], temperature: float) -> int:
    """One `LLM.generate` call of every request (either engine's API); returns the output tokens.

    No detokenization in either engine: vLLM runs without a tokenizer here (skip_tokenizer_init,
    dummy weights), so kvllm does not detokenize either; both compute the same tokens."""
    params = [
        sampling_params(
            temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=r.output_len, detokenize=False
        )
        for r in requests
    ]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


class KvllmEngine:
    def __init__(
        self, model: str, backend: str | None, eager: bool, async_scheduling: bool, kv_cache_dtype: str
    ) -> None:
        from kvllm import LLM

        start = time.perf_counter()
        kwargs: dict[str, Any] = dict(
            load_format="dummy",
            dtype="bfloat16" if _cuda() else "float32",
            max_model_len=4096 if _cuda() else 1024,
            enforce_eager=eager,
            async_scheduling=async_scheduling,
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
        )
        if backend:
            kwargs["attention_backend"] = backend
        self.llm = LLM(model, **kwargs)
        self.startup_s = time.perf_counter() - start
        self.name = f"kvllm-{self.llm.llm_engine.attention_backend_name}" + ("-eager" if eager else "")

    def generate(self, requests: list[BenchRequest], temperature: float) -> int:
        from kvllm import SamplingParams

        return generate(self.llm, SamplingParams, requests, temperature)


class VllmEngine:
    def __init__(
        self, model: str, backend: str | None, eager: bool, async_scheduling: bool, kv_cache_dtype: str
    ) -> None:
        from kvllm.benchmarks.vllm_backend import VLLM_ENV

        for key, value in {
            **VLLM_ENV,
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        }.items():
            os.environ.setdefault(key, value)
        import vllm
        from vllm import LLM

        start = time.perf_counter()
        kwargs: dict[str, Any] = dict(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=4096,
            gpu_memory_utilization=0.85,
            enforce_eager=eager,
            seed=0,
            generation_config="vllm",
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
        )
        if backend:
            kwargs["attention_config"] = {"backend": backend}
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - start
        self.name = f"vllm-{vllm.__version__}" + ("-eager" if eager else "")

    def generate(self, requests: list[BenchRequest], temperature: float) -> int:
        from vllm import SamplingParams

        return generate(self.llm, SamplingParams, requests, temperature)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sm_clock_mhz() -> int | None:
    """The GPU's current SM clock (NVML through torch), or None where NVML is not importable."""
    try:
        import torch

        return int(torch.cuda.clock_rate())
    except Exception:  # no CUDA, no pynvml: the clock is simply not recorded
        return None


class GcRecorder:
    """Python garbage collections while it is active: count per generation and milliseconds spent
    (the early batch-1 runs are host-bound and slower than the same runs later; the collector is
    one suspect)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.ms = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._started) * 1e3

    def __enter__(self) -> GcRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def host_cpu_state() -> dict[str, Any]:
    """The load average and the clock of the CPU this process last ran on (Linux; {} elsewhere)."""
    try:
        cpu = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])
        mhz = None
        with open("/proc/cpuinfo") as f:
            current = -1
            for line in f:
                if line.startswith("processor"):
                    current = int(line.split(":")[1])
                elif line.startswith("cpu MHz") and current == cpu:
                    mhz = float(line.split(":")[1])
                    break
        return {"cpu": cpu, "cpu_mhz": mhz, "loadavg_1m": float(open("/proc/loadavg").read().split()[0])}
    except (OSError, ValueError, IndexError):
        return {}


def timed(engine: Any, requests: list[BenchRequest], temperature: float) -> tuple[float, int]:
    _sync()
    start = time.perf_counter()
    tokens = engine.generate(requests, temperature)
    _sync()
    return time.perf_counter() - start, tokens


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("kvllm", "vllm"), required=True)
    parser.add_argument("--backend", default=None, help="attention backend (default: the engine's choice)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="kvllm only")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8, both engines"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--only", default="latency,latency-long,ttft,nano,bs256", help="comma list; also latency-late"
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument(
        "--assume-graph-support",
        action="store_true",
        help="kvllm: run a backend declared cudagraph_support='never' with decode graphs anyway (to measure "
        "hooks that tests/gpu/test_cuda_graphs_gpu.py is verifying); the label says so",
    )
    parser.add_argument(
        "--cprofile-bs1",
        action="store_true",
        help="kvllm: one more batch-1 run under cProfile after the timed ones (early and late), top functions "
        "to OUT/cprofile-<bench>.txt",
    )
    parser.add_argument(
        "--step-log", action="store_true", help="kvllm: log every step of the throughput runs (step_log.py)"
    )
    parser.add_argument(
        "--profile-long", default="", help="kvllm: step profiles at BSxCONTEXT pairs, e.g. 256x1024,32x2048"
    )
    parser.add_argument(
        "--profile-batches", default="", help="kvllm: step profiles (step_profile.py) at these batch sizes"
    )
    parser.add_argument(
        "--profile-nano",
        action="store_true",
        help="kvllm (vLLM runs its engine in another process): the nano workload once more under torch.profiler, "
        "its kernel timeline summarized (kernel_timeline.py: busy and idle time, exclusive time by kind and name)",
    )
    parser.add_argument(
        "--model", default=None, help="a model folder instead of Qwen3-0.6B's shapes (CPU checks)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    which = args.only.split(",")
    model = args.model or str(write_shape_only_model("Qwen3-0.6B", "/tmp/qwen3-0.6b-shape"))
    vocab = VOCAB if args.model is None else 400
    cls = KvllmEngine if args.engine == "kvllm" else VllmEngine
    assumed = ""
    if args.assume_graph_support and args.engine == "kvllm" and args.backend:
        from kvllm.attention.registry import get_backend_class

        backend_class = get_backend_class(args.backend)
        if backend_class.cudagraph_support == "never":
            backend_class.cudagraph_support = "decode_only"
            assumed = "-graphs-assumed"
    engine = cls(model, args.backend, args.enforce_eager, not args.no_async_scheduling, args.kv_cache_dtype)
    label = engine.name + assumed + ("-sync" if args.no_async_scheduling else "")
    label += "" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}"
    if args.engine == "kvllm" and os.environ.get("KVLLM_PDL", "1") == "0":
        label += "-no-pdl"  # programmatic dependent launch off (kvllm/utils/pdl.py)
    sink = open(out / f"{label}.jsonl", "w")

    def emit(record: dict[str, Any]) -> None:
        record = {"engine": label, **record}
        line = json.dumps(record)
        print(line, flush=True)
        sink.write(line + "\n")
        sink.flush()

    emit({"bench": "startup", "seconds": engine.startup_s})
    seed = iter(range(1000, 100000))
    engine.generate(random_requests(1, 16, 16, vocab, seed=next(seed)), 1.0)  # warm-up

    def latency(bench: str, bs: int) -> None:
        for _ in range(args.warmups):
            engine.generate(random_requests(bs, 32, 128, vocab, seed=next(seed)), 1.0)
        runs, started, clocks, cpu, collections, probes, states = [], [], [], [], [], [], []
        for _ in range(args.iters):
            probes.append(host_cpu_probe_ms())
            states.append(host_cpu_state())
            started.append(time.time())
            cpu_before = time.process_time()
            with GcRecorder() as collector:
                runs.append(timed(engine, random_requests(bs, 32, 128, vocab, seed=next(seed)), 1.0)[0])
            cpu.append(time.process_time() - cpu_before)  # all threads: near the wall time = host-bound
            clocks.append(sm_clock_mhz())
            collections.append({"by_generation": collector.counts, "ms": round(collector.ms, 3)})
        if args.cprofile_bs1 and bs == 1 and args.engine == "kvllm":
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            profiled_s = timed(engine, random_requests(bs, 32, 128, vocab, seed=next(seed)), 1.0)[0]
            profiler.disable()
            with open(out / f"cprofile-{bench}.txt", "w") as f:
                f.write(f"{bench}: one batch-1 run under cProfile, {profiled_s * 1e3:.1f} ms\n")
                pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
        mean = sum(runs) / len(runs)
        emit(
            {
                "bench": bench,
                "batch_size": bs,
                "input_len": 32,
                "output_len": 128,
                "latencies_s": runs,
                "mean_s": mean,
                "ms_per_output_token": mean / 128 * 1e3,
                "started_unix": started,
                "process_cpu_s": cpu,
                "sm_clock_mhz_after": clocks,
                "gc": collections,
                "host_cpu_probe_ms": probes,
                "host_cpu": states,
                "gc_tracked_objects": len(gc.get_objects()),
            }
        )

    if "latency" in which:
        for bs in LATENCY_BATCHES:
            latency("latency", bs)
    if "latency" in which and args.step_log and args.engine == "kvllm":
        # Where one batch-1 latency run's wall time goes: inside engine steps (prefill, decodes) or
        # around them (adding the request, collecting outputs).
        log = StepLog(engine.llm)
        with log:
            started = time.perf_counter()
            engine.generate(random_requests(1, 32, 128, vocab, seed=next(seed)), 1.0)
            ended = time.perf_counter()
        steps = log.steps
        emit(
            {
                "bench": "latency_steps",
                "batch_size": 1,
                "wall_ms": (ended - started) * 1e3,
                "steps": len(steps),
                "steps_ms": sum(st["ms"] for st in steps),
                "before_first_step_ms": (steps[0]["start"] - started) * 1e3 if steps else None,
                "first_steps_ms": [round(st["ms"], 3) for st in steps[:6]],
                "first_steps_tokens": [st["tokens"] for st in steps[:6]],
                "last_steps_ms": [round(st["ms"], 3) for st in steps[-4:]],
                "median_step_ms": sorted(st["ms"] for st in steps)[len(steps) // 2] if steps else None,
                "compiles": len(log.compiles),
            }
        )
    if "latency-long" in which:
        for bs in LONG_CONTEXT_BATCHES:
            engine.generate(random_requests(bs, 1024, 16, vocab, seed=next(seed)), 1.0)
            runs = [
                timed(engine, random_requests(bs, 1024, 128, vocab, seed=next(seed)), 1.0)[0]
                for _ in range(args.iters)
            ]
            mean = sum(runs) / len(runs)
            emit({"bench": "latency", "batch_size": bs, "input_len": 1024, "output_len": 128, "latencies_s": runs,
                  "mean_s": mean, "ms_per_output_token": mean / 128 * 1e3})  # fmt: skip
    if "ttft" in which:
        runs = [timed(engine, random_requests(1, 1024, 1, vocab, seed=next(seed)), 1.0)[0] for _ in range(4)][
            1:
        ]
        emit({"bench": "ttft", "prompt_len": 1024, "seconds": runs, "mean_ms": sum(runs) / len(runs) * 1e3})

    def throughput(
        name: str, requests: list[BenchRequest], warmup: list[BenchRequest], temperature: float
    ) -> None:
        engine.generate(warmup, 1.0)
        log = StepLog(engine.llm) if args.step_log and args.engine == "kvllm" else contextlib.nullcontext()
        with log, GpuUtilSampler() as util:
            elapsed, tokens = timed(engine, requests, temperature)
        emit({"bench": name, "seconds": elapsed, "out_tokens": tokens, "out_tok_per_s": tokens / elapsed,
              "gpu_busy": util.value, "gpu_busy_source": util.source})  # fmt: skip
        if isinstance(log, StepLog):
            (out / f"steps-{name}-{label}.json").write_text(json.dumps(log.steps))
            emit({"bench": "step_log", "run": name, **log.summary()})

    if "nano" in which:
        requests = nano_vllm_requests(vocab)
        throughput("nano", requests, [BenchRequest(requests[0].prompt_token_ids[:16], 16)], 0.6)
    if "bs256" in which:
        warmup = random_requests(256, 128, 128, vocab, seed=1)
        throughput("bs256", random_requests(256, 128, 128, vocab, seed=0), warmup, 1.0)
    if args.profile_nano and args.engine == "kvllm":
        from benchmarks.h200.kernel_timeline import profile_kernels

        requests = nano_vllm_requests(vocab)
        tokens, summary = profile_kernels(lambda: engine.generate(requests, 0.6))
        emit({"bench": "nano_kernels", "out_tokens": tokens, **summary})
    if "latency-late" in which:
        # Batch 1 again after the heavy runs: the first latency runs follow start-up directly, and
        # their steps have measured slower than later ones (a warm-up or clock effect, or the host).
        latency("latency_late", 1)
    if args.profile_batches and args.engine == "kvllm":
        from benchmarks.h200.step_profile import profile_one

        for bs in [int(x) for x in args.profile_batches.split(",")]:
            emit({"bench": "step_profile", **profile_one(engine.llm, bs, 12, 128)})
    if args.profile_long and args.engine == "kvllm":
        from benchmarks.h200.step_profile import profile_one

        for pair in args.profile_long.split(","):
            bs, ctx = (int(x) for x in pair.split("x"))
            emit({"bench": "step_profile", **profile_one(engine.llm, bs, 12, ctx)})
    sink.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
