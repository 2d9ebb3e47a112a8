"""F.linear (cuBLAS) against the small-M Triton kernel (kvllm/layers/ops/linear.py) at decode batch sizes.

    PYTHONPATH=. python3 benchmarks/h200/linear_bench.py --out DIR [--quick]

Qwen3-0.6B's four projections per layer (bf16), M = 1, 2, 4, 8, 16 rows. Each timing is a CUDA graph of
LOOP calls replayed REPLAYS times (median per call), so launch overhead is out; every call in the loop
reads a different copy of the weight, together more than the L2 cache, as consecutive layers do in a
decode step. `eager_us` is the mean of EAGER back-to-back calls without a graph (launch overhead in).
Besides the default config the kernel runs a small sweep of tile sizes, K splits, stages and warps
(not with --quick). Effective GB/s counts weight, x and output bytes once. Each result is one JSON line
in DIR/linear_bench.jsonl; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.h200.graph_timing import graph_call_ms  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)
ROWS = (1, 2, 4, 8, 16)
LOOP, REPLAYS, EAGER = 50, 20, 200
COLD_BYTES = 256 << 20  # weight copies per loop: several times the H200's 50 MB L2
DEVICE = "cuda"
SWEEP = [(256, 4, 4), (128, 6, 4), (512, 3, 4), (256, 6, 4), (256, 4, 8)]  # (block_k, stages, warps)


def graph_us(fn: Callable[[int], torch.Tensor]) -> float:
    """Median per-call time of fn(0..LOOP-1) captured in one CUDA graph."""
    return graph_call_ms(fn, LOOP, REPLAYS, warmups=3) * 1e3


def eager_us(fn: Callable[[int], torch.Tensor]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(EAGER):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / EAGER


def timed(fn: Callable[[int], torch.Tensor], moved_gb: float, eager: bool) -> dict[str, Any]:
    us = graph_us(fn)
    return {"us": us, "gbps": moved_gb / us * 1e6, "eager_us": eager_us(fn) if eager else None}


def torch_call(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[int], torch.Tensor]:
    return lambda i: F.linear(x, weights[i % len(weights)])


def kernel_call(x: torch.Tensor, weights: list[torch.Tensor], config: Any) -> Callable[[int], torch.Tensor]:
    from kvllm.layers.ops.linear import linear

    return lambda i: linear(x, weights[i % len(weights)], config=config)


def configs_for(n: int, k: int, dtype: torch.dtype, quick: bool) -> list[Any]:
    """The default config first, then the sweep."""
    from kvllm.layers.ops.linear import LinearConfig, default_config

    configs = [default_config(n, k, dtype)]
    if not quick:
        configs += [
            LinearConfig(bk, split, warps, stages)
            for bk, stages, warps in SWEEP
            for split in (1, 2, 4, 8)
            if split * bk <= k
        ]
    return list(dict.fromkeys(configs))


def bench_shape(name: str, n: int, k: int, quick: bool) -> list[dict[str, Any]]:
    """One JSON row per (M, implementation) for weights [n, k]."""
    from kvllm.layers.ops.linear import linear

    dtype = torch.bfloat16
    w_bytes = n * k * dtype.itemsize
    copies = -(-COLD_BYTES // w_bytes)
    weights = [torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5 for _ in range(copies)]
    configs = configs_for(n, k, dtype, quick)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        moved_gb = (w_bytes + (m * k + m * n) * dtype.itemsize) / 1e9
        ref = F.linear(x, weights[0])
        base = {"shape": name, "n": n, "k": k, "m": m, "dtype": str(dtype)}
        rows.append(base | {"impl": "torch"} | timed(torch_call(x, weights), moved_gb, eager=True))
        for i, config in enumerate(configs):
            err = (linear(x, weights[0], config=config).float() - ref.float()).abs().max().item()
            timing = timed(kernel_call(x, weights, config), moved_gb, eager=i == 0)
            rows.append(
                base
                | {"impl": "triton", "config": asdict(config), "default": i == 0}
                | timing
                | {"max_abs_err": err, "ref_max": ref.abs().max().item()}
            )
        print(
            f"{name} M={m}: torch {rows[-len(configs) - 1]['us']:.2f} us, kernel {rows[-len(configs)]['us']:.2f} us",
            flush=True,
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> float:
    """The summary table; returns the largest kernel - F.linear difference relative to max |y|."""
    print(
        f"\n{'shape':8s} {'N':>5s} {'K':>5s} {'M':>3s} | {'torch us':>8s} {'GB/s':>5s} {'eager':>6s} | "
        f"{'kernel us':>9s} {'GB/s':>5s} {'eager':>6s} {'err':>7s} | {'best us':>7s} {'GB/s':>5s} best config"
    )
    worst = 0.0
    for key in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        group = [r for r in rows if (r["shape"], r["m"]) == key]
        t = next(r for r in group if r["impl"] == "torch")
        d = next(r for r in group if r.get("default"))
        b = min((r for r in group if r["impl"] == "triton"), key=lambda r: r["us"])
        worst = max([worst] + [r["max_abs_err"] / r["ref_max"] for r in group if r["impl"] == "triton"])
        c = b["config"]
        print(
            f"{t['shape']:8s} {t['n']:5d} {t['k']:5d} {t['m']:3d} | {t['us']:8.2f} {t['gbps']:5.0f} "
            f"{t['eager_us']:6.1f} | {d['us']:9.2f} {d['gbps']:5.0f} {d['eager_us']:6.1f} "
            f"{d['max_abs_err']:7.1e} | {b['us']:7.2f} {b['gbps']:5.0f} "
            f"bk{c['block_k']} split{c['split_k']} w{c['num_warps']} s{c['num_stages']}"
        )
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for linear_bench.jsonl")
    parser.add_argument("--quick", action="store_true", help="the default kernel config only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("linear_bench.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.out / "linear_bench.jsonl").open("w") as log:
        for name, (n, k) in SHAPES.items():
            shape_rows = bench_shape(name, n, k, args.quick)
            log.writelines(json.dumps(row) + "\n" for row in shape_rows)
            log.flush()
            rows += shape_rows
    worst = print_table(rows)
    # Two float32 accumulation orders rounded to bfloat16: at most one ulp, 2^-7 of max |y|, apart.
    ok = worst <= 2**-7
    print(f"\nlargest kernel - F.linear difference: {worst:.1e} of max |y| ({'ok' if ok else 'TOO LARGE'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
