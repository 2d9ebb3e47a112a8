"""End-to-end throughput of a DeepSeek-V2-Lite-shaped dummy model with one MLA backend, in bounded phases.

`PYTHONPATH=. python benchmarks/h200/mla_e2e.py DIR --backend TRITON_MLA [--eager] --out FILE.json`
(DIR from `mla_bench.py model DIR`). Phases, each timed and written to FILE.json as soon as it ends, so
a run stopped by a timeout still reports what it finished:
- init: engine start (dummy bf16 weights, KV cache, CUDA-graph capture unless --eager);
- warmup: 8 requests of 32 in / 8 out (compiles what the first steps need);
- batch1: one request of 128 in / 64 out: ms per decode step (after its first token);
- throughput: `--num-prompts` requests of 256 in / 64 out at once: output tok/s overall, and decode tok/s
  over the steps after the last first token.
`--force-graphs` captures with a backend whose graph hooks are not declared yet (FLASHINFER_MLA);
`--profile-host` adds the top functions of a cProfile of the throughput phase (host time per call).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

from kvllm.benchmarks.datasets import random_requests
from kvllm.benchmarks.engine_runner import engine_description, run_batch
from kvllm.sampling_params import SamplingParams


def _batch(llm, num: int, input_len: int, output_len: int, seed: int):
    requests = random_requests(num, input_len, output_len, llm.llm_engine.model_config.vocab_size, seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True) for _ in requests]
    return run_batch(llm.llm_engine, [r.prompt_token_ids for r in requests], params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--backend", required=True)
    parser.add_argument(
        "--prefill-backend", default=None, help="-ac.mla_prefill_backend (default: automatic)"
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--force-graphs",
        action="store_true",
        help="capture decode steps even if the backend declares no graphs",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--profile-host", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    doc: dict = {"backend": args.backend, "eager": args.eager, "phases": {}}

    def done(phase: str, **values) -> None:
        doc["phases"][phase] = values
        args.out.write_text(json.dumps(doc, indent=1))
        print(phase, json.dumps(values), flush=True)

    start = time.perf_counter()
    from kvllm import LLM

    if args.force_graphs:  # a backend whose graph hooks are written but not yet declared
        from kvllm.attention.registry import get_backend_class

        get_backend_class(args.backend).cudagraph_support = "decode_only"

    attention_config = {"mla_prefill_backend": args.prefill_backend} if args.prefill_backend else None
    llm = LLM(
        args.model, load_format="dummy", dtype="bfloat16", attention_backend=args.backend,
        attention_config=attention_config, max_model_len=2048, max_num_seqs=64,
        max_num_batched_tokens=4096, enforce_eager=args.eager, enable_prefix_caching=False, seed=0,
    )  # fmt: skip
    doc["engine"] = engine_description(llm)
    doc["engine"]["mla_prefill_backend"] = llm.llm_engine.executor.worker.model_runner.mla_prefill.name
    done("init", seconds=time.perf_counter() - start)

    t = time.perf_counter()
    _batch(llm, 8, 32, 8, seed=1)
    done("warmup", seconds=time.perf_counter() - t)

    timing = _batch(llm, 1, 128, 64, seed=2)
    decode_s = timing.latency - timing.first_token_latency
    done("batch1", seconds=timing.latency, ttft_s=timing.first_token_latency, ms_per_step=decode_s / 63 * 1e3)

    profiler = cProfile.Profile() if args.profile_host else None
    if profiler is not None:
        profiler.enable()
    n = args.num_prompts
    timing = _batch(llm, n, 256, 64, seed=3)
    if profiler is not None:
        profiler.disable()
    decode_s = timing.latency - timing.first_token_latency
    done(
        "throughput",
        num_prompts=n,
        seconds=timing.latency,
        steps=timing.num_steps,
        output_tok_s=timing.num_output_tokens / timing.latency,
        prefill_s=timing.first_token_latency,
        decode_tok_s=n * 63 / decode_s if decode_s > 0 else None,
    )
    runner = llm.llm_engine.executor.worker.model_runner.graph_runner
    doc["graph_replays"] = runner.num_replays if runner is not None else 0
    doc["graph_sizes"] = sorted(runner.graphs) if runner is not None else []
    args.out.write_text(json.dumps(doc, indent=1))
    print("graph replays", doc["graph_replays"], flush=True)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        doc["host_profile_tottime"] = text.getvalue()[-12000:]
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
