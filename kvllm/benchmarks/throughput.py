"""`kvllm bench throughput`: offline throughput of kvllm, or of HF transformers on the same workload.

`--dataset-name random` (vLLM's): `--num-prompts` prompts of random ids, `--input-len` in and
`--output-len` out each (EOS ignored). `--dataset-name nano-vllm`: nano-vllm's bench.py workload
(256 sequences, lengths uniform in [100, 1024], temperature 0.6, max_model_len 4096, one warm-up).
`--backend hf` runs HF `generate` on the same model, dtype and prompts, so the peer is measured by
the same command. Reported: requests/s, total tokens/s and output tokens/s.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from kvllm.benchmarks.backend_flag import check_throughput_backend
from kvllm.benchmarks.datasets import (
    NANO_VLLM_MAX_MODEL_LEN,
    BenchRequest,
    nano_vllm_requests,
    random_requests,
)
from kvllm.benchmarks.engine_runner import build_llm, engine_description, synchronize
from kvllm.benchmarks.gpu_util import GpuUtilSampler
from kvllm.benchmarks.utils import (
    add_common_flags,
    add_flag,
    add_random_range_ratio_flag,
    environment,
    gpu_util_line,
    write_json,
)

if TYPE_CHECKING:
    from kvllm.benchmarks.hf_backend import HFRunner
    from kvllm.llm import LLM

DATASETS = ("random", "nano-vllm")
NANO_VLLM_TEMPERATURE = 0.6


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The throughput benchmark's own flags (engine arguments come from the shared parser)."""
    group = parser.add_argument_group("throughput benchmark")
    group.add_argument(
        "--backend",
        default="kvllm",
        metavar="{kvllm,hf,vllm}",
        help="The engine measured: kvllm, hf for HF transformers generate, or vllm for vLLM's LLM API "
        "(when vLLM is importable), on the same model, prompts and sampling (default: kvllm). The "
        "attention backend is --attention-backend.",
    )
    add_flag(
        group,
        "dataset_name",
        choices=DATASETS,
        default="random",
        help="random (vLLM's) or nano-vllm (its bench.py workload).",
    )
    add_flag(
        group,
        "input_len",
        type=int,
        default=128,
        help="Prompt length in tokens for the random dataset (default: 128).",
    )
    add_flag(
        group,
        "output_len",
        type=int,
        default=128,
        help="Generated tokens per request for the random dataset (default: 128).",
    )
    add_flag(
        group,
        "num_prompts",
        type=int,
        default=1000,
        help="Number of prompts of the random dataset (default: 1000).",
    )
    add_random_range_ratio_flag(group)
    add_flag(
        group,
        "hf_max_batch_size",
        type=int,
        default=None,
        help="Batch size of the hf backend (default: --max-num-seqs, 256).",
    )
    group.add_argument(
        "--hf-attn-implementation",
        dest="hf_attn_implementation",
        default="sdpa",
        help="attn_implementation of the HF model (default: sdpa).",
    )
    group.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="Skip the untimed warm-up request (one short request, as nano-vllm does).",
    )
    add_common_flags(group)


def make_requests(args: argparse.Namespace, vocab_size: int, seed: int) -> list[BenchRequest]:
    if args.dataset_name == "nano-vllm":
        return nano_vllm_requests(vocab_size)
    return random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        vocab_size,
        seed=seed,
        range_ratio=args.random_range_ratio,
    )


def _warmup_request(requests: list[BenchRequest]) -> BenchRequest:
    return BenchRequest(requests[0].prompt_token_ids[:16], 16)


def run_kvllm(llm: LLM, requests: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """Generate every request with `LLM.generate` in one call; time it and sample GPU utilization."""
    from kvllm.sampling_params import SamplingParams

    temperature = NANO_VLLM_TEMPERATURE if args.dataset_name == "nano-vllm" else 1.0
    detokenize = not args.disable_detokenize
    if args.warmup:
        warm = _warmup_request(requests)
        llm.generate(
            [{"prompt_token_ids": warm.prompt_token_ids}],
            SamplingParams(max_tokens=warm.output_len, ignore_eos=True),
            use_tqdm=False,
        )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=r.output_len,
            detokenize=detokenize,
        )
        for r in requests
    ]
    with GpuUtilSampler() as sampler:
        synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        synchronize()
        elapsed = time.perf_counter() - start
    num_output = sum(o.num_output_tokens for o in outputs)
    return {
        "elapsed_time": elapsed,
        "num_output_tokens": num_output,
        "num_generated_tokens": num_output,
        "gpu_util": sampler.value,
        "gpu_util_source": sampler.source,
        "engine": engine_description(llm),
    }


