"""TRITON_ATTN's prefill routing end to end: time to first token with the prefill kernel and without.

The prefill kernel (`triton_prefill_attention`) is faster than the unified kernel alone on long
chunks (8 x 2048 causal: 378 against 274 TFLOP/s on the H200) but showed no gain on nano-vllm's mixed
steps. This measures where it pays off in the engine, which sets its default routing
(`KVLLM_TRITON_PREFILL_KERNEL`: auto, the default, routes long chunks only; 1 forces it from 128-token
chunks, 0 never): one engine per setting (the switch is read when piecewise graphs are captured, so a
process keeps it), settings alternated (1, 0, 1, 0 by default; `auto@N` is auto with its threshold moved to
N tokens, to find where it belongs), each timing prefill-only steps of growing length.

    PYTHONPATH=. python3 benchmarks/h200/prefill_routing.py --out DIR            # GPU, about 2 minutes
    PYTHONPATH=. python3 benchmarks/h200/prefill_routing.py --out DIR --model TINY  # CPU smoke run

Cases are `BATCHxPROMPT`: BATCH fresh random prompts of PROMPT tokens in one `generate` call with
max_tokens=1 (one prefill step when they fit the step budget); the time is the median of `--iters`.
One JSON line per (setting, case) goes to DIR/prefill_routing.jsonl and to stdout; the last lines
are a table of medians per setting and each one's speed-up over the unified kernel (setting 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GPU_CASES = ("1x512", "1x1024", "1x2048", "1x4096", "1x8192", "1x16384", "4x2048", "8x2048", "32x512")
TINY_CASES = ("1x64", "2x96")


def parse_case(case: str) -> tuple[int, int]:
    batch, prompt = case.lower().split("x")
    return int(batch), int(prompt)


def run_setting(args: argparse.Namespace) -> int:
    """One engine with KVLLM_TRITON_PREFILL_KERNEL as inherited; one JSON line per case."""
    import torch

    from kvllm import LLM, SamplingParams
    from kvllm.benchmarks.datasets import random_requests
    from kvllm.benchmarks.model_shapes import write_shape_only_model

    cuda = torch.cuda.is_available()
    cases = [parse_case(c) for c in args.cases.split(",")]
    longest = max(p for _, p in cases)
    budget = max(b * p for b, p in cases)
    if args.model:
        model, vocab = args.model, 400
    else:
        model, vocab = str(write_shape_only_model("Qwen3-0.6B", "/tmp/qwen3-0.6b-shape")), 151936
    setting = os.environ.get("KVLLM_TRITON_PREFILL_KERNEL", "auto")
    if args.auto_min_tokens:  # auto@N: the auto route's threshold moved (the engine runs in this process)
        from kvllm.attention.ops import triton_prefill_config

        triton_prefill_config.AUTO_MIN_MEAN_QUERY_LEN = args.auto_min_tokens
        setting = f"auto@{args.auto_min_tokens}"
    llm = LLM(
        model,
        load_format="dummy",
        dtype="bfloat16" if cuda else "float32",
        attention_backend="TRITON_ATTN" if cuda else None,  # the CPU smoke run checks the script only
        max_model_len=longest + 16,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        enforce_eager=not cuda,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    seed = iter(range(1, 1_000_000))

    def once(batch: int, prompt: int) -> float:
        requests = random_requests(batch, prompt, 1, vocab, seed=next(seed))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for batch, prompt in cases:
        for _ in range(args.warmups):
            once(batch, prompt)
        times = [once(batch, prompt) for _ in range(args.iters)]
        record = {
            "prefill_kernel": setting,
            "case": f"{batch}x{prompt}",
            "tokens": batch * prompt,
            "ms": [round(t * 1e3, 3) for t in times],
            "median_ms": round(statistics.median(times) * 1e3, 3),
        }
        print(json.dumps(record), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--model", default=None, help="a model folder instead of Qwen3-0.6B's shapes (CPU checks)"
    )
    parser.add_argument(
        "--cases", default=None, help=f"comma list of BATCHxPROMPT (default {','.join(GPU_CASES)})"
    )
    parser.add_argument(
        "--order",
        default="1,0,1,0",
        help="KVLLM_TRITON_PREFILL_KERNEL per engine, in order; auto@N: auto with its threshold at N tokens",
    )
    # The child's threshold for an auto@N setting.
    parser.add_argument("--auto-min-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=150, help="per engine process")
    parser.add_argument("--setting", action="store_true", help=argparse.SUPPRESS)  # one engine (the child)
    args = parser.parse_args()
    args.cases = args.cases or ",".join(TINY_CASES if args.model else GPU_CASES)
    if args.setting:
        return run_setting(args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = args.order.split(",")
    for setting in settings:  # all checked before the first engine starts
        switch, _, min_tokens = setting.partition("@")
        moved_ok = not min_tokens or (switch == "auto" and min_tokens.isdigit() and int(min_tokens) > 0)
        if switch not in ("0", "1", "auto") or not moved_ok:
            raise SystemExit(f"--order takes 0, 1, auto and auto@TOKENS (TOKENS >= 1), got {setting!r}")
    records: list[dict[str, Any]] = []
    with open(out / "prefill_routing.jsonl", "w") as sink:
        for setting in settings:
            switch, _, min_tokens = setting.partition("@")
            command = [sys.executable, __file__, "--setting", "--out", str(out), "--cases", args.cases,
                       "--iters", str(args.iters), "--warmups", str(args.warmups)]  # fmt: skip
            if args.model:
                command += ["--model", args.model]
            if min_tokens:
                command += ["--auto-min-tokens", min_tokens]
            env = {**os.environ, "KVLLM_TRITON_PREFILL_KERNEL": switch}
            try:
                done = subprocess.run(
                    command, env=env, capture_output=True, text=True, timeout=args.timeout_s
                )
                stdout, failed = done.stdout, done.returncode != 0
                tail = done.stderr[-2000:]
            except subprocess.TimeoutExpired as exc:
                stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                failed, tail = True, f"timed out after {args.timeout_s} s"
            for line in stdout.splitlines():
                if line.startswith("{"):
                    records.append(json.loads(line))
                    sink.write(line + "\n")
                    print(line, flush=True)
            if failed:
                print(f"setting {setting}: the engine process failed: {tail}", flush=True)
    print(summary(records))
    return 0


def summary(records: list[dict[str, Any]]) -> str:
    """Per case: the median over runs of each setting, and each one's speed-up over the unified kernel
    (setting 0; > 1: faster than it)."""
    settings = list(dict.fromkeys(r["prefill_kernel"] for r in records))
    lines = [f"{'case':>9} " + " ".join(f"{'ms (' + s + ')':>11} {'x (' + s + ')':>8}" for s in settings)]
    for case in dict.fromkeys(r["case"] for r in records):
        medians = {}
        for s in settings:
            runs = [r["median_ms"] for r in records if r["case"] == case and r["prefill_kernel"] == s]
            if runs:
                medians[s] = statistics.median(runs)
        cells = []
        for s in settings:
            ms = medians.get(s)
            speed_up = medians["0"] / ms if ms and "0" in medians else None
            cells.append(f"{ms:>11.3f} " if ms else f"{'-':>11} ")
            cells[-1] += f"{speed_up:>7.3f}x" if speed_up else f"{'-':>8}"
        lines.append(f"{case:>9} " + " ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
