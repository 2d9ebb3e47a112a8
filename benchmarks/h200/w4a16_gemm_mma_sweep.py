#!/usr/bin/env python3
"""The tensor-core W4A16 GEMM (w4a16_gemm_mma.py) against the routes it would replace, M = 2 .. 256.

Llama-3-8B's projections (qkv, o, gate_up, down), group 128, bf16, cold weight copies (about 256 MiB of
them, so L2 holds none), CUDA-graph timing (benchmarks/h200/graph_timing.py). At each M and shape:
  bf16 F.linear (cuBLAS on a bf16 weight), the route without the tensor-core GEMM (`w4a16 before`: the
  GEMV up to 4 rows, the Triton GEMM up to 64, dequantize + cuBLAS beyond; at M = 2 and 4 the GEMM took
  those rows from the GEMV in the twenty-ninth session), the GEMM's default config, then
  its configs (row tile, column tile, K split, warps) until --budget-s runs out (--defaults-only: none).
Every config is checked once against F.linear on the dequantized weight (relative error printed; > 2%
is recorded as a failure and not timed). One JSON line per measurement in DIR/w4a16_gemm_mma.jsonl, a
table of the best per (M, shape) last.

    python3 benchmarks/h200/w4a16_gemm_mma_sweep.py --out DIR [--rows 2,4,8,16,32,64,128,256] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.quant_bench import GROUP, SHAPES, copies, graph_us  # noqa: E402


def candidate_configs(m: int) -> list[Any]:
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import W4A16MMAConfig

    fit = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_ms = sorted({fit, max(16, fit // 2), min(128, fit * 2)})
    configs = []
    for block_m, block_n, split in itertools.product(block_ms, (64, 128, 256), (1, 2, 4)):
        warps = 8 if block_n == 256 else 4
        stages = 3 if block_m * block_n >= 128 * 128 else 4
        configs.append(W4A16MMAConfig(block_m, block_n, split, warps, stages))
        if warps == 8:  # the four pair tiles as one MMA chain (untimed before the twenty-ninth session)
            configs.append(W4A16MMAConfig(block_m, block_n, split, warps, stages, one_dot=True))
    return configs


def sweep_shape(
    m: int, shape: str, deadline: float, emit: Any, defaults_only: bool = False
) -> dict[str, Any] | None:
    """Every implementation at one M and shape (fresh weights); the best tensor-core record, with the bf16
    and before-route times beside it."""
    import torch
    import torch.nn.functional as F

    from kvllm.layers.quantization.ops import w4a16
    from kvllm.layers.quantization.ops.int4_layout import dequantize, pack_kernel_layout
    from kvllm.layers.quantization.ops.w4a16_gemm_mma import default_mma_gemm_config, w4a16_gemm_mma

    dev = torch.device("cuda")
    n, k = SHAPES[shape]
    w4_bytes = n * k // 2 + 2 * 2 * n * (k // GROUP)

    def make_w4() -> tuple:
        q = pack_kernel_layout(torch.randint(0, 16, (n, k), device=dev))
        s = (torch.rand(n, k // GROUP, device=dev) * 0.003 + 0.001).bfloat16()
        z = torch.randint(0, 16, (n, k // GROUP), device=dev).bfloat16()
        return q, s, z

    w4 = copies(make_w4, w4_bytes)
    bf16 = copies(lambda: (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,), n * k * 2)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    reference = F.linear(x.float(), dequantize(*w4[0], GROUP).bfloat16().float())
    base = {"m": m, "shape": shape, "n": n, "k": k}
    best: dict[str, Any] | None = None

    def timed(impl: str, fn: Any, nbytes: int, check: bool = True, **extra: Any) -> float | None:
        nonlocal best
        try:
            err = ((fn(0).float() - reference).abs().max() / reference.abs().max()).item() if check else 0.0
            if err > 0.02:
                emit({**base, "impl": impl, **extra, "error": f"relative error {err:.4f}"})
                return None
            us = graph_us(fn)
        except Exception as e:  # a config that does not compile or launch here: recorded, not fatal
            emit({**base, "impl": impl, **extra, "error": repr(e)[:300]})
            return None
        rec = {**base, "impl": impl, **extra, "us": round(us, 2), "rel_err": round(err, 5),
               "tbps": round((nbytes + 2 * m * (k + n)) / us / 1e6, 3),
               "tflops": round(2 * m * n * k / us / 1e6, 1)}  # fmt: skip
        emit(rec)
        if impl.startswith("mma") and (best is None or us < best["us"]):
            best = rec
        return us

    bf16_us = timed("bf16 F.linear", lambda i: F.linear(x, bf16[i % len(bf16)][0]), n * k * 2, check=False)
    saved, w4a16.MMA_GEMM_MAX_ROWS = w4a16.MMA_GEMM_MAX_ROWS, 0  # the dispatch as it was before
    try:
        before_us = timed("w4a16 before", lambda i: w4a16.w4a16_linear(x, *w4[i % len(w4)], GROUP), w4_bytes)
    finally:
        w4a16.MMA_GEMM_MAX_ROWS = saved
    default = default_mma_gemm_config(m, n, k)
    timed("mma default", lambda i: w4a16_gemm_mma(x, *w4[i % len(w4)], GROUP, config=default), w4_bytes,
          config=list(vars(default).values()))  # fmt: skip
    for config in candidate_configs(m) if not defaults_only else []:
        if time.monotonic() > deadline:
            break
        if config == default or (k // 128) % config.split_k:
            continue
        timed("mma", lambda i, c=config: w4a16_gemm_mma(x, *w4[i % len(w4)], GROUP, config=c), w4_bytes,
              config=list(vars(config).values()))  # fmt: skip
    if best is not None:
        best.update(bf16_us=bf16_us, before_us=before_us)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="2,4,8,16,32,64,128,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--defaults-only", action="store_true", help="time default_mma_gemm_config only")
    args = parser.parse_args()

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "w4a16_gemm_mma.jsonl", "a")
    deadline = time.monotonic() + args.budget_s
    gpu = torch.cuda.get_device_name()

    def emit(rec: dict[str, Any]) -> None:
        rec["gpu"] = gpu
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    best: dict[tuple[int, str], dict[str, Any]] = {}
    for m in [int(r) for r in args.rows.split(",")]:
        for shape in args.shapes.split(","):
            rec = sweep_shape(m, shape, deadline, emit, args.defaults_only)
            if rec is not None:
                best[(m, shape)] = rec
            torch.cuda.empty_cache()
        if time.monotonic() > deadline:
            print(f"budget reached after M = {m}", flush=True)
            break

    print("\nbest tensor-core config per (M, shape), us [block_m, block_n, split, warps, stages, one_dot]:")
    for (m, shape), rec in sorted(best.items()):
        before, bf16_us = rec.get("before_us"), rec.get("bf16_us")
        print(f"M {m:4d} {shape:8s} mma {rec['us']:8.2f} {rec['config']}  before {before}  bf16 {bf16_us}  "
              f"vs before {before / rec['us'] if before else float('nan'):.2f}x  "
              f"vs bf16 {bf16_us / rec['us'] if bf16_us else float('nan'):.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
