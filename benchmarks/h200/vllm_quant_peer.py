#!/usr/bin/env python3
"""vLLM 0.22 as issue 22's peer: batch-1 ms per token of bf16 and AWQ on the Llama-3-8B-shaped dummy model.

The same config folders as `quant_bench.py --parts e2e` (kvllm's `write_shape_only_model`, AWQ's
quantization_config for the AWQ one) and the same protocol: 32 random prompt tokens, 128 output tokens at
temperature 1.0 with ignore_eos, one warm-up request, then the median wall time of `--runs` requests / 128
(prefill included). vLLM picks its own kernels (awq_marlin on Hopper for an AWQ checkpoint); the record names
the method it chose. One engine per subprocess, so each gets the whole GPU.

Run on the GPU machine after ../shared/gpu/vllm's two staging runs:
    python3 benchmarks/h200/vllm_quant_peer.py --out $OUT/vllm-quant  (--vllm-site: where stage 2 unpacked vLLM)
One JSON line per engine on stdout and in DIR/vllm_quant_peer.jsonl; `--dry-run` writes the folders only.
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

from benchmarks.h200.quant_bench import ENGINES  # noqa: E402

PEER_ENGINES = ("bf16", "awq")
VLLM_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not in the staged site folder
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def write_folder(out: Path, name: str) -> Path:
    from kvllm.benchmarks.model_shapes import write_shape_only_model

    config, _ = ENGINES[name]
    return write_shape_only_model("Llama-3-8B", out / "models" / name, config)


def engine_child(name: str, folder: str, runs: int) -> None:
    import random

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.85, enable_prefix_caching=False, seed=0, generation_config="vllm")  # fmt: skip
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True)
    rng = random.Random(0)

    def run() -> float:
        prompt = {"prompt_token_ids": [rng.randrange(128000) for _ in range(32)]}
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        assert len(outs[0].outputs[0].token_ids) == 128
        return time.perf_counter() - t

    run()
    walls = [run() for _ in range(runs)]
    model_config = llm.llm_engine.vllm_config.model_config
    record: dict[str, Any] = {
        "part": "vllm-e2e",
        "engine": name,
        "vllm": vllm.__version__,
        "quantization": model_config.quantization,
        "startup_s": round(startup, 1),
        "batch1_ms_per_token": round(statistics.median(walls) / 128 * 1e3, 3),
        "batch1_walls_s": [round(w, 4) for w in walls],
        "gpu": torch.cuda.get_device_name(),
    }
    print("RECORD " + json.dumps(record), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engines", default=",".join(PEER_ENGINES), help=f"comma list of {PEER_ENGINES}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per engine, start-up included")
    parser.add_argument("--vllm-site", default="/tmp/site-vllm", help="prepended to each engine's PYTHONPATH")
    parser.add_argument("--dry-run", action="store_true", help="write the model folders, import no vLLM")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine_child(args.child, args.folder, args.runs)
        return 0
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(PEER_ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; allowed: {', '.join(PEER_ENGINES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name in engines:
        folder = write_folder(args.out, name)
        if args.dry_run:
            print(json.dumps({"engine": name, "folder": str(folder)}))
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--folder",
            str(folder),
            "--runs",
            str(args.runs),
            "--out",
            ".",
        ]
        python_path = os.pathsep.join(p for p in (args.vllm_site, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **VLLM_ENV, "PYTHONPATH": python_path}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            log = f"timed out after {args.timeout_s} s\n{e.stdout or ''}{e.stderr or ''}"
        (args.out / f"vllm-{name}.log").write_text(str(log))
        lines = [line for line in str(log).splitlines() if line.startswith("RECORD ")]
        record = (
            json.loads(lines[-1][7:])
            if lines
            else {"part": "vllm-e2e", "engine": name, "error": str(log)[-2000:]}
        )
        print(json.dumps(record), flush=True)
        records.append(record)
    with open(args.out / "vllm_quant_peer.jsonl", "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    times = {r["engine"]: r.get("batch1_ms_per_token") for r in records}
    if times.get("bf16") and times.get("awq"):
        print(f"vLLM batch 1: bf16 {times['bf16']} ms/token, AWQ {times['awq']} ms/token, "
              f"{times['bf16'] / times['awq']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
