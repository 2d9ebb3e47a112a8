"""`kvllm bench latency`: the latency of one batch end to end, with vLLM's flags and defaults.

One batch of `--batch-size` random-token prompts of `--input-len` tokens, each generating exactly
`--output-len` tokens (EOS ignored), timed `--num-iters` times after `--num-iters-warmup` runs.
Reported: average and percentile latency, `prefill_latency` (until every request of the batch had
its first token), `decode_throughput` = batch * (output_len - 1) / (latency - prefill_latency), and
`gpu_util` (NVML busy fraction during the timed runs; null without a GPU).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvllm.benchmarks.datasets import random_requests
from kvllm.benchmarks.engine_runner import build_llm, engine_description, run_batch
from kvllm.benchmarks.gpu_util import GpuUtilSampler
from kvllm.benchmarks.utils import (
    PERCENTILES,
    add_common_flags,
    add_flag,
    environment,
    gpu_util_line,
    mean,
    percentile,
    write_json,
)
from kvllm.logger import init_logger

if TYPE_CHECKING:
    from kvllm.llm import LLM

DEFAULT_PROFILE_DIR = "kvllm_profile"
logger = init_logger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The latency benchmark's own flags (engine arguments come from the shared parser)."""
    group = parser.add_argument_group("latency benchmark")
    add_flag(group, "input_len", type=int, default=32, help="Prompt length in tokens (default: 32).")
    add_flag(group, "output_len", type=int, default=128, help="Generated tokens per request (default: 128).")
    add_flag(group, "batch_size", type=int, default=8, help="Requests in the batch (default: 8).")
    group.add_argument("--n", type=int, default=1, help="Sequences generated per prompt (default: 1).")
    add_flag(
        group, "num_iters_warmup", type=int, default=10, help="Untimed warm-up iterations (default: 10)."
    )
    add_flag(group, "num_iters", type=int, default=30, help="Timed iterations (default: 30).")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Write a torch profiler trace of one iteration (after warm-up) to --profile-dir.",
    )
    add_flag(
        group,
        "profile_dir",
        default=None,
        help=f"Folder for profiler traces (default: ./{DEFAULT_PROFILE_DIR}).",
    )
    add_flag(
        group,
        "profile_steps",
        type=int,
        default=None,
        help="Profile only the first N engine steps of the profiled iteration (implies --profile).",
    )
    group.add_argument(
        "--backend",
        dest="backend",
        default=None,
        metavar="NAME",
        help="vllm: measure vLLM's LLM API instead (when vLLM is importable), on the same prompts and "
        "sampling. An attention backend name, as some guides write it: the same as --attention-backend "
        "NAME (kvllm is the engine measured; HF transformers is in bench throughput --backend hf).",
    )
    add_common_flags(group)


def _check(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; allowed: >= 1")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup={args.num_iters_warmup} is not valid; allowed: >= 0")
    if args.profile_steps is not None and args.profile_steps < 1:
        raise ValueError(f"--profile-steps={args.profile_steps} is not valid; allowed: >= 1")


def measure_latency(llm: LLM, args: argparse.Namespace, quiet: bool = False) -> dict[str, Any]:
    """Run the warm-up, the optional profile and the timed iterations on `llm`; return the results."""
    from kvllm.sampling_params import SamplingParams

    _check(args)
    engine = llm.llm_engine
    max_len = engine.model_config.max_model_len
    if args.input_len + args.output_len > max_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds max_model_len={max_len}; "
            "shorten them or raise --max-model-len"
        )
    requests = random_requests(
        args.batch_size,
        args.input_len,
        args.output_len,
        engine.model_config.vocab_size,
        seed=engine.args.seed,
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=args.output_len,
            detokenize=not args.disable_detokenize,
        )
    ] * len(prompts)
    say = (lambda *a: None) if quiet else print

    for i in range(args.num_iters_warmup):
        say(f"Warm-up iteration {i + 1}/{args.num_iters_warmup}")
        run_batch(engine, prompts, params)
    trace = None
    if args.profile or args.profile_steps is not None:
        trace = _profile(engine, prompts, params, args, say)

    timings = []
    with GpuUtilSampler() as sampler:
        for i in range(args.num_iters):
            timings.append(run_batch(engine, prompts, params))
            say(f"Iteration {i + 1}/{args.num_iters}: {timings[-1].latency:.4f} s")
    latencies = [t.latency for t in timings]
    prefills = [t.first_token_latency for t in timings]
    avg_latency, prefill_latency = mean(latencies), mean(prefills)
    decode_time = avg_latency - prefill_latency
    decode_tokens = args.batch_size * args.n * (args.output_len - 1)
    result: dict[str, Any] = {
        "benchmark": "latency",
        "backend": "kvllm",
        "config": {
            k: getattr(args, k)
            for k in (
                "batch_size",
                "input_len",
                "output_len",
                "n",
                "num_iters_warmup",
                "num_iters",
                "disable_detokenize",
            )
        },
        "engine": engine_description(llm),
        "avg_latency": avg_latency,
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
        "prefill_latency": prefill_latency,
        "prefill_latencies": prefills,
        "decode_throughput": decode_tokens / decode_time if decode_time > 0 and decode_tokens else None,
        "output_throughput": args.batch_size * args.n * args.output_len / avg_latency,
        "num_steps": timings[-1].num_steps,
        "gpu_util": sampler.value,
        "gpu_util_source": sampler.source,
        "profile_trace": trace,
        "env": environment(),
    }
    return result


