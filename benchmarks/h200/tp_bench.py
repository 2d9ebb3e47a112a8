"""Tensor parallel on the GPUs of one host: TP=N beside TP=1 (and vLLM with -tp N), one engine per process.

    PYTHONPATH=. python3 benchmarks/h200/tp_bench.py --engine kvllm --tp 2 --out DIR
    PYTHONPATH=.:/tmp/site-vllm python3 benchmarks/h200/tp_bench.py --engine vllm --tp 2 --out DIR

A Qwen3-8B-shaped model (36 layers, hidden 4096, 32 q / 8 KV heads of 128; dummy bf16 weights,
max_model_len 4096, prefix caching off, CUDA graphs on), then, in order:
  latency   batch 1 and 8: 32 random prompt tokens, 128 output tokens, EOS ignored, temperature 0;
            2 warm-up + `--iters` timed runs; ms per output token = batch wall time / 128
  throughput  256 prompts of 256 random tokens, 256 output tokens each, temperature 1.0; output
            tokens per second = output tokens / wall time (one warm-up request first)
Each latency run has fresh prompts (kvllm.benchmarks.datasets, seeded), so no prefill is shortened.
One JSON line per measurement goes to DIR/<engine>-tp<N>.jsonl and to stdout. NCCL's NVLink
multicast stays off (kvllm sets NCCL_NVLS_ENABLE=0 and the others itself; set here for vLLM too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvllm.benchmarks.datasets import BenchRequest, random_requests  # noqa: E402
from kvllm.benchmarks.model_shapes import write_shape_only_model  # noqa: E402
from kvllm.distributed.parallel_state import NVLINK_MULTICAST_OFF  # noqa: E402

LATENCY_BATCHES = (1, 8)
OUTPUT_LEN = 128


def _generate(llm: Any, params_cls: type, requests: list[BenchRequest], temperature: float) -> int:
    params = [
        params_cls(temperature=temperature, ignore_eos=True, max_tokens=r.output_len, detokenize=False)
        for r in requests
    ]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def _engine(name: str, model: str, tp: int) -> tuple[Any, type]:
    common: dict[str, Any] = dict(
        load_format="dummy", dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False,
        tensor_parallel_size=tp, gpu_memory_utilization=0.85,
    )  # fmt: skip
    if name == "kvllm":
        from kvllm import LLM, SamplingParams
    else:
        from vllm import LLM, SamplingParams

        common["skip_tokenizer_init"] = True
    return LLM(model, **common), SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("kvllm", "vllm"), default="kvllm")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.update(NVLINK_MULTICAST_OFF)
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(write_shape_only_model("Qwen3-8B", args.out / "qwen3-8b-shape"))
    sink = (args.out / f"{args.engine}-tp{args.tp}.jsonl").open("w")

    def record(**row: Any) -> None:
        row = {"engine": args.engine, "tp": args.tp, "model": "Qwen3-8B-shape", **row}
        line = json.dumps(row)
        print(line, flush=True)
        sink.write(line + "\n")
        sink.flush()

    start = time.perf_counter()
    llm, params_cls = _engine(args.engine, model, args.tp)
    record(measure="startup", seconds=round(time.perf_counter() - start, 2))
    seed = 0
    for batch in LATENCY_BATCHES:
        times = []
        for i in range(2 + args.iters):
            seed += 1
            requests = random_requests(batch, 32, OUTPUT_LEN, vocab_size=151936, seed=seed)
            t0 = time.perf_counter()
            _generate(llm, params_cls, requests, temperature=0.0)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        times.sort()
        record(
            measure="latency",
            batch=batch,
            ms_per_token_median=round(1000 * times[len(times) // 2] / OUTPUT_LEN, 3),
            ms_per_token_min=round(1000 * times[0] / OUTPUT_LEN, 3),
            runs_s=[round(t, 4) for t in times],
        )
    _generate(llm, params_cls, random_requests(1, 256, 16, vocab_size=151936, seed=999), temperature=1.0)
    requests = random_requests(256, 256, 256, vocab_size=151936, seed=1000)
    t0 = time.perf_counter()
    tokens = _generate(llm, params_cls, requests, temperature=1.0)
    wall = time.perf_counter() - t0
    record(measure="throughput", prompts=256, input_len=256, output_len=256, output_tokens=tokens,
           seconds=round(wall, 3), output_tok_per_s=round(tokens / wall, 1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
