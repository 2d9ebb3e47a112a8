"""Where a decode step's host time goes: cProfile of kvllm's engine loop on Qwen3-0.6B shapes.

    PYTHONPATH=. python3 benchmarks/h200/host_profile.py --out DIR [--batches 1,256] [--pyspy-wait] [--prefill]

For each batch size: one warm-up `LLM.generate`, then one under cProfile (32-token prompts, OUTPUT
decode steps, dummy bf16 weights, TRITON_ATTN, graphs and overlap on). Writes DIR/host-bs<B>.txt (the
top functions by own time and by cumulative time) and prints ms per step with and without the
profiler. With --pyspy-wait the script prints its pid and sleeps 1 s before 4 s of unprofiled runs so
that `py-spy record` can attach to it from outside. With --prefill, the same for a request of one
32-token prompt and max_tokens=1 (one eager prefill step and its sampling), into DIR/host-prefill.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvllm.benchmarks.model_shapes import write_shape_only_model  # noqa: E402

OUTPUT = 256


def run(llm, batch: int) -> float:
    import torch

    from kvllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT, detokenize=False)
    prompts = [{"prompt_token_ids": [100 + i] * 32} for i in range(batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / OUTPUT * 1e3


def run_prefill(llm, calls: int = 20) -> float:
    """ms per `generate` of one 32-token prompt with max_tokens=1: an eager prefill step, end to end."""
    import torch

    from kvllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        llm.generate([{"prompt_token_ids": [200 + i] * 32}], params, use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def profile(fn, path: Path) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    result = fn()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats(80)
    path.write_text(text.getvalue())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--pyspy-wait", action="store_true")
    parser.add_argument("--prefill", action="store_true", help="also profile one-token-output requests")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kvllm import LLM

    model = write_shape_only_model("Qwen3-0.6B", "/tmp/qwen3-0.6b-shape")
    llm = LLM(
        str(model),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        attention_backend="TRITON_ATTN",
        enable_prefix_caching=False,
    )
    if args.prefill:
        run_prefill(llm, 3)
        plain = run_prefill(llm)
        profiled = profile(lambda: run_prefill(llm), out / "host-prefill.txt")
        print(f"prefill 1 x 32: {plain:.3f} ms/request plain, {profiled:.3f} under cProfile", flush=True)
    for batch in (int(b) for b in args.batches.split(",") if b):
        plain = run(llm, batch)
        profiled = profile(lambda b=batch: run(llm, b), out / f"host-bs{batch}.txt")
        print(f"batch {batch}: {plain:.3f} ms/step plain, {profiled:.3f} ms/step under cProfile", flush=True)
        if args.pyspy_wait:
            print(f"PYSPY pid {os.getpid()} batch {batch}", flush=True)
            time.sleep(1.0)
            until = time.perf_counter() + 4.0
            while time.perf_counter() < until:
                again = run(llm, batch)
            print(f"batch {batch}: {again:.3f} ms/step (py-spy attached)", flush=True)


if __name__ == "__main__":
    main()