def _profile(
    engine: Any, prompts: list[list[int]], params: list[Any], args: argparse.Namespace, say: Any
) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    folder = Path(args.profile_dir or os.environ.get("KVLLM_PROFILE_DIR") or DEFAULT_PROFILE_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    steps = [0]
    prof = profile(activities=activities, record_shapes=True)

    def on_step() -> None:
        steps[0] += 1
        if args.profile_steps is not None and steps[0] == args.profile_steps:
            prof.stop()

    prof.start()
    try:
        run_batch(engine, prompts, params, on_step=on_step)
    finally:
        if args.profile_steps is None or steps[0] < args.profile_steps:
            prof.stop()
    path = folder / (
        f"latency-{engine.attention_backend_name}-bs{args.batch_size}-in{args.input_len}"
        f"-out{args.output_len}.pt.trace.json"
    )
    prof.export_chrome_trace(str(path))
    sort_by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    say(prof.key_averages().table(sort_by=sort_by, row_limit=15))
    say(f"Profiled {min(steps[0], args.profile_steps or steps[0])} engine steps; trace written to {path}")
    return str(path)


def print_result(result: dict[str, Any]) -> None:
    print(f"Avg latency: {result['avg_latency']:.6f} seconds")
    for q, value in result["percentiles"].items():
        print(f"{q}% percentile latency: {value:.6f} seconds")
    if result["prefill_latency"] is not None:
        print(f"Prefill latency (all first tokens of the batch): {result['prefill_latency']:.6f} seconds")
    decode = result["decode_throughput"]
    print(
        f"Decode throughput: {decode:.2f} output tokens/s"
        if decode is not None
        else "Decode throughput: n/a (output_len 1)"
    )
    print(gpu_util_line(result))


def measure_latency_vllm(engine_kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The same batch latency on the vLLM peer (same prompts, sampling, warm-ups and iterations)."""
    from kvllm.benchmarks.vllm_backend import VLLMRunner
    from kvllm.config.engine import EngineArgs

    _check(args)
    engine_args = EngineArgs(**{"enable_prefix_caching": False, **engine_kwargs})
    runner = VLLMRunner(engine_args)
    requests = random_requests(
        args.batch_size,
        args.input_len,
        args.output_len,
        runner.model_config.vocab_size,
        seed=engine_args.seed,
    )
    for _ in range(args.num_iters_warmup):
        runner.generate(requests, 1.0, args.n)
    with GpuUtilSampler() as sampler:
        runs = [runner.generate(requests, 1.0, args.n) for _ in range(args.num_iters)]
    latencies = [r.elapsed for r in runs]
    firsts = [r.first_token_latency for r in runs if r.first_token_latency is not None]
    avg_latency = mean(latencies)
    prefill_latency = mean(firsts) if firsts else None
    decode_tokens = args.batch_size * args.n * (args.output_len - 1)
    decode_time = avg_latency - prefill_latency if prefill_latency is not None else None
    return {
        "benchmark": "latency",
        "backend": "vllm",
        "config": {
            k: getattr(args, k)
            for k in ("batch_size", "input_len", "output_len", "n", "num_iters_warmup", "num_iters")
        },
        "engine": runner.describe(),
        "avg_latency": avg_latency,
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
        "prefill_latency": prefill_latency,
        "decode_throughput": decode_tokens / decode_time if decode_time and decode_tokens else None,
        "output_throughput": args.batch_size * args.n * args.output_len / avg_latency,
        "gpu_util": sampler.value,
        "gpu_util_source": sampler.source,
        "env": environment(),
    }


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Build the engine from `engine_kwargs`, run the benchmark, print it and write --output-json."""
    _check(args)
    if getattr(args, "backend", None) == "vllm":
        result = measure_latency_vllm(engine_kwargs, args)
        print_result(result)
        write_json(args.output_json, result)
        return 0
    llm = build_llm(engine_kwargs, enable_prefix_caching=False)
    result = measure_latency(llm, args)
    print_result(result)
    write_json(args.output_json, result)
    return 0