def run_hf(
    engine_kwargs: dict[str, Any], args: argparse.Namespace, runner: HFRunner | None = None
) -> tuple[list[BenchRequest], dict[str, Any]]:
    """Build the HF peer from the same engine arguments (or reuse `runner`), then generate the
    workload in static batches."""
    from kvllm.benchmarks.hf_backend import HFRunner
    from kvllm.config.engine import EngineArgs

    engine_args = EngineArgs(**engine_kwargs)
    runner = runner or HFRunner(engine_args, args.hf_attn_implementation)
    requests = make_requests(args, runner.model_config.vocab_size, engine_args.seed)
    max_batch = args.hf_max_batch_size or engine_args.max_num_seqs
    if args.warmup:
        runner.generate_batch([_warmup_request(requests)])
    with GpuUtilSampler() as sampler:
        run = runner.run(requests, max_batch)
    return requests, {
        "elapsed_time": run.elapsed,
        "num_output_tokens": run.num_output_tokens,
        "num_generated_tokens": run.num_generated_tokens,
        "gpu_util": sampler.value,
        "gpu_util_source": sampler.source,
        "engine": {**runner.describe(), "hf_max_batch_size": max_batch},
    }


def run_vllm(
    engine_kwargs: dict[str, Any], args: argparse.Namespace
) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The vLLM peer: one engine from the same engine arguments, the same requests and sampling."""
    from kvllm.benchmarks.vllm_backend import VLLMRunner
    from kvllm.config.engine import EngineArgs

    engine_args = EngineArgs(**{"enable_prefix_caching": False, **engine_kwargs})
    runner = VLLMRunner(engine_args)
    requests = make_requests(args, runner.model_config.vocab_size, engine_args.seed)
    temperature = NANO_VLLM_TEMPERATURE if args.dataset_name == "nano-vllm" else 1.0
    if args.warmup:
        runner.generate([_warmup_request(requests)], 1.0)
    with GpuUtilSampler() as sampler:
        run = runner.generate(requests, temperature)
    return requests, {
        "elapsed_time": run.elapsed,
        "num_output_tokens": run.num_output_tokens,
        "num_generated_tokens": run.num_output_tokens,
        "gpu_util": sampler.value,
        "gpu_util_source": sampler.source,
        "engine": runner.describe(),
    }


def measure_throughput(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    llm: LLM | None = None,
    hf_runner: HFRunner | None = None,
) -> dict[str, Any]:
    """Run the workload on the chosen backend; `llm` / `hf_runner` reuse an engine or HF model already
    built from the same `engine_kwargs`."""
    check_throughput_backend(args.backend)
    engine_kwargs = dict(engine_kwargs)
    if args.dataset_name == "nano-vllm":
        engine_kwargs.setdefault("max_model_len", NANO_VLLM_MAX_MODEL_LEN)
    if args.backend == "kvllm":
        if llm is None:
            llm = build_llm(engine_kwargs, enable_prefix_caching=False)
        engine = llm.llm_engine
        requests = make_requests(args, engine.model_config.vocab_size, engine.args.seed)
        run = run_kvllm(llm, requests, args)
    elif args.backend == "vllm":
        requests, run = run_vllm(engine_kwargs, args)
    else:
        requests, run = run_hf(engine_kwargs, args, hf_runner)
    elapsed = run["elapsed_time"]
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    total_tokens = num_prompt_tokens + run["num_output_tokens"]
    return {
        "benchmark": "throughput",
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "config": {
            "num_prompts": len(requests),
            "input_len": args.input_len if args.dataset_name == "random" else None,
            "output_len": args.output_len if args.dataset_name == "random" else None,
            "random_range_ratio": args.random_range_ratio,
            "hf_max_batch_size": args.hf_max_batch_size,
            "disable_detokenize": args.disable_detokenize,
            "warmup": args.warmup,
        },
        "engine": run["engine"],
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total_tokens,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": run["num_output_tokens"],
        "total_generated_tokens": run["num_generated_tokens"],
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total_tokens / elapsed,
        "output_tokens_per_second": run["num_output_tokens"] / elapsed,
        "gpu_util": run["gpu_util"],
        "gpu_util_source": run["gpu_util_source"],
        "env": environment(),
    }


def print_result(result: dict[str, Any]) -> None:
    print(
        f"Throughput ({result['backend']}, {result['dataset_name']}): "
        f"{result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    print(gpu_util_line(result))


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run the benchmark from the CLI, print it and write --output-json."""
    result = measure_throughput(args, engine_kwargs)
    print_result(result)
    write_json(args.output_json, result)
    return 0
